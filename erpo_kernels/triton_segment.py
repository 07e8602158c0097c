"""Each sample's span of rows, and deterministic per-sample sums on the Triton path: [N] -> [S], differentiable
(torch twin: segment.SegmentSum).

`torch.Tensor.index_add_` uses float atomics on CUDA, so its result can change from run to run. Here one program per
sample s walks the rows of its span, first_s to last_s (the first and the last row of s, `sample_spans`), in row
order, and adds the rows that belong to s: a fixed order (the rows of s in ascending order, as a stable sort by
sample would list them), without sorting. The spans come from one kernel of integer atomic minimums, whose result
does not depend on the order the programs run in. A sample's program reads its whole span: rows grouped by sample
(every layout of erpo_kernels.layout, of packed sequences and of padded batches, padding between samples included)
cost each program its own rows; a layout that interleaves samples is as exact, its programs reading longer spans.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .direct_ops import DirectOp

SPAN_BLOCK = 1024  # rows per program of the spans kernel
SUM_BLOCK = 256  # rows per loop step of the sums kernel
# Where the scored targets are formed with the spans (the logits path's one node): the objective's counts
# (`triton_objective.COUNT_METRICS`) and its sample kernel's ticket counter, last, between the spans and the
# targets, the ticket zeroed by the kernel that writes the targets (no fill launch of its own)
NODE_COUNTS = 4
NODE_TICKET = NODE_COUNTS - 1


@triton.jit
def record_spans(sample_ptr, kind_ptr, spans_ptr, rows, num_rows, num_samples, HAS_KIND: tl.constexpr):
    """For a block of `rows` (int64, those >= N ignored): spans[0, s] = min(first row of s), spans[1, s] =
    min(-last row of s) over the counted rows (sample in [0, S), and with HAS_KIND token_kind != 0), by atomic
    minimums on a buffer filled with one value >= N + 1 (two minimums rather than a minimum and a maximum: one fill
    value for both). Only the rows that open or close a run of equal samples take part: a sample's first row opens
    a run and its last row closes one, so the minimums are the same, with about two atomics per run instead of one
    per row. (The spans kernel's body; the row checks' kernel runs it too.)"""
    inside = rows < num_rows
    sample = tl.load(sample_ptr + rows, mask=inside, other=-1)
    has_previous = inside & (rows > 0)
    previous = tl.load(sample_ptr + rows - 1, mask=has_previous, other=-1)
    has_next = rows + 1 < num_rows
    following = tl.load(sample_ptr + rows + 1, mask=has_next, other=-1)
    counted = inside & (sample >= 0) & (sample < num_samples)
    if HAS_KIND:
        counted = counted & (tl.load(kind_ptr + rows, mask=inside, other=0) != 0)
        has_previous = has_previous & (tl.load(kind_ptr + rows - 1, mask=has_previous, other=0) != 0)
        has_next = has_next & (tl.load(kind_ptr + rows + 1, mask=has_next, other=0) != 0)
    opens = counted & ~(has_previous & (previous == sample))
    closes = counted & ~(has_next & (following == sample))
    column = tl.where(counted, sample, 0).to(tl.int64)
    tl.atomic_min(spans_ptr + column, rows, mask=opens)
    tl.atomic_min(spans_ptr + num_samples + column, -rows, mask=closes)


@triton.jit
def store_scored_targets(out_ptr, rows, inside, scored, target):
    """The targets the logits kernels read, for a block of `rows`: out[row] = target as int64 on `scored` rows, -100
    elsewhere (`validation.scored_targets_of`'s), stored where `inside`. (The spans kernel and the row checks' kernel
    write them.)"""
    tl.store(out_ptr + rows, tl.where(scored, target.to(tl.int64), -100), mask=inside)


@triton.jit
def _sample_spans_kernel(sample_ptr, kind_ptr, targets_ptr, spans_ptr, num_rows, num_samples, HAS_KIND: tl.constexpr,
                         WITH_SCORED_TARGETS: tl.constexpr, BLOCK: tl.constexpr,
                         NODE_COUNTS: tl.constexpr = NODE_COUNTS, NODE_TICKET: tl.constexpr = NODE_TICKET):
    # the layout's sizes are parameters with these defaults, not read as globals: a compiled kernel checks the value
    # of each global it reads on every launch (`triton_row_checks`' note)
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    record_spans(sample_ptr, kind_ptr, spans_ptr, rows, num_rows, num_samples, HAS_KIND)
    if WITH_SCORED_TARGETS:  # after the spans [2, S]: the node's counts (NODE_COUNTS), then the targets
        inside = rows < num_rows
        scored = tl.load(kind_ptr + rows, mask=inside, other=0) != 0
        target = tl.load(targets_ptr + rows, mask=inside, other=0)
        store_scored_targets(spans_ptr + 2 * num_samples + NODE_COUNTS, rows, inside, scored, target)
        zero_ticket(spans_ptr + 2 * num_samples, NODE_TICKET)


@triton.jit
def zero_ticket(counts_ptr, TICKET: tl.constexpr):
    """Program 0 zeroes the ticket counter of the node's counts at `counts_ptr` (NODE_COUNTS), entry TICKET
    (NODE_TICKET, the caller's parameter): the objective's sample kernel, queued after, counts its programs there
    from 0. (The spans kernel and the row checks' kernel.)"""
    if tl.program_id(0) == 0:
        tl.store(counts_ptr + TICKET, 0)


def sample_spans(sample_index: torch.Tensor, num_samples: int, token_kind: Optional[torch.Tensor] = None,
                 targets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The span of each sample s in [0, S) over sample_index [N] int: [2, S] int64 as `_sample_spans_kernel` leaves
    it, read in a kernel by `span_bounds`. Entries outside [0, S) belong to no sample; with token_kind [N], neither
    do rows of kind 0. A sample without rows gets an empty span. With targets [N] int (and token_kind): [2 S + 4 + N]
    int64, the spans flattened, the one-node objective's counts (NODE_COUNTS, the ticket counter zeroed when N > 0),
    then the scored targets from the same kernel (int64, -100 on rows of kind 0: `validation.scored_targets_of`'s;
    `spans_and_scored_targets` splits them)."""
    if targets is not None and token_kind is None:
        raise ValueError("sample_spans: the scored targets need token_kind (rows of kind 0 get -100)")
    num_rows = sample_index.shape[0]
    length = 2 * num_samples + (0 if targets is None else NODE_COUNTS + num_rows)
    spans = torch.full((length,), num_rows + 1, dtype=torch.int64, device=sample_index.device)
    if num_rows > 0 and (num_samples > 0 or targets is not None):
        # cdiv (triton.cdiv is a jit call: ~10 us); an absent tensor goes as None (a constexpr None to Triton: its
        # flag is off, the kernel never reads it)
        _sample_spans_kernel[(-(-num_rows // SPAN_BLOCK),)](
            sample_index, token_kind, targets, spans, num_rows, num_samples, HAS_KIND=token_kind is not None,
            WITH_SCORED_TARGETS=targets is not None, BLOCK=SPAN_BLOCK)
    return spans if targets is not None else spans.view(2, num_samples)


sample_spans_op = torch.library.custom_op("erpo::triton_sample_spans", sample_spans, mutates_args=())


@sample_spans_op.register_fake
def _(sample_index, num_samples, token_kind=None, targets=None):
    if targets is not None:
        return sample_index.new_empty(2 * num_samples + NODE_COUNTS + sample_index.shape[0], dtype=torch.int64)
    return sample_index.new_empty((2, num_samples), dtype=torch.int64)


_sample_spans = DirectOp(sample_spans_op, sample_spans)  # the op under torch.compile, else its implementation


def triton_sample_spans(sample_index: torch.Tensor, num_samples: int,
                        token_kind: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`sample_spans` on contiguous inputs (the op under torch.compile)."""
    return _sample_spans(sample_index.contiguous(), num_samples,
                         None if token_kind is None else token_kind.contiguous())


def spans_and_scored_targets(sample_index: torch.Tensor, num_samples: int, token_kind: torch.Tensor,
                             targets: torch.Tensor) -> tuple:
    """(spans [2, S] int64 of the scored rows, as `triton_sample_spans`' with token_kind; the one-node objective's
    counts [NODE_COUNTS] int64, their ticket counter zeroed (None when N = 0: no kernel runs); the scored targets
    [N] int64, -100 on rows of kind 0) from one kernel and its fill, on any row values: the logits path's with
    validate=False, where the row checks' kernel (which forms them with validate=True) does not run."""
    both = _sample_spans(sample_index.contiguous(), num_samples, token_kind.contiguous(), targets.contiguous())
    spans, counts, scored_targets = both.split_with_sizes((2 * num_samples, NODE_COUNTS, sample_index.shape[0]))
    return spans.view(2, num_samples), counts if sample_index.shape[0] > 0 else None, scored_targets


@triton.jit
def span_bounds(spans_ptr, sample, num_samples):
    """(first row, one past the last row) of `sample` in `sample_spans`' [2, S] spans; first >= stop when the sample
    has no rows (a fill F >= N + 1 gives first = F, stop = 1 - F)."""
    return tl.load(spans_ptr + sample), 1 - tl.load(spans_ptr + num_samples + sample)


@triton.jit
def first_block_start(start, BLOCK: tl.constexpr):
    """Where a walk over a span that begins at row `start` begins: the multiple of BLOCK at or below it. Lane i of a
    [BLOCK] accumulator then holds the rows i mod BLOCK, whichever row the span begins at, so two kernels that walk
    one sample's rows with the same BLOCK (and, on a GPU, the same layout: `span_block_rows`) add them in the same
    order (bit-equal sums) even where their spans begin at different rows: the objective's spans
    (`RowChecksWithSpans`) begin at the first scored row, these sums' at the first row. The rows before `start` in
    the first block are other samples' (or unscored), added as 0."""
    return start - start % BLOCK


@triton.jit
def span_block_rows(block_start, BLOCK: tl.constexpr):
    """The rows of one step of a span walk: block_start + [0, BLOCK), block_start a multiple of BLOCK
    (`first_block_start`, then steps of BLOCK), as the compiler is told (tl.multiple_of). Why: on a GPU tl.sum adds
    a [BLOCK] tensor's lanes in an order its layout fixes, and Triton gives the [BLOCK] tensors of a kernel the
    layout of their best-aligned load (as many lanes a thread as one load of it takes, up to BLOCK / threads).
    Rows of unknown alignment left that to the kernel's other loads: the one node's sample kernel, whose finish
    loads query_logp [S] aligned, laid its rows two lanes a thread, the two ops' sample kernel one, and a sample's
    sums differed in the last bits (H100, b8b4a78). Told, every span walk that loads from an aligned tensor lays
    its rows out alike (tests/kernels/test_logits_loss_node.py compiles the kernels as launched)."""
    return tl.max_contiguous(tl.multiple_of(block_start + tl.arange(0, BLOCK), BLOCK), BLOCK)


@triton.jit
def _segment_sum_kernel(values_ptr, sample_ptr, spans_ptr, out_ptr, BLOCK: tl.constexpr):
    segment = tl.program_id(0).to(tl.int64)
    start, stop = span_bounds(spans_ptr, segment, tl.num_programs(0))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    block_start = first_block_start(start, BLOCK)
    while block_start < stop:  # triton_common's note on loop bounds
        rows = span_block_rows(block_start, BLOCK)
        inside = rows < stop
        mine = inside & (tl.load(sample_ptr + rows, mask=inside, other=-1) == segment)
        acc += tl.load(values_ptr + rows, mask=mine, other=0.0).to(tl.float32)
        block_start += BLOCK
    tl.store(out_ptr + segment, tl.sum(acc, axis=0))


@torch.library.custom_op("erpo::triton_segment_sum", mutates_args=())
def segment_sum_op(values: torch.Tensor, sample_index: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """values [N] -> [S] fp32 sums by sample_index [N] (contiguous); spans [2, S] from `sample_spans`. A
    torch.library op: torch.compile keeps it whole (no graph break)."""
    num_samples = spans.shape[1]
    out = torch.empty(num_samples, dtype=torch.float32, device=values.device)
    if num_samples > 0:
        _segment_sum_kernel[(num_samples,)](values.float().contiguous(), sample_index, spans, out, BLOCK=SUM_BLOCK)
    return out


@segment_sum_op.register_fake
def _(values, sample_index, spans):
    return values.new_empty(spans.shape[1], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    values, sample_index, _ = inputs
    ctx.save_for_backward(sample_index)
    ctx.values_dtype = values.dtype


def _backward(ctx, grad_out):
    (sample_index,) = ctx.saved_tensors
    return grad_out[sample_index].to(ctx.values_dtype), None, None


segment_sum_op.register_autograd(_backward, setup_context=_setup_context)


class TritonSegmentSum:
    """`segment.SegmentSum`'s interface, deterministic on CUDA: the samples' spans are found once here (one kernel,
    no host-device sync) and shared by every call."""

    def __init__(self, sample_index: torch.Tensor, num_samples: int):
        self.sample_index = sample_index.contiguous()
        self.spans = triton_sample_spans(self.sample_index, num_samples)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        return segment_sum_op(values, self.sample_index, self.spans)
