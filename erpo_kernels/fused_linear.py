"""The fused linear -> ERPO loss: per-token log-probs and entropies straight from hidden states and the lm_head
weight, never materializing the [N, V] logits (forward or backward).

    z_t   = transform(hidden_t @ weight.T + bias)                (never stored whole)
    logp_t = z_t[target_t] - logsumexp(z_t),   H_t = entropy of softmax(z_t)

transform (`validation.LogitTransform`): times logit_scale, then logit_softcap * tanh(. / logit_softcap) when set,
then / temperature.

Two torch.library op pairs. `erpo::fused_linear_logp_entropy` (+ `_backward`), for `fused_linear_token_logprobs`:
a forward in row chunks (one GEMM with fp32 output per chunk, then the logits path's per-row kernels), and a
backward that forms each chunk's logits again (the gradient is not known in the forward: 8 N D V FLOPs in all),
    dz_j = g_logp (1[j == t] - p_j) - g_H p_j (log p_j + H),   dlogits_j = dz_j * slope_j,
with the target entry formed in fp32 as g_logp (1 - p_t), and slope_j = d z_j / d logits_j = logit_scale / temperature,
times 1 - tanh^2(logit_scale * logits_j / logit_softcap) with a soft-cap; then d hidden and d weight by two GEMMs.
`erpo::fused_linear_erpo_loss_gradients`, for `fused_linear_erpo_loss`: the gradients formed in the forward (6 N D V;
fused_linear_loss.py). Both backends ("torch", "triton") differ only in the per-row kernels.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from .api import objective_on_backend, use_triton, value_checks_of
from .common import host_to_device
from .fused_linear_loss import (
    DEFAULT_WORKSPACE_BYTES,
    ROW_KERNELS,
    RowChecksFailed,
    check_weight_unchanged,
    loss_gradients_op,
    options_argument,
    response_entropies,
    token_backward,
    token_forward,
)
from .lm_head import is_dtensor
from .objective import LossOutput
from .validation import (
    FLOAT_DTYPES,
    LogitTransform,
    LossInputs,
    check_tensor,
    check_token_inputs,
    read_later,
    start_loss_input_checks,
    with_option_parameters,
)


@dataclass(frozen=True)
class FusedLinearKernels:
    """One backend of the fused linear pass (fused_linear_loss.py's chunks with its per-row kernels).

    forward(hidden [N, D], weight [V, D], bias [V] | None, targets [N] int64 (-100 = ignored), LogitTransform)
        -> (logp [N] fp32, entropy [N] fp32, lse [N] fp32)
    backward(hidden, weight, bias, targets, LogitTransform, lse, entropy, grad_logp [N] fp32, grad_entropy [N] fp32,
             needs_hidden, needs_weight, needs_bias) -> (d hidden, d weight, d bias), each None when not needed
    """

    name: str
    forward: Callable
    backward: Callable


def kernels_named(name: str) -> FusedLinearKernels:
    """The backend called `name` ("torch" | "triton": the per-row kernels of the chunks; Triton is imported only
    when they run)."""
    row_kernels = ROW_KERNELS[name]
    return FusedLinearKernels(name, functools.partial(token_forward, kernels=row_kernels),
                              functools.partial(token_backward, kernels=row_kernels))


# torch.library custom ops (torch.compile sees them whole: no graph break, no trace of the block loops). The
# LogitTransform travels as its three fields and the backend as its name, which an op schema accepts; typing's
# Optional / List / Tuple, the forms that older torch's schema inference reads too (`list[...]` is newer).
@torch.library.custom_op("erpo::fused_linear_logp_entropy", mutates_args=())
def fused_linear_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    targets: torch.Tensor, temperature: float, logit_scale: float, logit_softcap: Optional[float],
                    kernels: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [N, D], weight [V, D], bias [V] | None, targets [N] int64, -100 = ignored) -> (logp [N], entropy [N],
    lse [N]) fp32 of the transformed logits on backend `kernels`; lse is not differentiable."""
    return kernels_named(kernels).forward(hidden, weight, bias, targets,
                                          LogitTransform(temperature, logit_scale, logit_softcap))


@torch.library.custom_op("erpo::fused_linear_logp_entropy_backward", mutates_args=())
def fused_linear_backward_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor, grad_logp: torch.Tensor,
                             grad_entropy: torch.Tensor, temperature: float, logit_scale: float,
                             logit_softcap: Optional[float], kernels: str, needs_hidden: bool, needs_weight: bool,
                             needs_bias: bool) -> List[torch.Tensor]:
    """The gradients asked for, in the order d hidden [N, D], d weight [V, D], d bias [V] (an op returns no None),
    of sum(grad_logp * logp + grad_entropy * entropy); lse, entropy, grad_logp, grad_entropy [N] fp32."""
    grads = kernels_named(kernels).backward(
        hidden, weight, bias, targets, LogitTransform(temperature, logit_scale, logit_softcap), lse, entropy,
        grad_logp.float().contiguous(), grad_entropy.float().contiguous(), needs_hidden, needs_weight, needs_bias)
    return [grad for grad in grads if grad is not None]


@fused_linear_op.register_fake
def _(hidden, weight, bias, targets, temperature, logit_scale, logit_softcap, kernels):
    return tuple(hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(3))


@fused_linear_backward_op.register_fake
def _(hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy, temperature, logit_scale, logit_softcap,
      kernels, needs_hidden, needs_weight, needs_bias):
    return [torch.empty_like(tensor) for tensor, needed in ((hidden, needs_hidden), (weight, needs_weight),
                                                              (bias, needs_bias)) if needed]


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, *transform, kernels = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
    ctx.transform = transform
    ctx.kernels = kernels
    ctx.weight_shape = weight.shape
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    """(d hidden, d weight, d bias) for (grad_logp, grad_entropy) [N] (autograd passes zeros for an unused one)."""
    hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
    check_weight_unchanged(weight, ctx.weight_shape)
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]]
    grads = iter(fused_linear_backward_op(hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy,
                                          *ctx.transform, ctx.kernels, *needs))
    return (*(next(grads) if needed else None for needed in needs), None, None, None, None, None)


fused_linear_op.register_autograd(_backward, setup_context=_setup_context)


def check_linear_inputs(hidden, weight, bias) -> None:
    """hidden [N, D], weight [V, D] and bias [V] or None: same float dtype (fp32/bf16/fp16), same device."""
    check_tensor("hidden", hidden, ndim=2, floating=True)
    if hasattr(weight, "ds_id") and weight.numel() == 0:
        raise ValueError("weight is a DeepSpeed ZeRO-3 partitioned parameter (an empty shard outside its module's "
                         "forward); pass the model through erpo_kernels.lm_head.whole_lm_head(model) and run the "
                         "backward inside that block")
    if is_dtensor(weight):
        raise ValueError("weight is a DTensor (an FSDP2 shard outside its module's forward); pass the model through "
                         "erpo_kernels.lm_head.whole_lm_head(model) and run the backward inside that block")
    check_tensor("weight", weight, ndim=2, floating=True)
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} does not match hidden dtype {hidden.dtype}; cast one of them")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must have shape [V, D] with D = hidden.shape[1] = {hidden.shape[1]}, "
                         f"got {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty vocabulary dimension (shape [V, D] with V > 0)")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, length=weight.shape[0], floating=True,
                     length_name=" (V, the rows of weight)")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} does not match hidden dtype {hidden.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden is on {hidden.device}")


def fused_linear_logp_entropy(hidden, weight, bias, scored_targets, transform: LogitTransform, triton: bool):
    """(logp [N] fp32, entropy [N] fp32) of transform(hidden @ weight.T + bias) on validated inputs;
    scored_targets [N] int64 with -100 on ignored rows. Saves nothing for backward when no gradient is needed."""
    logp, entropy, _ = fused_linear_op(hidden, weight, bias, scored_targets.long().contiguous(),
                                       *transform.op_arguments(), "triton" if triton else "torch")
    return logp, entropy


def fused_linear_token_logprobs(hidden, weight, targets, *, bias=None, temperature: float = 1.0,
                                logit_scale: float = 1.0, logit_softcap: float | None = None,
                                return_entropy: bool = False, backend: str = "auto", validate: bool = True):
    """Per-token log-probabilities of the targets under logits = hidden @ weight.T + bias, never materialized; the
    logits are multiplied by logit_scale, soft-capped at logit_softcap (None: not capped) and divided by temperature.

    hidden [N, D], weight [V, D] (the lm_head, may be tied), bias [V] or None, all fp32/bf16/fp16 of one dtype;
    targets [N] int (in [0, V), or -100 for ignored rows). Returns logp [N] fp32 (nats, 0 where target == -100)
    and, when return_entropy, entropy [N] fp32 (nats). Differentiable in hidden, weight and bias. validate as
    `token_logprobs`': True checks that the targets lie in range (one host read), False skips it (none).
    """
    check_linear_inputs(hidden, weight, bias)
    transform = LogitTransform(temperature, logit_scale, logit_softcap)
    scored_targets = check_token_inputs(targets, num_rows=hidden.shape[0], vocab_size=weight.shape[0],
                                        device=hidden.device, rows_name="hidden", validate=validate)
    logp, entropy = fused_linear_logp_entropy(hidden, weight, bias, scored_targets, transform,
                                              use_triton(backend, hidden.device))
    return (logp, entropy) if return_entropy else logp


@with_option_parameters
def fused_linear_erpo_loss(hidden, weight, targets, token_kind, sample_index, *, bias=None, advantages,
                           ref_query_logp=None, query_weight=None, old_logp=None, ref_logp=None,
                           token_weight=None, rollout_logp=None, backend: str = "auto", validate: bool = True,
                           workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, batch_invariant: bool = False,
                           host_layout: torch.Tensor | None = None, **options) -> LossOutput:
    """The ERPO loss (API.md) from hidden [N, D] and the lm_head weight [V, D] (+ bias [V]) without the [N, V]
    logits: targets, token_kind, sample_index [N]; advantages, ref_query_logp, query_weight [S]; old_logp,
    ref_logp, token_weight, rollout_logp [N]; options as API.md's table (and docs/API.md's additions); validate as
    `erpo_loss`'s. workspace_bytes: the budget of the row chunks' buffers (fused_linear_loss.py; default 1 GiB).
    batch_invariant: every logits GEMM of one shape, so a row's log-prob does not depend on the rest of the batch
    (`LogitsBuffer`). host_layout: None, or [2, N] int64 in host memory, token_kind and sample_index as the caller
    holds them there (`ScoredRows.host_layout`, or the host tensors a batch was built from): the chunk plan takes it
    instead of reading the rows on the host (one host read fewer); with validate=True it is checked against the rows
    in the value checks' one read. Returns a LossOutput whose `loss` is differentiable with respect to hidden, weight
    and bias: the gradients are formed in the forward (6 N D V FLOPs) and the backward scales them.
    """
    inputs = LossInputs(advantages=advantages, ref_query_logp=ref_query_logp, query_weight=query_weight,
                        old_logp=old_logp, ref_logp=ref_logp, token_weight=token_weight, rollout_logp=rollout_logp)
    checks = host_layout_checks(host_layout, token_kind, sample_index) if validate is True else []
    return fused_linear_loss_on_rows(hidden, weight, bias, targets, token_kind, sample_index, inputs=inputs,
                                     options=options, backend=backend, validate=validate,
                                     workspace_bytes=workspace_bytes, batch_invariant=batch_invariant,
                                     caller_checks=checks, host_layout=host_layout)


def check_host_layout(host_layout, num_rows: int) -> None:
    """A caller's host_layout: None, or a [2, N] int64 tensor in host memory (one-line errors naming it)."""
    error = host_layout_error(host_layout, num_rows)
    if error is not None:
        raise error


def host_layout_error(host_layout, num_rows: int) -> Exception | None:
    """None when host_layout is None or a [2, num_rows] int64 CPU tensor, else the one-line error naming it."""
    if host_layout is None:
        return None
    if not isinstance(host_layout, torch.Tensor):
        return TypeError(f"host_layout must be a [2, N] int64 CPU tensor (token_kind and sample_index, e.g. "
                         f"ScoredRows.host_layout) or None, got {type(host_layout).__name__}")
    if host_layout.device.type != "cpu":
        return ValueError(f"host_layout must be in host memory (a CPU tensor), got one on {host_layout.device}: it "
                          f"spares the chunk plan a host read; pass None to let the loss read the rows itself")
    if host_layout.dtype != torch.int64:
        return TypeError(f"host_layout must be int64, got {host_layout.dtype}")
    if tuple(host_layout.shape) != (2, num_rows):
        return ValueError(f"host_layout must have shape [2, N] = (2, {num_rows}) (token_kind and sample_index of "
                          f"the N rows of hidden), got {tuple(host_layout.shape)}")
    return None


def host_layout_checks(host_layout, token_kind, sample_index) -> list:
    """The `check_rows` pair that finds the rows where a caller's host_layout [2, N] disagrees with token_kind or
    sample_index [N] (on the device: one upload, no host read of its own; read with the value checks), as a list;
    empty without a host_layout, or when any of the three is malformed: the checks of their forms then raise,
    naming it, before anything is read."""
    rows = (token_kind, sample_index)
    if (host_layout is None
            or not all(isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape == token_kind.shape
                       and t.device == token_kind.device for t in rows)
            or host_layout_error(host_layout, token_kind.shape[0]) is not None):
        return []
    kinds, samples = host_to_device(host_layout, token_kind.device).unbind()
    bad = (kinds != token_kind) | (samples != sample_index)
    return [(bad, lambda row: f"host_layout disagrees with the rows at row {row}: it holds token_kind "
                              f"{int(host_layout[0, row])} and sample_index {int(host_layout[1, row])}, the tensors "
                              f"{int(token_kind[row])} and {int(sample_index[row])}; pass the host copy of these "
                              f"very rows, or host_layout=None")]


class DeferredCheckRead:
    """The value checks' host read left to the op: `start_loss_input_checks(read_code=deferred)` hands the device
    code [1 + K] over (`code`); the op reads it in its one read, with the rows' layout, after its first GEMM is queued,
    and raises RowChecksFailed with the host copy when a row is bad, before it plans anything on the rows. `read()`,
    the checks' finish() (on a failure, or when a caller needs the checks done before the op): that copy when the op
    made one, else a read of its own."""

    def __init__(self):
        self.code, self.host = None, None

    def __call__(self, code: torch.Tensor):
        self.code = code
        return self.read

    def read(self) -> torch.Tensor:
        if self.host is None:
            self.host = read_later(self.code)()
        return self.host


def fused_linear_loss_on_rows(hidden, weight, bias, targets, token_kind, sample_index, *, inputs: LossInputs,
                              options: dict, backend: str, validate: bool = True,
                              workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, batch_invariant: bool = False,
                              caller_checks=(), host_layout: torch.Tensor | None = None) -> LossOutput:
    """`fused_linear_erpo_loss` on its tensors besides the rows as one LossInputs. caller_checks: `check_rows` pairs
    of the caller's own, read with the value checks (`start_loss_input_checks`); host_layout [2, N] int64 in host
    memory: token_kind and sample_index as the caller read them (`ScoredRows.host_layout`), which spares the chunk
    plan its host read."""
    check_linear_inputs(hidden, weight, bias)
    check_host_layout(host_layout, hidden.shape[0])
    if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, int) or workspace_bytes <= 0:
        raise ValueError(f"workspace_bytes must be a positive int (bytes), got {workspace_bytes!r}")
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    triton = use_triton(backend, hidden.device)
    # The value checks' kernels are queued here and their code read by the op with the rows' layout, after its first
    # GEMM (DeferredCheckRead: one host read per call, which waits for no kernel of the op), unless the entropy
    # filter's pre-pass below needs the rows checked first, or under torch.compile (a device-side assert)
    # (The checks' kernel, or with validate=False the spans kernel, writes the scored targets and finds the samples'
    # spans of scored rows, which the op's chunk objective walks for its global factors and the objective's value
    # at the end.)
    deferred, row_checks = DeferredCheckRead(), value_checks_of(triton)
    scored_targets, opts, finish_checks = start_loss_input_checks(
        num_rows=hidden.shape[0], vocab_size=weight.shape[0], device=hidden.device, targets=targets,
        token_kind=token_kind, sample_index=sample_index, inputs=inputs, options=options, validate=validate,
        first_bad_row=row_checks, caller_checks=caller_checks, read_code=deferred,
        unchecked_scored_targets=None if row_checks is None else row_checks.without_checks)
    kernels = "triton" if triton else "torch"
    entropy_pool = None
    pooled = opts.top_entropy_gather is not None and opts.top_entropy_quantile < 1
    if pooled or deferred.code is None or torch.compiler.is_compiling():
        finish_checks()
        deferred.code = None
    if pooled:  # the filter's pool over processes
        with torch.no_grad():
            entropy_pool = opts.top_entropy_gather(response_entropies(
                hidden, weight, bias, scored_targets, token_kind, opts.logit_transform, ROW_KERNELS[kernels],
                workspace_bytes, batch_invariant))
        opts = dataclasses.replace(opts, top_entropy_gather=lambda _entropies: entropy_pool)
    needs = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    tensor_counts = [value if isinstance(value, torch.Tensor) else None for value in (opts.num_items, opts.num_seqs)]
    spans = None if row_checks is None else row_checks.spans
    try:
        outputs = loss_gradients_op(
            hidden, weight, bias, scored_targets, token_kind, sample_index, *inputs.as_kwargs().values(),
            *tensor_counts, entropy_pool, options_argument(opts), kernels, workspace_bytes, batch_invariant, *needs,
            host_layout, deferred.code, spans)
    except RowChecksFailed as failed:
        deferred.host, outputs = failed.code, None
    if outputs is None:  # the op read a bad row's code: the row's own error, raised here (not within the op's)
        finish_checks()
    logp, entropy, anchor, *_ = outputs
    with torch.no_grad():  # the value and metrics, once, on the [N] vectors (the gradients are the op's)
        out = objective_on_backend(logp, entropy, token_kind, sample_index, inputs=inputs, options=opts,
                                   triton=triton, spans=spans)
    return dataclasses.replace(out, loss=out.loss + anchor)
