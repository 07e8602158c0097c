"""Public entry points (see API.md): on materialized logits `token_logprobs` and `erpo_loss`; for trainers that
compute log-probs themselves `logprob_erpo_loss` and `sample_sums`; `resolve_backend`, the backend rule of all."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import Callable

import torch

from .objective import LossMetrics, LossOutput, erpo_objective
from .reference import reference_token_logprobs
from .segment import SegmentSum
from .validation import (
    FLOAT_DTYPES,
    LogitTransform,
    LossInputs,
    LossOptions,
    check_backend,
    check_rows,
    check_tensor,
    check_token_inputs,
    checks_done,
    plain_number,
    start_loss_input_checks,
    with_option_parameters,
)

TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
# Triton reads TRITON_INTERPRET when a kernel is defined, here at import: set later, it cannot take effect.
INTERPRETER_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"
if TRITON_INSTALLED:  # the Triton path (importing it registers its torch.library ops); else the torch reference only
    from .direct_ops import traced
    from .triton_logits import triton_token_logprobs
    from .triton_logits_loss import triton_logits_loss
    from .triton_objective import fuses, fuses_options, triton_objective
    from .triton_row_checks import RowChecksWithSpans
    from .triton_segment import TritonSegmentSum


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The backend ("triton" | "torch") that every entry point runs for `backend` ("auto" | "triton" | "torch") on
    tensors on `device`: "auto" is Triton on CUDA when Triton is installed, else the torch reference; "triton"
    without Triton raises ImportError, "triton" on non-CUDA tensors without TRITON_INTERPRET=1 ValueError."""
    check_backend(backend)
    device = torch.device(device)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and TRITON_INSTALLED else "torch"
    if not TRITON_INSTALLED:
        raise ImportError("backend='triton' needs the triton package (pip install triton, Linux only); "
                          "use backend='torch' or 'auto' without it")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
                         f"before importing erpo_kernels, or use backend='torch'")
    if device.type != "cuda" and not INTERPRETER_AT_IMPORT:
        raise RuntimeError("TRITON_INTERPRET=1 was set after erpo_kernels was imported, too late for its kernels "
                           "(Triton reads it when they are defined): set it before anything imports erpo_kernels "
                           "or triton (TRITON_INTERPRET=1 python ...), or use backend='torch'")
    return "triton"


def use_triton(backend: str, device: torch.device) -> bool:
    """Whether `resolve_backend` picks the Triton path."""
    return resolve_backend(backend, device) == "triton"


def check_logits(logits, inplace_backward: bool) -> None:
    """The logits path's checks of `logits` [N, V] (float32 / bfloat16 / float16, V > 0), in one step with the
    in-place backward's: inplace_backward=True writes d logits over `logits`, one element per element, so it is
    refused where elements share memory (a dimension of stride 0: an expanded or broadcast tensor), whose rows' writes
    would overwrite each other (a wrong gradient, no error)."""
    check_tensor("logits", logits, ndim=2, floating=True)
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension, got shape "
                         f"{tuple(logits.shape)}")
    if inplace_backward and any(stride == 0 and size > 1 for stride, size in zip(logits.stride(), logits.shape)):
        raise ValueError(f"inplace_backward=True writes d logits into logits, but their elements share memory "
                         f"(stride {tuple(logits.stride())} for shape {tuple(logits.shape)}: an expanded tensor); "
                         f"pass logits.contiguous() or inplace_backward=False")


def per_token_logp_entropy(logits, scored_targets, transform: LogitTransform, triton: bool,
                           inplace_backward: bool = False):
    """(logp [N] fp32, entropy [N] fp32) of the transformed logits on the chosen backend; targets [N] int64 with
    -100 on ignored rows."""
    if triton:
        return triton_token_logprobs(logits, scored_targets, transform, inplace_backward)
    return reference_token_logprobs(logits, scored_targets, transform)


def token_logprobs(logits, targets, *, temperature: float = 1.0, logit_scale: float = 1.0,
                   logit_softcap: float | None = None, return_entropy: bool = False, backend: str = "auto",
                   inplace_backward: bool = False, validate: bool = True):
    """Per-token log-probabilities of the targets.

    logits [N, V] fp32/bf16/fp16, targets [N] int (in [0, V), or -100 for ignored rows); the logits are multiplied by
    logit_scale, soft-capped at logit_softcap (None: not capped) and divided by temperature (`LogitTransform`).
    Returns logp [N] fp32 (0 where target == -100), and entropy [N] fp32 (nats) when return_entropy.
    Differentiable with respect to logits. `inplace_backward` (Triton) writes the gradient into `logits`.
    validate as `erpo_loss`'s: True checks that the targets lie in range (one host read), False skips it (none).
    """
    check_logits(logits, inplace_backward)
    transform = LogitTransform(temperature, logit_scale, logit_softcap)
    scored_targets = check_token_inputs(targets, num_rows=logits.shape[0], vocab_size=logits.shape[1],
                                        device=logits.device, rows_name="logits", validate=validate)
    logp, entropy = per_token_logp_entropy(logits, scored_targets, transform,
                                           use_triton(backend, logits.device), inplace_backward)
    return (logp, entropy) if return_entropy else logp


@with_option_parameters
def erpo_loss(logits, targets, token_kind, sample_index, *, advantages, ref_query_logp=None, query_weight=None,
              old_logp=None, ref_logp=None, token_weight=None, rollout_logp=None, backend: str = "auto",
              inplace_backward: bool = False, validate: bool = True, **options) -> LossOutput:
    """The ERPO loss on logits [N, V] over packed token rows (API.md): targets, token_kind, sample_index [N];
    advantages, ref_query_logp, query_weight [S]; old_logp, ref_logp, token_weight, rollout_logp [N]; options as
    API.md's table (and docs/API.md's additions). validate=False skips the checks that read tensor values (no
    host-device synchronization; API.md).

    Returns a LossOutput whose `loss` is differentiable with respect to `logits`.
    """
    inputs = LossInputs(advantages=advantages, ref_query_logp=ref_query_logp, query_weight=query_weight,
                        old_logp=old_logp, ref_logp=ref_logp, token_weight=token_weight, rollout_logp=rollout_logp)
    return loss_on_logits(logits, targets, token_kind, sample_index, inputs=inputs, options=options, backend=backend,
                          inplace_backward=inplace_backward, validate=validate)


def loss_on_logits(logits, targets, token_kind, sample_index, *, inputs: LossInputs, options: dict, backend: str,
                   inplace_backward: bool = False, validate: bool = True, caller_checks=()) -> LossOutput:
    """`erpo_loss` on its tensors besides the rows as one LossInputs; caller_checks: `check_rows` pairs of the
    caller's own, read with the value checks in their one host read (`start_loss_input_checks`)."""
    check_logits(logits, inplace_backward)

    def token_pass(scored_targets, transform, triton):
        return per_token_logp_entropy(logits, scored_targets, transform, triton, inplace_backward)

    def one_node(scored_targets, opts, row_checks):
        return triton_logits_loss(logits, scored_targets, token_kind, sample_index, inputs=inputs, options=opts,
                                  inplace_backward=inplace_backward, spans=row_checks.spans, counts=row_checks.counts)

    return loss_on_token_rows(
        token_pass, num_rows=logits.shape[0], vocab_size=logits.shape[1], device=logits.device, backend=backend,
        targets=targets, token_kind=token_kind, sample_index=sample_index, inputs=inputs, options=options,
        validate=validate, caller_checks=caller_checks, one_node=one_node)


def loss_on_token_rows(token_pass, *, num_rows: int, vocab_size: int, device: torch.device, backend: str, targets,
                       token_kind, sample_index, inputs: LossInputs, options: dict,
                       validate: bool = True, caller_checks=(), one_node=None) -> LossOutput:
    """The body shared by `erpo_loss` and `logprob_erpo_loss` once their [N, *] source is checked: validate
    the other inputs (`validate`: the value checks too, on the device with Triton), run
    `token_pass(scored_targets [N] int64, LogitTransform, triton) -> (logp [N], entropy [N])` on the chosen backend
    and form the loss (`objective_on_backend`); caller_checks as `loss_on_logits`'. With Triton the value checks'
    one host read comes last, once every kernel of the forward is queued (`start_loss_input_checks`): the device is
    never idle while the host waits, and an input that fails them still raises before the loss is returned (the
    kernels are safe on any row values). With Triton the value checks' kernel also finds each sample's span of rows
    for the objective and writes the scored targets (`triton_row_checks.RowChecksWithSpans`: one kernel and one fill
    for the three); with validate=False the spans kernel does the last two (`RowChecksWithSpans.without_checks`).
    one_node(scored_targets, LossOptions, RowChecksWithSpans) -> LossOutput, when given: the token pass and the
    objective as one autograd node (`triton_logits_loss`, given the spans and the counts the row checks left),
    taken on the Triton path for the options the objective's kernels fuse where nothing traces
    (`direct_ops.traced`); its kernels are queued before the checks' read as the two passes'."""
    triton = use_triton(backend, device)
    row_checks = RowChecksWithSpans() if triton else None
    scored_targets, opts, finish_checks = start_loss_input_checks(
        num_rows=num_rows, vocab_size=vocab_size, device=device, targets=targets, token_kind=token_kind,
        sample_index=sample_index, inputs=inputs, options=options, validate=validate, first_bad_row=row_checks,
        caller_checks=caller_checks, unchecked_scored_targets=None if row_checks is None else row_checks.without_checks)
    spans = None if row_checks is None else row_checks.spans
    if one_node is not None and triton and fuses_options(opts) and not traced():
        out = one_node(scored_targets, opts, row_checks)
        finish_checks()
        return out
    token_logp, entropy = token_pass(scored_targets, opts.logit_transform, triton)
    return objective_on_backend(token_logp, entropy, token_kind, sample_index, inputs=inputs, options=opts,
                                triton=triton, finish_checks=finish_checks, spans=spans)


def objective_on_backend(token_logp, entropy, token_kind, sample_index, *, inputs: LossInputs, options,
                         triton: bool, finish_checks: Callable[[], None] = checks_done, spans=None) -> LossOutput:
    """The loss from token_logp [N] and entropy [N] (or None), both differentiable, inputs and options validated:
    with Triton, the fused objective kernels (`triton_objective`) for the options they fuse, else the reference
    objective on the deterministic per-sample sums; without, the reference objective (`objective.erpo_objective`).
    finish_checks: the input checks' finish() (`start_loss_input_checks`), called after the fused kernels are
    queued (they are safe on any row values) but before the reference objective (it indexes by sample_index).
    (A default rather than `finish_checks or ...`: torch 2.11's Dynamo cannot take the truth value of a closure.)
    spans: each sample's span of scored rows when the row checks found them (`RowChecksWithSpans`), else None."""
    if triton and fuses(options, token_logp, entropy):
        out = triton_objective(token_logp, entropy, token_kind, sample_index, inputs=inputs, options=options,
                               spans=spans)
        finish_checks()
        return out
    finish_checks()
    return erpo_objective(token_logp, entropy, token_kind, sample_index, inputs=inputs, options=options,
                          segment_sum=segment_sum_of(triton))


def value_checks_of(triton: bool):
    """The value checks' device-side form on the Triton path, or None for check_loss_inputs' torch masks: a new
    `triton_row_checks.RowChecksWithSpans` (one host read; its kernel writes the scored targets and leaves each
    sample's span of scored rows in `spans` for the objective, as `loss_on_rows` uses it; `without_checks` forms
    the two with validate=False)."""
    return RowChecksWithSpans() if triton else None


def segment_sum_of(triton: bool):
    """The per-sample sums of the chosen backend: the Triton path's deterministic ones, or the torch reference's."""
    return TritonSegmentSum if triton else SegmentSum


DEFAULT_OPTIONS = LossOptions()   # API.md's defaults; logprob_erpo_loss leaves the logit transform at them


@with_option_parameters
def logprob_erpo_loss(token_logp, token_kind, sample_index, *, entropy=None, advantages, ref_query_logp=None,
                      query_weight=None, old_logp=None, ref_logp=None, token_weight=None, rollout_logp=None,
                      backend: str = "auto", validate: bool = True, **options) -> LossOutput:
    """The ERPO loss (API.md) from per-token log-probs the caller computed (verl's engine): token_logp [N] fp32
    (differentiable; log p(targets[i]) on query and response rows, anything finite elsewhere), entropy [N] fp32 or
    None (differentiable; required when an option reads it: entropy_coef != 0, top_entropy_quantile < 1; None
    leaves the `entropy` and `kept_entropy` metrics absent); token_kind, sample_index [N]; advantages,
    ref_query_logp, query_weight [S]; old_logp, ref_logp, token_weight, rollout_logp [N]; options as API.md's
    table, but for the logit transform (temperature, logit_scale, logit_softcap), which belongs where the log-probs
    are computed. Values and gradients are `erpo_loss`'s on logits that give the same log-probs; `backend` picks the
    objective's kernels and the per-sample sums; `validate` as `erpo_loss`'s.
    """
    check_tensor("token_logp", token_logp, ndim=1, floating=True)
    if token_logp.dtype != torch.float32:
        raise TypeError(f"token_logp must be float32, got {token_logp.dtype}")
    opts = LossOptions.from_kwargs(options)
    moved = [name for name in ("temperature", "logit_scale", "logit_softcap")
             if getattr(opts, name) != getattr(DEFAULT_OPTIONS, name)]
    if moved:
        raise ValueError(f"{', '.join(moved)} act on logits: logprob_erpo_loss takes log-probs already computed; "
                         "apply the transform where they are computed")
    if entropy is None:
        if opts.entropy_coef != 0 or opts.top_entropy_quantile < 1:
            raise ValueError("entropy (per-token entropy [N] fp32) is required when entropy_coef != 0 or "
                             "top_entropy_quantile < 1")
        token_entropy = torch.zeros_like(token_logp)
    else:
        check_tensor("entropy", entropy, ndim=1, length=token_logp.shape[0], device=token_logp.device, floating=True,
                     length_name=" (the length of token_logp)")
        if entropy.dtype != torch.float32:
            raise TypeError(f"entropy must be float32, got {entropy.dtype}")
        token_entropy = entropy
    inputs = LossInputs(advantages=advantages, ref_query_logp=ref_query_logp, query_weight=query_weight,
                        old_logp=old_logp, ref_logp=ref_logp, token_weight=token_weight, rollout_logp=rollout_logp)
    out = loss_on_token_rows(
        lambda scored_targets, transform, triton: (token_logp, token_entropy), num_rows=token_logp.shape[0],
        vocab_size=None, device=token_logp.device, backend=backend, targets=None, token_kind=token_kind,
        sample_index=sample_index, inputs=inputs, options=options, validate=validate)
    if entropy is None:  # the entropy metrics do not apply
        out = dataclasses.replace(out, entropy=torch.full_like(token_logp, float("nan")),
                                  metrics=LossMetrics.for_call(out.metrics, inputs, opts, has_entropy=False))
    return out


def sample_sums(values, sample_index, num_samples: int, *, backend: str = "auto") -> torch.Tensor:
    """Per-sample sums [S] fp32 of `values` [N] (floating, cast to fp32) by `sample_index` [N] int (every entry in
    [0, S); rows that must not count carry 0), differentiable with respect to `values`; num_samples = S, a Python or
    numpy integer. On the Triton backend the sums are deterministic (each sample's rows in a fixed order), as the loss
    forms ell_theta(q)."""
    check_tensor("values", values, ndim=1, floating=True)
    check_tensor("sample_index", sample_index, ndim=1, length=values.shape[0], device=values.device, floating=False,
                 length_name=" (the length of values)")
    num_samples = plain_number(num_samples)   # a numpy integer (len of an array, np.unique's count) as the int it holds
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
        raise ValueError(f"num_samples must be an integer >= 0, got {num_samples!r}")
    check_rows([((sample_index < 0) | (sample_index >= num_samples),
                 lambda row: f"sample_index must lie in [0, {num_samples}) (num_samples); row {row} holds "
                             f"{int(sample_index[row])}")])
    sums = segment_sum_of(use_triton(backend, values.device))(sample_index.long(), num_samples)
    return sums(values.float())


MAX_QUERY_WEIGHT = 2.0   # the upper clip of the static w(q) (paper appendix C); one source for every caller


def query_weights(ref_query_logp: torch.Tensor, max_weight: float | None = MAX_QUERY_WEIGHT, *,
                  mean_surprisal: float | torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Static per-query weights (paper appendix C): s_i = -ell_theta0(q_i), w_i = clip(mean_j s_j / s_i, 0, 2).

    ref_query_logp [Q]: the cached ell_theta0 of every training query (nats, <= 0). max_weight: the upper clip
    (None: unclipped, mean_j s_j / s_i as the official code's per-step current-policy weight). mean_surprisal: the
    mean of s over the set the weights are relative to (nats, > 0; None: these queries' own mean), e.g. the training
    set's for held-out queries, whose weights then sit on the training queries' scale. validate: check the values
    (one host read); False reads nothing and leaves bad values' weights undefined. Returns w [Q] fp32.
    """
    check_tensor("ref_query_logp", ref_query_logp, ndim=1, floating=True)
    if ref_query_logp.numel() == 0:
        raise ValueError("ref_query_logp must hold at least one query")
    # 0 - ell rather than -ell: an empty query's ell = +0.0 is surprisal +0.0 (weight mean / +0 = inf, clipped to
    # max_weight), not -0.0 (weight -inf, clipped to 0)
    surprisal = 0.0 - ref_query_logp.double()
    if mean_surprisal is None:
        mean = surprisal.mean()
    elif isinstance(mean_surprisal, torch.Tensor):
        if mean_surprisal.numel() != 1:
            raise ValueError(f"mean_surprisal must be a finite number > 0 (nats), got {mean_surprisal!r}")
        mean = torch.as_tensor(mean_surprisal, dtype=torch.float64, device=surprisal.device).reshape(())
    else:
        mean = float(mean_surprisal)   # a host number stays on the host: no upload, checked without a read
    if validate:
        _check_surprisal(surprisal, mean, mean_given=mean_surprisal is not None, clipped=max_weight is not None,
                         mean_surprisal=mean_surprisal)
    weights = mean / surprisal
    return (weights if max_weight is None else weights.clamp(0.0, max_weight)).float()


def _check_surprisal(surprisal: torch.Tensor, mean: torch.Tensor | float, *, mean_given: bool, clipped: bool,
                     mean_surprisal) -> None:
    """query_weights' value checks in one host read: every condition on device values is reduced on the device,
    stacked and read together, then the first that fails raises (in the order the checks are listed)."""
    positive = surprisal > 0
    flags = [~torch.isfinite(surprisal).all(), (surprisal < 0).any(), ~positive.any(), ~positive.all()]
    mean_on_device = mean_given and isinstance(mean, torch.Tensor)
    if mean_on_device:
        flags.append(~(torch.isfinite(mean) & (mean > 0)))
    failed = torch.stack(flags).tolist()
    not_finite, positive_logp, all_zero, some_zero = failed[:4]
    bad_mean = failed[4] if mean_on_device else mean_given and not (math.isfinite(mean) and mean > 0)
    if not_finite:
        raise ValueError("ref_query_logp must be finite")
    if positive_logp:
        raise ValueError("ref_query_logp holds a positive log-likelihood; expected values <= 0 (nats)")
    if bad_mean:
        raise ValueError(f"mean_surprisal must be a finite number > 0 (nats), got {mean_surprisal!r}")
    if not mean_given and all_zero:
        raise ValueError("ref_query_logp is 0 for every query (empty queries?): the weights mean(s) / s_i are "
                         "undefined")
    if not mean_given and not clipped and some_zero:
        raise ValueError("ref_query_logp is 0 for some query: its unclipped weight mean(s) / 0 is unbounded")
