"""One adapter per contender, with a common interface.

A `Contender` says what it is (path, what loss it computes, whether it is ours) and, given a `Problem`, returns
a `Prepared` case: `run()` computes the 0-dim loss with autograd on, `inputs` are the tensors fwd+bwd
differentiates, and `to_canonical(grads)` maps their gradients back onto the problem's own tensors
({"logits": [N, V]} or {"hidden": [N, D], "weight": [V, D]}; a per-row gradient may also come as [S, T, ...])
for the correctness check.

What each peer computes:
- erpo / torch / compile / cce compute the ERPO loss with the paper's options (ERPO_OPTIONS) and query weights.
- liger computes GRPO (no Query-KL, no query weight), Liger's "dapo" loss (token mean). So that it does the same
  work as ERPO on the same rows, every scored row is given to it as a completion row; it is checked against
  erpo_kernels' torch reference configured to that same loss (all scored rows as response rows, qkl_coef=0).

Peers that are not installed are reported, not crashed on. Imports happen inside the adapters, so that
`TRITON_INTERPRET=1` (set by `python -m bench --smoke`) is in place before any Triton kernel is defined.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from .formula import plain_erpo_from_hidden, plain_erpo_from_logits, plain_erpo_from_logp
from .geometry import (
    EPILOGUE_KEY_FORM,
    KEY_FORM,
    epilogue_knobs,
    fused_constants,
    fused_knobs,
    is_epilogue_key,
    is_geometry_key,
    parse_epilogue_key,
    parse_geometry_key,
)
from .problem import Problem

# The paper's options (alpha = 0.01, clip 0.2); the rest are API.md's defaults.
ERPO_OPTIONS = {"qkl_coef": 0.01, "clip_low": 0.2, "clip_high": 0.2}
LOG_RATIO_CLAMP = 20.0  # API.md default; the plain formula needs it spelled out
CONTENDER_KEYS = ("erpo", "erpo-block", "erpo-warp", "erpo-warp-1024", "erpo-log2", "erpo-log2-2048", "erpo-ws2g",
                  "erpo-dh32", "erpo-epi", "erpo-invariant", "torch", "compile", "liger", "cce")
# erpo-ws2g's workspace_bytes: twice the library's default, a budget a user with the memory may set (erpo's
# trainer.loss_workspace_mib, ERPOConfig.loss_workspace_mib); bench/measured/h100-2026-11-26-55b63b0/ has the curve
WS2G_BYTES = 2 << 30


@dataclass
class Prepared:
    """A contender bound to one problem (see module docstring)."""

    run: Callable[[], torch.Tensor]
    inputs: list
    to_canonical: Callable[[list], dict]

    def step(self) -> list:
        """One fwd+bwd as a trainer's step makes it, the call every timing tool times (the bench's fwd+bwd, the
        fused probe, the kernel profile): the inputs' `.grad` set to None (`optimizer.zero_grad()`, whose
        set_to_none=True is torch's default since 2.0, as TRL's and verl's trainers call it), `run().backward()`
        (autograd's AccumulateGrad takes each fresh gradient as `.grad`, a copy only where its layout differs from
        the input's: the same for every contender), then the gradients handed back and `.grad` set to None again,
        so that no contender's gradients outlive its call beside the next contender's. Returns the gradients, one per
        input (the inputs are leaves: bench.problem)."""
        for tensor in self.inputs:
            tensor.grad = None
        self.run().backward()
        grads = [tensor.grad for tensor in self.inputs]
        for tensor in self.inputs:
            tensor.grad = None
        return grads


@dataclass
class Contender:
    """A benchmarked implementation on one path ("logits" or "fused")."""

    key: str          # one of CONTENDER_KEYS, a geometry's (erpo_geometry) or an epilogue GEMM's (erpo_epilogue)
    path: str
    label: str        # the call that is timed
    ours: bool
    computes: str     # "erpo" or "grpo" (see module docstring)
    distribution: str | None  # the pip distribution that provides it, for its version
    prepare: Callable[[Problem], Prepared]
    requirement: Callable[[torch.device], tuple | None]  # None when usable, else (status, why not)
    # what every call of the contender runs under (bench.run: its prepare, check, timing and peak memory)
    knobs: Callable[[], ContextManager] = contextlib.nullcontext

    @property
    def held_to_ours(self) -> bool:
        """Checked with ours' tolerance (bench.check.OURS): ours and every variant of ours (erpo-ws2g, erpo-dh32,
        erpo-epi, erpo-geom-*, the kernel variants), whose rows are not `ours` but whose errors are ours (all well
        inside OURS on the H100 and H200 at full size, bench/measured/; erpo-dh32 and erpo-epi not yet run there)."""
        return self.ours or self.key.startswith("erpo")

    def version(self) -> str | None:
        """Installed version of the providing distribution (None for torch-only contenders)."""
        if self.distribution is None:
            return None
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None


def _erpo_tensors(problem: Problem) -> dict:
    return {"advantages": problem.advantages, "ref_query_logp": problem.ref_query_logp,
            "query_weight": problem.query_weight, "old_logp": problem.old_logp}


def _plain_args(problem: Problem) -> tuple:
    return (problem.targets, problem.token_kind, problem.sample_index, problem.advantages, problem.ref_query_logp,
            problem.query_weight, problem.old_logp)


def _plain_options() -> dict:
    return {**ERPO_OPTIONS, "log_ratio_clamp": LOG_RATIO_CLAMP}


def _identity_logits(grads):
    return {"logits": grads[0]}


def _identity_fused(grads):
    return {"hidden": grads[0], "weight": grads[1]}


def grpo_mask(problem: Problem) -> torch.Tensor:
    """[S, T] int32: 1 on every scored row (query and response), 0 on kind-0 rows: the rows a GRPO peer scores."""
    rows = problem.rows_per_sample
    return (problem.token_kind != 0).to(torch.int32).view(-1, rows).contiguous()


# ---- requirements -------------------------------------------------------------------------------------------

def _module_requirement(module: str, attribute: str | None = None, hint: str = ""):
    def requirement(device: torch.device) -> tuple | None:
        try:
            loaded = importlib.import_module(module)
        except ImportError as error:
            return "not installed", f"{error.__class__.__name__}: {error}{hint}"
        except Exception as error:  # e.g. a peer built against another torch/triton: report it, keep going
            return "unavailable", f"import {module} failed: {error.__class__.__name__}: {error}"
        if attribute is not None and not hasattr(loaded, attribute):
            return "unavailable", f"{module} has no {attribute}"
        return None
    return requirement


def _triton_requirement(module: str, attribute: str, hint: str = ""):
    """Importable, and on a CPU device only under the Triton interpreter."""
    base = _module_requirement(module, attribute, hint)

    def requirement(device: torch.device) -> tuple | None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "unavailable", "Triton kernels need CUDA, or TRITON_INTERPRET=1 on CPU"
        return base(device)
    return requirement


def _cuda_requirement(module: str, attribute: str, hint: str, why: str):
    """Importable, and a CUDA device (for kernels that do not run under the Triton interpreter)."""
    base = _module_requirement(module, attribute, hint)

    def requirement(device: torch.device) -> tuple | None:
        missing = base(device)
        if missing is None and device.type != "cuda":
            return "unavailable", why
        return missing
    return requirement


def _no_requirement(device: torch.device) -> tuple | None:
    return None


# ---- ours and the torch reference ------------------------------------------------------------------------------

def _erpo_logits(backend: str, forward_variant: str | None = None):
    """erpo_loss on the logits; `forward_variant`: one of triton_logits.FORWARD_VARIANTS for the forward kernel."""
    def prepare(problem: Problem) -> Prepared:
        import contextlib

        import erpo_kernels

        def run():
            variant = contextlib.nullcontext()
            if forward_variant is not None:
                from erpo_kernels.triton_logits import forward_variant as variant_named
                variant = variant_named(forward_variant)
            with variant:
                return erpo_kernels.erpo_loss(problem.logits, problem.targets, problem.token_kind,
                                              problem.sample_index, backend=backend, **_erpo_tensors(problem),
                                              **ERPO_OPTIONS).loss
        return Prepared(run, [problem.logits], _identity_logits)
    return prepare


def _erpo_fused(backend: str, batch_invariant: bool = False, workspace_bytes: int | None = None,
                host_layout: torch.Tensor | None = None):
    def prepare(problem: Problem) -> Prepared:
        import erpo_kernels

        extra = {} if workspace_bytes is None else {"workspace_bytes": workspace_bytes}
        if host_layout is not None:
            extra["host_layout"] = host_layout

        def run():
            return erpo_kernels.fused_linear_erpo_loss(
                problem.hidden, problem.weight, problem.targets, problem.token_kind, problem.sample_index,
                backend=backend, batch_invariant=batch_invariant, **extra, **_erpo_tensors(problem),
                **ERPO_OPTIONS).loss
        return Prepared(run, [problem.hidden, problem.weight], _identity_fused)
    return prepare


def erpo_fused_with_workspace(workspace_bytes: int, host_layout: torch.Tensor | None = None):
    """Ours on the fused path (Triton) with a workspace budget other than the library's default (bytes); host_layout:
    None, or the problem's token_kind and sample_index [2, N] int64 in host memory, passed to each call as a trainer
    holding them does (`fused_linear_erpo_loss(host_layout=...)`)."""
    return _erpo_fused("triton", workspace_bytes=workspace_bytes, host_layout=host_layout)


def erpo_fused_with_host_layout(problem: Problem) -> Prepared:
    """Ours on the fused path (Triton, the library's workspace) given the problem's token_kind and sample_index in
    host memory, as erpo's trainer passes them (`fused_linear_erpo_loss(host_layout=...)`: no read to plan)."""
    layout = torch.stack((problem.token_kind, problem.sample_index)).long().cpu()  # once, as a trainer holds it
    return _erpo_fused("triton", host_layout=layout)(problem)


# ---- torch.compile of the plain formula ------------------------------------------------------------------------

_COMPILED: dict = {}


def _compiled(function):
    if function not in _COMPILED:
        _COMPILED[function] = torch.compile(function, dynamic=False)
    return _COMPILED[function]


def _compile_logits(problem: Problem) -> Prepared:
    compiled = _compiled(plain_erpo_from_logits)
    return Prepared(lambda: compiled(problem.logits, *_plain_args(problem), **_plain_options()),
                    [problem.logits], _identity_logits)


def _compile_fused(problem: Problem) -> Prepared:
    compiled = _compiled(plain_erpo_from_hidden)
    return Prepared(lambda: compiled(problem.hidden, problem.weight, *_plain_args(problem), **_plain_options()),
                    [problem.hidden, problem.weight], _identity_fused)


# ---- Liger-Kernel ----------------------------------------------------------------------------------------------

def _liger_logits(problem: Problem) -> Prepared:
    """liger_kernel.transformers.grpo_loss.triton_grpo_loss: logits [B, L+1, V] (the last position is unused)."""
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    rows = problem.rows_per_sample
    samples = problem.num_samples
    with torch.no_grad():
        logits = torch.zeros(samples, rows + 1, problem.vocab, dtype=problem.logits.dtype,
                             device=problem.logits.device)
        logits[:, :rows] = problem.logits.detach().view(samples, rows, problem.vocab)
    logits.requires_grad_(True)
    completion_ids = problem.targets.clamp_min(0).view(samples, rows).contiguous()
    old_logp = problem.old_logp.view(samples, rows).contiguous()
    mask = grpo_mask(problem)

    def run():
        loss, _metrics = triton_grpo_loss(
            logits, old_logp, None, completion_ids, problem.advantages, completion_mask=mask, temperature=1.0,
            beta=0.0, eps_low=ERPO_OPTIONS["clip_low"], eps_high=ERPO_OPTIONS["clip_high"], inplace=False,
            loss_type="dapo", reduce=True)
        return loss

    def to_canonical(grads):  # [S, T, V] view: no copy of the whole gradient
        return {"logits": grads[0][:, :rows]}
    return Prepared(run, [logits], to_canonical)


def _liger_fused(problem: Problem) -> Prepared:
    """liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss with TRL's defaults (compiled, chunk_size=1)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    rows = problem.rows_per_sample
    samples = problem.num_samples
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=ERPO_OPTIONS["clip_low"],
                                       epsilon_high=ERPO_OPTIONS["clip_high"], loss_type="dapo", temperature=1.0)
    selected = problem.targets.clamp_min(0).view(samples, rows).contiguous()
    old_logp = problem.old_logp.view(samples, rows).contiguous()
    mask = grpo_mask(problem)

    def run():
        hidden = problem.hidden.view(samples, rows, problem.shape.hidden)
        loss, _metrics = loss_fn(hidden, problem.weight, selected, mask, problem.advantages,
                                 old_per_token_logps=old_logp)
        return loss
    return Prepared(run, [problem.hidden, problem.weight], _identity_fused)


# ---- Apple Cut Cross-Entropy -----------------------------------------------------------------------------------

def _cce_fused(problem: Problem) -> Prepared:
    """cut_cross_entropy.linear_cross_entropy(..., reduction="none") gives -logp per row; the plain formula on top."""
    from cut_cross_entropy import linear_cross_entropy

    def run():
        nll = linear_cross_entropy(problem.hidden, problem.weight, problem.targets, reduction="none")
        return plain_erpo_from_logp(-nll.float(), problem.token_kind, problem.sample_index, problem.advantages,
                                    problem.ref_query_logp, problem.query_weight, problem.old_logp,
                                    **_plain_options())
    return Prepared(run, [problem.hidden, problem.weight], _identity_fused)


LIGER_HINT = "; pip install liger-kernel"
CCE_HINT = "; pip install cut-cross-entropy"

CONTENDERS = (
    Contender("erpo", "logits", "erpo_kernels.erpo_loss(backend='triton')", True, "erpo", None,
              _erpo_logits("triton"), _triton_requirement("erpo_kernels", "erpo_loss")),
    Contender("erpo-block", "logits", "erpo_loss(backend='triton'), forward 8 warps per row, 4096-wide steps",
              False, "erpo", None, _erpo_logits("triton", "block"), _triton_requirement("erpo_kernels", "erpo_loss")),
    Contender("erpo-warp", "logits", "erpo_loss(backend='triton'), forward one warp per row, 2048-wide steps",
              False, "erpo", None, _erpo_logits("triton", "warp"), _triton_requirement("erpo_kernels", "erpo_loss")),
    Contender("erpo-warp-1024", "logits", "erpo_loss(backend='triton'), forward one warp per row, 1024-wide steps",
              False, "erpo", None, _erpo_logits("triton", "warp-1024"),
              _triton_requirement("erpo_kernels", "erpo_loss")),
    Contender("erpo-log2", "logits", "erpo_loss(backend='triton'), forward's base-2 loop, one warp, 1024-wide steps",
              False, "erpo", None, _erpo_logits("triton", "log2-1024"),
              _triton_requirement("erpo_kernels", "erpo_loss")),
    Contender("erpo-log2-2048", "logits",
              "erpo_loss(backend='triton'), forward's base-2 loop, one warp, 2048-wide steps", False, "erpo", None,
              _erpo_logits("triton", "log2-2048"), _triton_requirement("erpo_kernels", "erpo_loss")),
    Contender("torch", "logits", "erpo_kernels.erpo_loss(backend='torch')", False, "erpo", None,
              _erpo_logits("torch"), _module_requirement("erpo_kernels", "erpo_loss")),
    Contender("compile", "logits", "torch.compile(log_softmax, gather, ERPO loss)", False, "erpo", None,
              _compile_logits, _no_requirement),
    Contender("liger", "logits", "liger_kernel triton_grpo_loss (GRPO)", False, "grpo", "liger-kernel",
              _liger_logits, _triton_requirement("liger_kernel.transformers.grpo_loss", "triton_grpo_loss",
                                                 LIGER_HINT)),
    Contender("erpo", "fused", "erpo_kernels.fused_linear_erpo_loss(backend='triton')", True, "erpo", None,
              _erpo_fused("triton"), _triton_requirement("erpo_kernels", "fused_linear_erpo_loss")),
    # ours with a 2 GiB workspace: its "ours faster by" is what the memory buys (time / time with the default 1 GiB)
    Contender("erpo-ws2g", "fused", "erpo_kernels.fused_linear_erpo_loss(backend='triton', workspace_bytes=2 << 30)",
              False, "erpo", None, erpo_fused_with_workspace(WS2G_BYTES),
              _triton_requirement("erpo_kernels", "fused_linear_erpo_loss")),
    # ours with d hidden held in fp32 until the backward rounds it once (fused_linear_loss.GRAD_HIDDEN_FP32, issue 32;
    # bench/README.md: how a lease's rows decide the library's default): its "ours faster by" is what one rounding
    # costs (time / time with d hidden held in bf16)
    Contender("erpo-dh32", "fused", "erpo_kernels.fused_linear_erpo_loss(backend='triton'), GRAD_HIDDEN_FP32=True",
              False, "erpo", None, _erpo_fused("triton"), _triton_requirement("erpo_kernels", "fused_linear_erpo_loss"),
              knobs=functools.partial(fused_constants, GRAD_HIDDEN_FP32=True)),
    # ours with the forward row pass in the logits GEMM's epilogue, a Triton GEMM for cuBLAS's
    # (fused_linear_loss.EPILOGUE_ROW_PASS, issue 32; bench/README.md: how a lease's rows decide the library's
    # default): its "ours faster by" is what the epilogue saves (below 1) or costs (time / time with cuBLAS + the
    # forward row kernel)
    Contender("erpo-epi", "fused", "erpo_kernels.fused_linear_erpo_loss(backend='triton'), EPILOGUE_ROW_PASS=True",
              False, "erpo", None, _erpo_fused("triton"), _triton_requirement("erpo_kernels", "fused_linear_erpo_loss"),
              knobs=functools.partial(fused_constants, EPILOGUE_ROW_PASS=True)),
    # ours with batch_invariant=True: its "ours faster by" is the option's cost (time / time without it)
    Contender("erpo-invariant", "fused", "erpo_kernels.fused_linear_erpo_loss(backend='triton', batch_invariant=True)",
              False, "erpo", None, _erpo_fused("triton", batch_invariant=True),
              _triton_requirement("erpo_kernels", "fused_linear_erpo_loss")),
    Contender("torch", "fused", "erpo_kernels.fused_linear_erpo_loss(backend='torch')", False, "erpo", None,
              _erpo_fused("torch"), _module_requirement("erpo_kernels", "fused_linear_erpo_loss")),
    Contender("compile", "fused", "torch.compile(hidden @ W.T, log_softmax, gather, ERPO loss)", False, "erpo",
              None, _compile_fused, _no_requirement),
    Contender("liger", "fused", "liger_kernel LigerFusedLinearGRPOLoss (GRPO)", False, "grpo", "liger-kernel",
              _liger_fused, _triton_requirement("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss",
                                                LIGER_HINT)),
    Contender("cce", "fused", "cut_cross_entropy.linear_cross_entropy(reduction='none') + ERPO loss", False,
              "erpo", "cut-cross-entropy", _cce_fused,
              _cuda_requirement("cut_cross_entropy", "linear_cross_entropy", CCE_HINT,
                                "needs CUDA: CCE 25.1.1's kernels fail in the Triton interpreter")),
)


def erpo_geometry(key: str) -> Contender:
    """Ours on the fused path (Triton, the library's 1 GiB workspace) with the chunk geometry `key` names
    (bench.geometry: erpo-geom-ROWS[-GROUP], LOGITS_ROWS and GROUP_ROWS) set for every call of the contender and put
    back after each; ValueError if `key` is malformed. Its "ours faster by" is its time over ours with the library's
    geometry; it is held to ours' tolerance, being the candidate for that default."""
    geometry = parse_geometry_key(key)
    cap = "no group cap" if geometry.group is None else f"GROUP_ROWS={geometry.group}"
    label = f"erpo_kernels.fused_linear_erpo_loss(backend='triton'), LOGITS_ROWS={geometry.rows}, {cap}"
    return Contender(key, "fused", label, False, "erpo", None, _erpo_fused("triton"),
                     _triton_requirement("erpo_kernels", "fused_linear_erpo_loss"),
                     knobs=lambda: fused_knobs(*geometry))


def erpo_epilogue(key: str) -> Contender:
    """erpo-epi (ours with EPILOGUE_ROW_PASS) with the epilogue GEMM's config and launch `key` names (bench.geometry:
    erpo-epi-BMxBNxBK-wW-sS[-persistentP|-persistentsm][-tma], LOSS_CONFIGS' bf16 entry and LOSS_LAUNCH) set for
    every call of the contender and put back after each; ValueError if `key` is malformed. It takes erpo-epi's place
    in a run (gpu_check's bench 1 with bench.epilogue_pick's pick), held to ours' tolerance as erpo-epi is."""
    epilogue = parse_epilogue_key(key)
    label = ("erpo_kernels.fused_linear_erpo_loss(backend='triton'), EPILOGUE_ROW_PASS=True, LOSS_CONFIGS[bf16] = "
             f"{'x'.join(map(str, epilogue.config[:3]))} w{epilogue.config[3]} s{epilogue.config[4]}, "
             f"LOSS_LAUNCH = {'grouped' if epilogue.programs is None else f'persistent ({epilogue.programs})'}"
             f"{', TMA' if epilogue.tma else ''}")
    return Contender(key, "fused", label, False, "erpo", None, _erpo_fused("triton"),
                     _triton_requirement("erpo_kernels", "fused_linear_erpo_loss"),
                     knobs=lambda: epilogue_knobs(epilogue))


# the contender keys formed by a rule, each with its parser, the contender it gives and its form for an error
KEY_RULES = ((is_geometry_key, parse_geometry_key, erpo_geometry, KEY_FORM),
             (is_epilogue_key, parse_epilogue_key, erpo_epilogue, EPILOGUE_KEY_FORM))


def check_keys(keys, option: str) -> None:
    """ValueError (one line naming `option` and the key) unless every key is in CONTENDER_KEYS or a well-formed
    geometry or epilogue key."""
    ruled = [key for key in keys if any(is_ruled(key) for is_ruled, *_ in KEY_RULES)]
    unknown = sorted(set(keys) - set(ruled) - set(CONTENDER_KEYS))
    if unknown:
        forms = " and ".join(form for *_, form in KEY_RULES)
        raise ValueError(f"{option}: unknown {unknown}; known: {list(CONTENDER_KEYS)} and {forms}")
    for is_ruled, parse, _, _ in KEY_RULES:
        for key in filter(is_ruled, keys):
            try:
                parse(key)
            except ValueError as error:
                raise ValueError(f"{option}: {error}") from None


def select(keys, paths) -> list:
    """The contenders whose key is in `keys` and path in `paths`, in CONTENDERS order, then the geometry and epilogue
    contenders of `keys` (erpo_geometry, erpo_epilogue) in their order: each case's last rows."""
    check_keys(keys, "--contenders")
    formed = [contender(key) for key in dict.fromkeys(keys) for is_ruled, _, contender, _ in KEY_RULES
              if is_ruled(key)]
    return [c for c in (*CONTENDERS, *formed) if c.key in keys and c.path in paths]
