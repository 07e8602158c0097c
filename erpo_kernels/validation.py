"""Input checks shared by every entry point, the loss options (`LossOptions`, `OPTION_CHOICES`), the transform of
the logits before the softmax (`LogitTransform`) and the optional per-sample / per-row tensors of the loss
(`LossInputs`).

Everything in API.md's Errors section that is not about the logits / hidden / weight tensors lives here, so
the logits path and the fused-linear path reject bad input with the same messages.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import threading
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

IGNORE_INDEX = -100
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
QKL_ESTIMATORS = ("k1", "k2", "k3", "k3-token")
RATIO_LEVELS = ("token", "sequence")
ENTROPY_AGGREGATIONS = ("loss-agg", "token-mean")
PG_OBJECTIVES = ("ppo-clip", "cispo", "sapo", "vespo")  # the per-token policy term (TRL 1.16's loss types' terms)
OPTION_CHOICES: dict[str, tuple[str, ...]] = {  # the loss options that take one of a few strings: name -> allowed
    "qkl_estimator": QKL_ESTIMATORS,
    "loss_agg": LOSS_AGGREGATIONS,
    "ratio_level": RATIO_LEVELS,
    "entropy_agg": ENTROPY_AGGREGATIONS,
    "pg_objective": PG_OBJECTIVES,
}
VESPO_LAMBDA_MIN = 1e-4  # TRL's get_gamma_weights clamps lambda from below at 1e-4
BACKENDS = ("auto", "triton", "torch")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # dtypes of logits / hidden / weight


@dataclass(frozen=True)
class LogitTransform:
    """What every path applies to the logits before the softmax, in this order (defined here once):

        z = logits * logit_scale                        (Cohere's `logit_scale`; Granite's 1 / `logits_scaling`)
        z = logit_softcap * tanh(z / logit_softcap)     (when logit_softcap is set: Gemma 2's final-logit soft-cap)
        z = z / temperature

    The fields are the loss options of the same names; the constructor checks them (messages name the option).
    """

    temperature: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: float | None = None

    def __post_init__(self):
        for name in ("temperature", "logit_scale", "logit_softcap"):  # numpy scalars as Python numbers (plain_number)
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        check_temperature(self.temperature)
        if not _is_finite_number(self.logit_scale) or self.logit_scale <= 0:
            raise ValueError(f"logit_scale must be a finite number > 0, got {self.logit_scale!r}")
        if self.logit_softcap is not None and (not _is_finite_number(self.logit_softcap) or self.logit_softcap <= 0):
            raise ValueError(f"logit_softcap must be None or a finite number > 0, got {self.logit_softcap!r}")

    def op_arguments(self) -> tuple[float, float, float | None]:
        """(temperature, logit_scale, logit_softcap) as floats: how the transform enters a torch.library op."""
        softcap = self.logit_softcap
        return float(self.temperature), float(self.logit_scale), None if softcap is None else float(softcap)


@dataclass(frozen=True)
class LossOptions:
    """The keyword options of `erpo_loss` with API.md's defaults (API.md's options table says what each does).

    The policy term: `pg_objective` picks PPO's clipped surrogate ("ppo-clip", with clip_low / clip_high /
    dual_clip) or TRL 1.16's CISPO ("cispo", cispo_clip_max), SAPO ("sapo", sapo_temperature_pos / _neg) or VESPO
    ("vespo", vespo_k_pos / _lambda_pos / _k_neg / _lambda_neg); `off_policy_mask_threshold` is TRL's off-policy
    sequence mask and `top_entropy_quantile` (with `top_entropy_gather` under data parallelism) TRL's entropy filter.
    """

    qkl_coef: float = 0.01
    qkl_estimator: str = "k3"
    policy_kl_coef: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_level: str = "token"
    temperature: float = 1.0
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    log_ratio_clamp: float = 20.0
    num_items: float | None = None
    num_seqs: float | None = None
    rollout_is_cap: float | None = 2.0
    policy_kl_bias_correction: bool = False
    kl_clamp: float | None = None
    pg_log_ratio_clamp: float | None = None
    entropy_agg: str = "loss-agg"
    qkl_linear_beyond: float = 5.0  # the sequence-level Query-KL estimator is continued linearly beyond |r| > this
    logit_scale: float = 1.0  # LogitTransform: logits * logit_scale before the soft-cap and the temperature
    logit_softcap: float | None = None  # LogitTransform: final-logit soft-cap c * tanh(z / c)
    # The policy term (pg_objective) and TRL's masks on it.
    pg_objective: str = "ppo-clip"
    cispo_clip_max: float = 5.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    top_entropy_gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self):
        for name in OPTION_NAMES:  # a numpy scalar (np.float64(0.1), np.int64(8)) as the Python number it holds
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        for name, choices in OPTION_CHOICES.items():
            _check_choice(name, getattr(self, name), choices)
        LogitTransform(self.temperature, self.logit_scale, self.logit_softcap)  # checks the three
        if not _is_finite_number(self.qkl_linear_beyond) or self.qkl_linear_beyond <= 0:
            raise ValueError(f"qkl_linear_beyond must be a finite number > 0, got {self.qkl_linear_beyond!r}")
        for name in ("clip_low", "clip_high"):
            value = getattr(self, name)
            if not _is_finite_number(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.dual_clip is not None and (not _is_finite_number(self.dual_clip) or self.dual_clip <= 1):
            raise ValueError(f"dual_clip must be None or a number > 1, got {self.dual_clip!r}")
        for name in ("qkl_coef", "policy_kl_coef", "entropy_coef"):
            if not _is_finite_number(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if self.rollout_is_cap is not None and (not _is_finite_number(self.rollout_is_cap) or self.rollout_is_cap <= 0):
            raise ValueError(f"rollout_is_cap must be None or a finite number > 0, got {self.rollout_is_cap!r}")
        if not _is_finite_number(self.log_ratio_clamp) or self.log_ratio_clamp <= 0:
            raise ValueError(f"log_ratio_clamp must be a number > 0, got {self.log_ratio_clamp!r}")
        for name in ("kl_clamp", "pg_log_ratio_clamp"):
            value = getattr(self, name)
            if value is not None and (not _is_finite_number(value) or value <= 0):
                raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")
        if not isinstance(self.policy_kl_bias_correction, bool):
            raise TypeError(f"policy_kl_bias_correction must be True or False, got {self.policy_kl_bias_correction!r}")
        for name in ("num_items", "num_seqs"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}")
            elif value is not None and (not _is_finite_number(value) or value <= 0):
                raise ValueError(f"{name} must be None or a number > 0, got {value!r}")
        self._check_policy_term()

    def _check_policy_term(self):
        """The options of the policy term and of TRL's masks on it."""
        if self.dual_clip is not None and self.pg_objective != "ppo-clip":
            raise ValueError(f"dual_clip applies to pg_objective='ppo-clip' only (TRL's delta: the grpo / bnpo / "
                             f"dr_grpo / dapo / luspo losses), got it with pg_objective={self.pg_objective!r}")
        for name, low in (("cispo_clip_max", 0.0), ("sapo_temperature_pos", 0.0), ("sapo_temperature_neg", 0.0)):
            value = getattr(self, name)
            if not _is_finite_number(value) or value <= low:
                raise ValueError(f"{name} must be a finite number > {low:g}, got {value!r}")
        for name in ("vespo_k_pos", "vespo_k_neg"):
            value = getattr(self, name)
            if not _is_finite_number(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):  # TRL clamps lambda to >= 1e-4: pass max(lambda, 1e-4)
            value = getattr(self, name)
            if not _is_finite_number(value) or value < VESPO_LAMBDA_MIN:
                raise ValueError(f"{name} must be a finite number >= {VESPO_LAMBDA_MIN:g}, got {value!r}")
        if self.off_policy_mask_threshold is not None and not _is_finite_number(self.off_policy_mask_threshold):
            raise ValueError(f"off_policy_mask_threshold must be None or a finite number, got "
                             f"{self.off_policy_mask_threshold!r}")
        if not _is_finite_number(self.top_entropy_quantile) or not 0 <= self.top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile must be a number in [0, 1], got {self.top_entropy_quantile!r}")
        if self.top_entropy_gather is not None and not callable(self.top_entropy_gather):
            raise TypeError(f"top_entropy_gather must be None or a function [n] -> [m], got "
                            f"{type(self.top_entropy_gather).__name__}")

    def __hash__(self) -> int:
        """The dataclass's hash of the fields (equal options hash alike), computed once: an instance is frozen, and a
        loss call looks its options up (`triton_objective.objective_plan`), which hashed the 32 fields anew, ~2 us."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, name) for name in OPTION_NAMES))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        """The fields alone, for pickle and copy: a string's hash differs from one process to the next."""
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    @property
    def logit_transform(self) -> LogitTransform:
        """temperature, logit_scale and logit_softcap as the one object the token pass (every backend) takes."""
        return LogitTransform(self.temperature, self.logit_scale, self.logit_softcap)

    @classmethod
    def from_kwargs(cls, options: dict) -> "LossOptions":
        """Build from `**options`, rejecting unknown names with the list of known ones."""
        check_keywords("LossOptions", options, OPTION_NAMES)
        return cls(**options)


_PLAIN_OPTION_TYPES = frozenset((bool, int, float, str, type(None)))


def loss_options(options: dict) -> LossOptions:
    """`LossOptions.from_kwargs(options)`, built once per distinct set of plain values (numbers, strings, None;
    LossOptions is frozen): a loss call then skips its ~30 us of checks. Options holding a tensor or a function are
    built every time."""
    types = tuple(map(type, options.values()))  # map and zip, not generators: every loss call runs this
    if _PLAIN_OPTION_TYPES.issuperset(types):
        # the value's type is part of the key: True == 1 == 1.0 must not share an entry (a bool is rejected)
        return _plain_loss_options(tuple(zip(options, types, options.values())))
    return LossOptions.from_kwargs(options)


@functools.lru_cache(maxsize=64)
def _plain_loss_options(items: tuple) -> LossOptions:
    return LossOptions.from_kwargs({name: value for name, _, value in items})


# The paper's symbols for the two coefficients, as users who read it first write them.
PAPER_NAMES = {"alpha": "qkl_coef", "beta": "policy_kl_coef"}


def did_you_mean(name: str, known, *, spelled: Callable[[str], str] = repr, cutoff: float = 0.6) -> str | None:
    """"did you mean X?" for a misspelled `name`: X the option the paper's symbol `name` stands for (PAPER_NAMES:
    alpha -> qkl_coef) when `known` has it, else the name of `known` (an iterable of str) closest to it by difflib's
    ratio (at least `cutoff`), written as `spelled(X)` (repr: 'clip_high'); None when none is that close.
    The one suggestion of every "unknown name" error, the kernels' keywords and erpo's settings alike."""
    known = sorted(known)
    if PAPER_NAMES.get(name) in known:
        return f"did you mean {spelled(PAPER_NAMES[name])}?"
    close = difflib.get_close_matches(name, known, n=1, cutoff=cutoff)
    return f"did you mean {spelled(close[0])}?" if close else None


def check_keywords(caller: str, keywords: dict, known) -> None:
    """Raise a TypeError naming the first keyword of `keywords` that `caller` does not take, and the closest
    known name (`did_you_mean`)."""
    for name in keywords:
        if name not in known:
            hint = did_you_mean(name, known) or f"it takes {sorted(known)}"
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}; {hint}")


def option_parameters() -> list[inspect.Parameter]:
    """LossOptions' fields as keyword-only parameters, with their defaults and types: the one definition of the
    options' part of every signature that takes them (`with_option_parameters`)."""
    types = typing.get_type_hints(LossOptions)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=types[f.name])
            for f in fields(LossOptions)]


def with_option_parameters(func):
    """Decorator for `func(..., **options)`: its signature (help(), IDEs, inspect.signature) lists every LossOptions
    field as a keyword-only parameter with its default and type in place of `**options`, and a keyword that is
    neither one of them nor another parameter raises a TypeError with the closest name ("did you mean ...?").
    The options still reach `func` as `**options` (only those the caller passed: LossOptions fills the rest)."""
    signature = inspect.signature(func)
    *named, options = signature.parameters.values()
    if options.kind is not inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"with_option_parameters: {func.__qualname__} must end with **options")
    types = typing.get_type_hints(func)  # the annotations as types, like the options' (not `from __future__` strings)
    parameters = [p.replace(annotation=types.get(p.name, p.annotation)) for p in named] + option_parameters()
    known = {p.name for p in parameters}
    caller = func.__qualname__.removesuffix(".__init__")

    @functools.wraps(func)
    def checked(*args, **kwargs):
        check_keywords(caller, kwargs, known)
        return func(*args, **kwargs)

    checked.__signature__ = signature.replace(
        parameters=parameters, return_annotation=types.get("return", signature.return_annotation))
    return checked


OPTION_NAMES = tuple(f.name for f in fields(LossOptions))  # a constant: torch.compile cannot trace fields(class)


def _per(length: str):
    """An optional tensor field of LossInputs, of length S ("sample") or N ("row")."""
    return field(default=None, metadata={"per": length})


@dataclass(frozen=True)
class LossInputs:
    """The tensors of `erpo_loss` / `fused_linear_erpo_loss` besides the rows themselves (API.md), carried as one
    object from the public functions through validation to the objective. None means absent (see API.md).

    advantages [S] (required); ref_query_logp [S] = ell_theta0(q); query_weight [S] = w(q); old_logp [N], ref_logp
    [N], token_weight [N], rollout_logp [N]. A trainer holding one calls `erpo_loss(..., **inputs.as_kwargs())`.
    """

    advantages: torch.Tensor | None
    ref_query_logp: torch.Tensor | None = _per("sample")
    query_weight: torch.Tensor | None = _per("sample")
    old_logp: torch.Tensor | None = _per("row")
    ref_logp: torch.Tensor | None = _per("row")
    token_weight: torch.Tensor | None = _per("row")
    rollout_logp: torch.Tensor | None = _per("row")

    def as_kwargs(self) -> dict:
        """The keyword arguments of `erpo_loss` / `fused_linear_erpo_loss` (tensors are not copied)."""
        return {name: getattr(self, name) for name in INPUT_NAMES}

    def detached(self) -> LossInputs:
        """These tensors detached (views, not copies): the loss's constants, never differentiated on any backend
        (as TRL's advantages and old / reference log-probs), whether or not the caller's tensors require grad."""
        return LossInputs(**{name: None if tensor is None else tensor.detach()
                             for name, tensor in self.as_kwargs().items()})


INPUT_NAMES = tuple(f.name for f in fields(LossInputs))  # LossInputs' fields in order, a constant (as below)
# LossInputs' per-sample fields (advantages has no "per": it is one), a constant: fields() costs ~5 us a call
PER_SAMPLE_INPUTS = tuple(f.name for f in fields(LossInputs) if f.metadata.get("per", "sample") == "sample")
# (name, "sample" or "row") of LossInputs' optional fields, a constant for the same reason
OPTIONAL_INPUTS = tuple((f.name, f.metadata["per"]) for f in fields(LossInputs) if "per" in f.metadata)


def plain_number(value):
    """`value` as a Python int / float when it is another real number (a numpy scalar, np.float64 among them, which
    subclasses float), else `value` itself (a bool, a tensor, a string, None): what the options hold and the checks,
    the caches and the fused path's option string read."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, torch.Tensor)) and type(value) not in (
            int, float):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value


def _is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_temperature(temperature) -> None:
    if not _is_finite_number(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


NO_TRANSFORM = LogitTransform()  # the identity: logits as they are


def check_backend(backend) -> None:
    _check_choice("backend", backend, BACKENDS)


def check_tensor(name: str, tensor, *, ndim: int, length: int | None = None, device=None,
                 floating: bool | None = None, length_name: str = "") -> None:
    """Raise a TypeError/ValueError naming `name` if `tensor` is not a tensor of the expected rank,
    leading length, device and dtype kind."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(tensor.shape)}")
    if length is not None and tensor.shape[0] != length:
        raise ValueError(f"{name} must have length {length}{length_name}, got shape {tuple(tensor.shape)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the scored rows (logits / hidden) are on {device}")
    if floating is True and not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if floating is False and (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {tensor.dtype}")


COMPILED_ROWS_MESSAGE = ("erpo_kernels: an input row is invalid (targets, token_kind, sample_index, token_weight or "
                         "rollout_logp), or host_layout disagrees with the rows, or completion_mask with "
                         "attention_mask; call the loss without torch.compile to see which row and why")


def check_rows(checks) -> None:
    """`checks`: (bad-row mask [N] bool, message(row) -> str) pairs. When no row is bad this costs one host-device
    sync for all of them together; otherwise raises ValueError(message(first bad row)) of the first failing check.
    Under torch.compile (no host sync, no data-dependent message) one device-side assert stands for them all."""
    if torch.compiler.is_compiling():
        torch._assert_async(~torch.stack([bad.any() for bad, _ in checks]).any(), COMPILED_ROWS_MESSAGE)
        return
    if not bool(torch.stack([bad.any() for bad, _ in checks]).any()):
        return
    for bad, message in checks:
        if bool(bad.any()):
            raise ValueError(message(int(bad.nonzero()[0, 0])))


def target_range_check(targets: torch.Tensor, scored: torch.Tensor, vocab_size: int):
    """The `check_rows` pair for targets on `scored` rows lying in [0, vocab_size)."""
    return scored & ((targets < 0) | (targets >= vocab_size)), target_message(targets, vocab_size)


def target_message(targets: torch.Tensor, vocab_size: int):
    """message(row) for a target outside [0, vocab_size) on a scored row."""
    return lambda row: f"targets must lie in [0, {vocab_size}) on scored rows; row {row} holds {int(targets[row])}"


def scored_targets_of(targets: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """targets as int64 on `scored` rows, -100 elsewhere. -100 goes in as a Python number (a fill kernel on the
    device): a host 0-dim tensor instead saves that kernel on the CPU but on CUDA becomes a copy from pageable memory,
    a host sync (the H200's kernel tier, test_launch_counter.py::test_cuda_agrees_on_the_entry_points)."""
    return torch.where(scored, targets.long(), IGNORE_INDEX)


def check_token_inputs(targets, *, num_rows: int, vocab_size: int, device: torch.device,
                       rows_name: str, validate: bool = True) -> torch.Tensor:
    """Validate `targets` [N] of `token_logprobs` / `fused_linear_token_logprobs` (their `LogitTransform` checks
    itself). Returns targets as int64 (-100 stays on ignored rows); `rows_name` names the [N, *] tensor in messages.
    validate: as the loss's (`start_loss_input_checks`): False skips the range check, the one that reads values.
    """
    check_validate(validate)
    check_tensor("targets", targets, ndim=1, length=num_rows, device=device, floating=False,
                 length_name=f" (rows of {rows_name})")
    scored = targets != IGNORE_INDEX
    if validate:
        check_rows([target_range_check(targets, scored, vocab_size)])
    return scored_targets_of(targets, scored)


ROW_CHECKS = ("token_kind", "sample_index", "targets", "token_weight", "rollout_logp")  # the value checks, in order


def check_validate(validate) -> None:
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be True or False, got {validate!r}")


def sample_count(inputs: LossInputs, sample_index: torch.Tensor, token_kind: torch.Tensor) -> tuple[int, str]:
    """(S, why): the number of samples, the length the per-sample tensors given (advantages, ref_query_logp,
    query_weight) share, and what says so, for messages. When they disagree: the length most of them have; on a tie,
    the one that covers the samples the scored rows name (1 + their largest sample_index, read only on this way to
    an error), else advantages'. The tensor of another length is the one then reported."""
    given = {}
    for name in PER_SAMPLE_INPUTS:
        tensor = getattr(inputs, name)
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 1:
            given[name] = tensor.shape[0]
    lengths = list(given.values())
    if lengths.count(lengths[0]) == len(lengths):  # they agree (every call that raises no error): the count is theirs
        return lengths[0], "the length of " + " and ".join(given)
    votes = {length: lengths.count(length) for length in lengths}
    best = [length for length, count in votes.items() if count == max(votes.values())]
    named = None
    if len(best) > 1 and bool((token_kind != 0).any()):
        named = int(sample_index[token_kind != 0].max()) + 1
        best = [length for length in best if length == named] or best
    num_samples = best[0] if len(best) == 1 else given["advantages"]
    why = " and ".join(name for name, length in given.items() if length == num_samples)
    why = f"the length of {why}" + (", and the samples sample_index names on scored rows" if named == num_samples
                                    else "")
    return num_samples, why


def check_loss_inputs(**arguments):
    """Validate the non-logits inputs of `erpo_loss` / `fused_linear_erpo_loss` (`start_loss_input_checks`'
    keyword arguments), the value checks finished before returning `(scored_targets, LossOptions)`."""
    scored_targets, opts, finish = start_loss_input_checks(**arguments)
    finish()
    return scored_targets, opts


def start_loss_input_checks(*, num_rows: int, vocab_size: int | None, device: torch.device, targets, token_kind,
                            sample_index, inputs: LossInputs, options: dict, validate: bool = True,
                            first_bad_row: Callable | None = None, caller_checks=(),
                            unchecked_scored_targets: Callable | None = None,
                            read_code: Callable[[torch.Tensor], Callable[[], torch.Tensor]] | None = None):
    """Validate the non-logits inputs of `erpo_loss` / `fused_linear_erpo_loss`; with `targets=None` (and
    `vocab_size=None`), those of `erpo_objective` on log-probs a caller scored itself (verl's).

    validate=False skips the checks that read tensor values (ROW_CHECKS: no host-device synchronization).
    `first_bad_row(token_kind, sample_index, targets, token_weight, rollout_logp, num_samples, vocab_size)`, when
    given, runs those checks on the device instead of the torch masks below, returning a [1] int64 code
    check * N + row (`triton_row_checks`; N * len(ROW_CHECKS) when every row passes), or (that code, the scored
    targets below) when it forms them too (`triton_row_checks.RowChecksWithSpans`); its one host read is left to
    `finish()`, so that a caller can queue its kernels first (they must then be safe on any row values) and the
    device never waits for the host's read. Returns `(scored_targets [N] int64 with -100 on rows of kind 0, or
    None without targets, LossOptions, finish)`; finish() raises the first bad row's ValueError, if any.
    caller_checks: `check_rows` pairs of the caller's own (`padded_erpo_loss`'s mask check), run when validate, read
    in the same host read as the value checks and raised before them.
    `unchecked_scored_targets(token_kind, sample_index, targets, num_samples)`, when given, forms the scored targets
    with validate=False and targets instead of the mask and `where` below (`triton_row_checks.RowChecksWithSpans`'
    `without_checks`: the spans kernel writes them).
    `read_code(code)`: how first_bad_row's code [1] (or [1 + K]) is to be read, a function returning its host copy
    (default `read_code_later`: a copy queued now, into a pinned buffer reused call after call); the fused path's
    hands the code to its op, which reads it with the rows' layout in one read (`fused_linear.DeferredCheckRead`).
    """
    check_validate(validate)
    opts = loss_options(options)
    n = num_rows
    if targets is not None:
        check_tensor("targets", targets, ndim=1, length=n, device=device, floating=False,
                     length_name=" (the number of rows N)")
    check_tensor("token_kind", token_kind, ndim=1, length=n, device=device, floating=False,
                 length_name=" (the number of rows N)")
    check_tensor("sample_index", sample_index, ndim=1, length=n, device=device, floating=False,
                 length_name=" (the number of rows N)")
    advantages = inputs.advantages
    if advantages is None:
        raise ValueError("advantages is required: a [S] tensor, one advantage per sample")
    check_tensor("advantages", advantages, ndim=1, device=device, floating=True)
    num_samples, why = sample_count(inputs, sample_index, token_kind)
    if num_samples == 0 and n > 0:  # even rows of kind 0 are mapped to a sample (0) by the loss
        raise ValueError(f"advantages must hold at least one sample (S >= 1) when there are rows (N = {n}), "
                         f"got shape {tuple(advantages.shape)}")
    lengths = {"sample": (num_samples, f" (S, {why})"), "row": (n, " (the number of rows N)")}
    check_tensor("advantages", advantages, ndim=1, length=num_samples, length_name=lengths["sample"][1])
    for name, per in OPTIONAL_INPUTS:
        tensor = getattr(inputs, name)
        if tensor is not None:
            length, length_name = lengths[per]
            check_tensor(name, tensor, ndim=1, length=length, device=device, floating=True,
                         length_name=length_name)
    ref_query_logp, ref_logp = inputs.ref_query_logp, inputs.ref_logp
    token_weight, rollout_logp = inputs.token_weight, inputs.rollout_logp

    if opts.qkl_coef != 0 and opts.qkl_estimator != "k3-token" and ref_query_logp is None:
        raise ValueError(f"ref_query_logp (the cached ell_theta0(q), shape [S]) is required when qkl_coef != 0 "
                         f"with qkl_estimator={opts.qkl_estimator!r}")
    if opts.qkl_coef != 0 and opts.qkl_estimator == "k3-token" and ref_logp is None:
        raise ValueError("ref_logp (reference log-probs, shape [N]) is required with qkl_estimator='k3-token'")
    if opts.policy_kl_coef != 0 and ref_logp is None:
        raise ValueError("ref_logp (reference log-probs, shape [N]) is required when policy_kl_coef != 0")

    def messages() -> dict:  # ROW_CHECKS' messages, naming the row; made only where a row fails (or to check rows)
        return {
            "token_kind": lambda row: f"token_kind must be 0, 1 or 2; row {row} holds {int(token_kind[row])}",
            "sample_index": lambda row: f"sample_index must lie in [0, {num_samples}) (S = len(advantages)) on "
                                        f"scored rows; row {row} holds {int(sample_index[row])}",
            "targets": target_message(targets, vocab_size),
            "token_weight": lambda row: f"token_weight must be finite and >= 0 on scored rows; row {row} holds "
                                        f"{float(token_weight[row])}",
            "rollout_logp": lambda row: f"rollout_logp is NaN on response row {row}",
        }
    if validate and first_bad_row is not None:
        code = first_bad_row(token_kind, sample_index, targets, token_weight, rollout_logp, num_samples, vocab_size)
        code, scored_targets = code if isinstance(code, tuple) else (code, None)
        if caller_checks:  # [1 + K]: the code, then whether each caller check fails
            code = torch.cat((code, torch.stack([bad.any() for bad, _ in caller_checks]).long()))
        read_host_code = (read_code or read_code_later)(code)
        if scored_targets is None and targets is not None:
            scored_targets = scored_targets_of(targets, token_kind != 0)
        return scored_targets, opts, lambda: raise_first_bad_row(read_host_code(), n, messages, caller_checks)
    if not validate and targets is not None and unchecked_scored_targets is not None:
        return unchecked_scored_targets(token_kind, sample_index, targets, num_samples), opts, checks_done
    scored = token_kind != 0
    scored_targets = None if targets is None else scored_targets_of(targets, scored)
    if validate:
        masks = {  # the bad rows of each check present
            "token_kind": lambda: (token_kind < 0) | (token_kind > 2),
            "sample_index": lambda: scored & ((sample_index < 0) | (sample_index >= num_samples)),
            "targets": lambda: target_range_check(targets, scored, vocab_size)[0],
            "token_weight": lambda: scored & ~(torch.isfinite(token_weight) & (token_weight >= 0)),
            "rollout_logp": lambda: (token_kind == 2) & rollout_logp.isnan(),
        }
        present = {"targets": targets, "token_weight": token_weight, "rollout_logp": rollout_logp}
        message = messages()
        check_rows([*caller_checks, *((masks[name](), message[name]) for name in ROW_CHECKS
                                      if present.get(name, True) is not None)])
    return scored_targets, opts, checks_done


def checks_done() -> None:
    """finish() of checks that ended when they started."""


class _PinnedRead:
    """One host read's place (`read_later`): a pinned host buffer of a value's shape and dtype, and a CUDA event
    recorded after the value's copy into it; `busy` from the copy until the read."""

    def __init__(self, value: torch.Tensor):
        self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        self.copied = torch.cuda.Event()
        self.busy = False


_REUSED_READS = threading.local()  # this thread's {(device, shape, dtype): _PinnedRead} of read_later(reuse=True)


def _reused_read(value: torch.Tensor) -> _PinnedRead:
    """This thread's place for values of `value`'s device, shape and dtype, made at the first call, or anew when the
    previous one's read is pending (the new one is then the one the later calls reuse)."""
    reads = _REUSED_READS.__dict__
    key = (value.device, value.shape, value.dtype)
    place = reads.get(key)
    if place is None or place.busy:
        place = reads[key] = _PinnedRead(value)
    return place


def read_later(value: torch.Tensor, reuse: bool = False) -> Callable[[], torch.Tensor]:
    """A function returning `value`'s contents, readable on the host, that waits only for the work queued before
    this call: on CUDA the value is copied now, asynchronously, into pinned host memory and the function waits for
    that copy alone (kernels queued in between keep running while the host reads); elsewhere, and under
    torch.compile, `value` itself.

    reuse=False: each call's pinned buffer and event are its own (the caller may keep the host tensor). reuse=True:
    this thread's buffer and event for values of that device, shape and dtype, reused by each call after the
    previous one's read (a pinned allocation, its release and an event's creation and destruction fewer per call:
    host time on CUDA only), so the host tensor holds the value until this thread's next such read: read it before.
    A call made while an earlier one's read is pending (its copy in flight, or a read that never came: an error in
    between) gets a new buffer, which the later calls reuse; the pending one stays its reader's."""
    if value.device.type != "cuda" or torch.compiler.is_compiling():
        return lambda: value
    place = _reused_read(value) if reuse else _PinnedRead(value)
    place.busy = True
    place.host.copy_(value, non_blocking=True)
    # the copy's stream, that of value's device, which need not be the current device
    place.copied.record(torch.cuda.current_stream(value.device))

    def read():
        place.copied.synchronize()
        place.busy = False
        return place.host
    return read


def read_code_later(code: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`read_later(code, reuse=True)` for the value checks' code [K] int64 (`start_loss_input_checks`' default
    read_code), whose reader reads it at once."""
    return read_later(code, reuse=True)


def rows_passed(code: torch.Tensor, num_rows: int) -> bool:
    """Whether the value checks' host code [1] or [1 + K] (`raise_first_bad_row`'s) says that every row passed."""
    value, *failing = code.tolist()
    return value == num_rows * len(ROW_CHECKS) and not any(failing)


def raise_first_bad_row(code: torch.Tensor, num_rows: int, messages: Callable[[], dict], caller_checks=()) -> None:
    """Raise ValueError(messages()[check](row)) for `code` [1] int64 = check * N + row (`check_loss_inputs`); nothing
    when code = N * len(ROW_CHECKS). With `caller_checks`, code [1 + K] also holds whether each fails (1), which
    raises first (`check_rows`: their bad rows are read on that way only). One host read; under torch.compile a
    device-side assert instead."""
    passed = num_rows * len(ROW_CHECKS)
    if torch.compiler.is_compiling():
        torch._assert_async((code[0] == passed) & (code[1:] == 0).all(), COMPILED_ROWS_MESSAGE)
        return
    value, *failing = code.tolist() if caller_checks else (code.item(),)
    if any(failing):
        check_rows(caller_checks)
    if value < passed:
        check, row = divmod(value, num_rows)
        raise ValueError(messages()[ROW_CHECKS[check]](row))
