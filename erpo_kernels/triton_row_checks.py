"""The value checks of the loss inputs in one Triton kernel and one host read (the Triton path of
`validation.check_loss_inputs`; the torch path builds the same masks with torch ops).

Each check of `validation.ROW_CHECKS`, in that order, marks bad rows; the kernel reduces them to one int64 code,
check * N + row of the first failing check's first bad row (N * len(ROW_CHECKS) when every row passes), by an
atomic min over blocks of rows: the result does not depend on the blocks' order. On the logits path the same kernel
also finds each sample's span of scored rows (`triton_segment.record_spans`, what the objective walks) and writes the
targets the logits kernels read (-100 on rows of kind 0: `validation.scored_targets_of`), so that a call with
validation on launches one kernel and one fill for the three (`RowChecksWithSpans`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .direct_ops import DirectOp
from .triton_segment import (
    NODE_COUNTS,
    NODE_TICKET,
    record_spans,
    spans_and_scored_targets,
    store_scored_targets,
    zero_ticket,
)
from .validation import ROW_CHECKS

BLOCK_ROWS = 1024


# The kernel's fixed sizes are parameters with defaults (a launch passes none of them), plain numbers, not globals
# read in the kernel: a compiled kernel checks the value of each global it reads (its jit functions' too) on every
# launch, about 0.5 us each on the host, a parameter with a plain default costs its binding about 0.07 us
# (`python -m bench.host_cost`'s global-value checks and binding rows; a tl.constexpr default 0.2 us).
@triton.jit
def _first_bad_row_kernel(kind_ptr, sample_ptr, targets_ptr, token_weight_ptr, rollout_logp_ptr, code_ptr, num_rows,
                          num_samples, vocab_size, HAS_TARGETS: tl.constexpr, HAS_TOKEN_WEIGHT: tl.constexpr,
                          HAS_ROLLOUT: tl.constexpr, WITH_SPANS: tl.constexpr, WITH_SCORED_TARGETS: tl.constexpr,
                          CHECK_BLOCK: tl.constexpr = BLOCK_ROWS, NUM_CHECKS: tl.constexpr = len(ROW_CHECKS),
                          NODE_COUNTS: tl.constexpr = NODE_COUNTS, NODE_TICKET: tl.constexpr = NODE_TICKET):
    rows = tl.program_id(0).to(tl.int64) * CHECK_BLOCK + tl.arange(0, CHECK_BLOCK)
    inside = rows < num_rows
    none = num_rows * NUM_CHECKS  # past every code
    kind = tl.load(kind_ptr + rows, mask=inside, other=0)
    scored = inside & (kind != 0)
    code = tl.where(inside & ((kind < 0) | (kind > 2)), rows, none)  # check 0: token_kind
    sample = tl.load(sample_ptr + rows, mask=inside, other=0)
    # drops NaN: integer codes
    code = tl.minimum(code, tl.where(scored & ((sample < 0) | (sample >= num_samples)), num_rows + rows, none))
    if HAS_TARGETS:
        target = tl.load(targets_ptr + rows, mask=inside, other=0)
        code = tl.minimum(code, tl.where(scored & ((target < 0) | (target >= vocab_size)), 2 * num_rows + rows,
                                         none))  # drops NaN: integer codes
        if WITH_SCORED_TARGETS:  # after the code, the spans [2, S], the node's counts and one pad: the targets
            store_scored_targets(code_ptr + 2 + 2 * num_samples + NODE_COUNTS, rows, inside, scored, target)
            zero_ticket(code_ptr + 1 + 2 * num_samples, NODE_TICKET)
    if HAS_TOKEN_WEIGHT:
        weight = tl.load(token_weight_ptr + rows, mask=inside, other=0.0).to(tl.float32)
        good = (weight >= 0) & (weight < float("inf"))  # finite and >= 0 (NaN fails both)
        code = tl.minimum(code, tl.where(scored & ~good, 3 * num_rows + rows, none))  # drops NaN: integer codes
    if HAS_ROLLOUT:
        rollout = tl.load(rollout_logp_ptr + rows, mask=inside, other=0.0)
        # drops NaN: integer codes
        code = tl.minimum(code, tl.where(inside & (kind == 2) & (rollout != rollout), 4 * num_rows + rows, none))
    tl.atomic_min(code_ptr, tl.min(code, axis=0))  # drops NaN: integer codes
    if WITH_SPANS:  # the spans [2, S] follow the code
        record_spans(sample_ptr, kind_ptr, code_ptr + 1, rows, num_rows, num_samples, True)


def first_bad_row(token_kind: torch.Tensor, sample_index: torch.Tensor, targets: Optional[torch.Tensor],
                     token_weight: Optional[torch.Tensor], rollout_logp: Optional[torch.Tensor], num_samples: int,
                     vocab_size: int, with_spans: bool = False, with_scored_targets: bool = False) -> torch.Tensor:
    """[1] int64: check * N + row of the first bad row of the first failing check (module docstring), or
    N * len(ROW_CHECKS) when none fails. token_kind, sample_index, targets [N] int; token_weight, rollout_logp [N].
    with_spans (N > 0): [1 + 2 S] int64, the code followed by the spans of the scored rows
    (`triton_segment.sample_spans`' [2, S], filled with N * len(ROW_CHECKS) >= N + 1 as their decoding allows).
    with_scored_targets (with_spans, and targets given): [6 + 2 S + N], then the one-node objective's counts
    (`triton_segment.NODE_COUNTS`, their ticket counter zeroed), one entry unused (it puts the targets on 16 bytes,
    as Triton's launches specialize pointers) and the targets as int64 with -100 on rows of kind 0
    (`validation.scored_targets_of`'s)."""
    num_rows = token_kind.shape[0]
    if with_spans and num_rows == 0:
        raise ValueError("first_bad_row: with_spans needs N > 0 rows (the spans' fill N * 5 must exceed N)")
    if with_scored_targets and (not with_spans or targets is None):
        raise ValueError("first_bad_row: with_scored_targets needs with_spans and the targets")
    length = (1 + 2 * num_samples if with_spans else 1) + (NODE_COUNTS + 1 + num_rows if with_scored_targets else 0)
    code = torch.full((length,), num_rows * len(ROW_CHECKS), dtype=torch.int64, device=token_kind.device)
    if num_rows > 0:
        # cdiv (triton.cdiv is a jit call: ~10 us); an absent tensor goes as None (a constexpr None to Triton: its
        # flag is off, the kernel never reads it)
        _first_bad_row_kernel[(-(-num_rows // BLOCK_ROWS),)](
            token_kind, sample_index, targets, token_weight, rollout_logp,
            code, num_rows, num_samples, vocab_size, HAS_TARGETS=targets is not None,
            HAS_TOKEN_WEIGHT=token_weight is not None, HAS_ROLLOUT=rollout_logp is not None, WITH_SPANS=with_spans,
            WITH_SCORED_TARGETS=with_scored_targets)
    return code


first_bad_row_op = torch.library.custom_op("erpo::triton_first_bad_row", first_bad_row, mutates_args=())
_first_bad_row = DirectOp(first_bad_row_op, first_bad_row)  # the op under torch.compile, else its implementation


@first_bad_row_op.register_fake
def _(token_kind, sample_index, targets, token_weight, rollout_logp, num_samples, vocab_size, with_spans=False,
      with_scored_targets=False):
    length = (1 + 2 * num_samples if with_spans else 1) + (
        NODE_COUNTS + 1 + token_kind.shape[0] if with_scored_targets else 0)
    return token_kind.new_empty(length, dtype=torch.int64)


def triton_first_bad_row(token_kind, sample_index, targets, token_weight, rollout_logp, num_samples: int,
                         vocab_size: Optional[int], with_spans: bool = False,
                         with_scored_targets: bool = False) -> torch.Tensor:
    """`first_bad_row_op` on contiguous inputs (`validation.start_loss_input_checks`' `first_bad_row` argument):
    [1] int64, or [1 + 2 S] with_spans, [6 + 2 S + N] with_scored_targets too (`first_bad_row`)."""
    return _first_bad_row(*_contiguous(token_kind, sample_index, targets, token_weight, rollout_logp), num_samples,
                          vocab_size or 0, with_spans, with_scored_targets)


def _contiguous(*tensors):
    return tuple(None if tensor is None else tensor.contiguous() for tensor in tensors)


class RowChecksWithSpans:
    """`triton_first_bad_row` that also leaves, in `spans`, each sample's span of scored rows ([2, S] int64,
    `triton_segment.sample_spans`' form) from the same kernel, and with targets returns (code, the scored targets
    [N] int64: -100 on rows of kind 0) as `validation.start_loss_input_checks` takes them: the logits path passes
    it there and the spans on to the objective; with validate=False, `without_checks` forms the spans and the scored
    targets (the spans kernel). `spans` stays None when neither ran, or with N = 0 and the checks. With targets and
    N > 0, `counts` is the one-node objective's counts [NODE_COUNTS] int64 from the same buffer, their ticket
    counter zeroed by the same kernel (`triton_objective.launch_node_objective`: no fill of its own), else None."""

    def __init__(self):
        self.spans = None
        self.counts = None

    def __call__(self, token_kind, sample_index, targets, token_weight, rollout_logp, num_samples: int,
                 vocab_size: Optional[int]):
        num_rows = token_kind.shape[0]
        if num_rows == 0:  # the spans' fill needs N > 0 rows (`first_bad_row`)
            return triton_first_bad_row(token_kind, sample_index, targets, token_weight, rollout_logp, num_samples,
                                        vocab_size)
        checked = triton_first_bad_row(token_kind, sample_index, targets, token_weight, rollout_logp, num_samples,
                                       vocab_size, with_spans=True, with_scored_targets=targets is not None)
        # the code, the spans, then with targets the counts, the pad and the scored targets: one split, not a slice
        # each
        code, spans, *rest = checked.split_with_sizes(
            (1, 2 * num_samples) + ((NODE_COUNTS, 1, num_rows) if targets is not None else ()))
        self.spans = spans.view(2, num_samples)
        if targets is None:
            return code
        self.counts = rest[0]
        return code, rest[2]

    def without_checks(self, token_kind, sample_index, targets, num_samples: int) -> torch.Tensor:
        """The scored targets [N] int64 (-100 on rows of kind 0), leaving the spans of the scored rows in `spans`:
        the spans kernel's fill and launch, no checks (`validation.start_loss_input_checks`'
        `unchecked_scored_targets`, validate=False); and the counts in `counts` (None with N = 0)."""
        self.spans, self.counts, scored_targets = spans_and_scored_targets(sample_index, num_samples, token_kind,
                                                                           targets)
        return scored_targets
