"""Each sample's span of rows (erpo_kernels/triton_segment.sample_spans), what the Triton objective and the
deterministic per-sample sums walk instead of sorting the rows: the spans themselves on any layout, and the loss on
grouped layouts (the common one: the oracle tests' random batches interleave the samples) against the reference."""
import pytest
import torch

from erpo_kernels import erpo_loss, sample_sums
from erpo_kernels.triton_row_checks import RowChecksWithSpans
from erpo_kernels.triton_segment import NODE_COUNTS, sample_spans
from erpo_kernels.validation import ROW_CHECKS, scored_targets_of
from helpers import loss_inputs, random_batch

NUM_SAMPLES = 6


def expected_spans(sample_index, num_samples, token_kind=None):
    """[2, S]: (first row, -last row) of each sample among the counted rows, N + 1 for a sample without rows."""
    num_rows = sample_index.shape[0]
    spans = torch.full((2, num_samples), num_rows + 1, dtype=torch.int64, device="cpu")
    for row, sample in enumerate(sample_index.tolist()):
        if 0 <= sample < num_samples and (token_kind is None or int(token_kind[row]) != 0):
            spans[0, sample] = min(int(spans[0, sample]), row)
            spans[1, sample] = min(int(spans[1, sample]), -row)
    return spans


def decoded(spans):
    """[(first row, one past the last), or None for a sample without rows] as the kernels read the spans (their
    fill value, N + 1 or larger, is not part of the contract)."""
    first, stop = spans[0].tolist(), (1 - spans[1]).tolist()
    return [(a, b) if a < b else None for a, b in zip(first, stop)]


def layouts(num_rows=2500):
    """(name, sample_index, token_kind) on the CPU: more rows than one program of the spans kernel holds."""
    g = torch.Generator().manual_seed(3)
    cpu = dict(generator=g, device="cpu")
    kind = torch.randint(0, 3, (num_rows,), **cpu)
    grouped = torch.sort(torch.randint(0, NUM_SAMPLES - 1, (num_rows,), **cpu)).values  # the last sample empty
    padded = grouped.clone()
    padded[kind == 0] = torch.randint(-3, NUM_SAMPLES + 3, (int((kind == 0).sum()),), **cpu)
    interleaved = torch.randint(-1, NUM_SAMPLES + 1, (num_rows,), **cpu)
    empty = torch.zeros(0, dtype=torch.int64, device="cpu")
    return [("grouped", grouped, kind), ("padding-anywhere", padded, kind), ("interleaved", interleaved, kind),
            ("one-row", torch.tensor([2], device="cpu"), torch.tensor([1], device="cpu")), ("empty", empty, empty)]


@pytest.mark.parametrize("with_kind", [False, True])
@pytest.mark.parametrize("layout", layouts(), ids=lambda layout: layout[0])
def test_spans_are_each_samples_first_and_last_counted_row(layout, with_kind, device):
    _, sample_index, kind = layout
    spans = sample_spans(sample_index.to(device), NUM_SAMPLES, kind.to(device) if with_kind else None)
    torch.testing.assert_close(spans.cpu(), expected_spans(sample_index, NUM_SAMPLES, kind if with_kind else None),
                               rtol=0, atol=0)


@pytest.mark.parametrize("layout", layouts()[:4], ids=lambda layout: layout[0])
def test_the_row_checks_find_the_same_spans(layout, device):
    """The row-check kernel's spans (validate=True on the logits path: one kernel for both) are sample_spans'; the
    code before them is the checks' own (here: every row passes, sample_index being checked on scored rows only)."""
    _, sample_index, kind = layout
    sample_index = torch.where(kind != 0, sample_index.clamp(0, NUM_SAMPLES - 1), sample_index).to(device)
    kind = kind.to(device)
    checks = RowChecksWithSpans()
    code = checks(kind, sample_index, None, None, None, NUM_SAMPLES, None)
    assert int(code[0]) == kind.shape[0] * len(ROW_CHECKS)
    assert decoded(checks.spans) == decoded(sample_spans(sample_index, NUM_SAMPLES, kind))
    assert checks.spans.data_ptr() == code.data_ptr() + code.element_size()  # one buffer: code, then the spans
    # with targets, the scored targets too (validation.scored_targets_of's: -100 on rows of kind 0), after the spans
    # in the same buffer, on 16 bytes (Triton's launches specialize a pointer on that)
    targets = torch.arange(kind.shape[0], device=device) % 7
    checks = RowChecksWithSpans()
    code, scored_targets = checks(kind, sample_index, targets.int(), None, None, NUM_SAMPLES, 7)
    assert int(code[0]) == kind.shape[0] * len(ROW_CHECKS)
    assert scored_targets.dtype == torch.int64
    assert torch.equal(scored_targets, scored_targets_of(targets, kind != 0))
    assert (scored_targets.data_ptr() - code.data_ptr()) % 16 == 0
    # the one-node objective's counts between them, their ticket counter zeroed by the same kernel (no fill launch)
    assert checks.counts.shape == (NODE_COUNTS,) and int(checks.counts[NODE_COUNTS - 1]) == 0
    assert checks.counts.data_ptr() == code.data_ptr() + (1 + 2 * NUM_SAMPLES) * 8


@pytest.mark.parametrize("layout", layouts(), ids=lambda layout: layout[0])
def test_the_spans_kernel_writes_the_scored_targets(layout, device):
    """validate=False on the logits path (`RowChecksWithSpans.without_checks`): the spans kernel writes the scored
    targets after the spans and the one-node objective's counts (validation.scored_targets_of's: -100 on rows of kind
    0, whatever their target, in range or not), in one buffer, on 16 bytes, and zeroes the counts' ticket counter;
    the spans are those without targets."""
    _, sample_index, kind = layout
    sample_index, kind = sample_index.to(device), kind.to(device)
    targets = (torch.arange(kind.shape[0], device=device) % 9 - 1).int()  # -1 and 7, 8 outside a vocabulary of 7
    checks = RowChecksWithSpans()
    scored_targets = checks.without_checks(kind, sample_index, targets, NUM_SAMPLES)
    assert scored_targets.dtype == torch.int64 and scored_targets.shape == targets.shape
    assert torch.equal(scored_targets, scored_targets_of(targets, kind != 0))
    assert torch.equal(checks.spans, sample_spans(sample_index, NUM_SAMPLES, kind))
    if kind.shape[0] > 0:  # (an empty tensor's data_ptr is 0)
        assert checks.counts.data_ptr() == checks.spans.data_ptr() + checks.spans.numel() * 8  # one buffer
        assert scored_targets.data_ptr() == checks.counts.data_ptr() + NODE_COUNTS * 8
        assert scored_targets.data_ptr() % 16 == 0
        assert int(checks.counts[NODE_COUNTS - 1]) == 0
    else:
        assert checks.counts is None  # no kernel runs: launch_node_objective zeroes its own
    with pytest.raises(ValueError, match="the scored targets need token_kind"):
        sample_spans(sample_index, NUM_SAMPLES, None, targets)


def test_sums_on_any_layout_equal_the_reference(device):
    g = torch.Generator().manual_seed(5)
    for _, sample_index, _ in layouts():
        index = sample_index.clamp(0, NUM_SAMPLES - 1).to(device)  # sample_sums takes every entry in [0, S)
        values = torch.randn(index.shape[0], generator=g).to(device)
        torch.testing.assert_close(sample_sums(values, index, NUM_SAMPLES, backend="triton"),
                                   sample_sums(values, index, NUM_SAMPLES, backend="torch"), rtol=1e-5, atol=1e-5)


def grouped_batch(device):
    """random_batch's rows sorted by sample (stable), the rows of kind 0 holding sample indices outside [0, S)."""
    batch = random_batch(device="cpu")
    order = torch.sort(batch["sample_index"], stable=True).indices
    batch = {name: tensor[order] if tensor.shape[0] == order.shape[0] else tensor for name, tensor in batch.items()}
    padding = batch["token_kind"] == 0
    batch["sample_index"][padding] = torch.where(torch.arange(int(padding.sum()), device="cpu") % 2 == 0, -1, 99)
    return {name: tensor.to(device) for name, tensor in batch.items()}


@pytest.mark.parametrize("case", [{}, dict(ratio_level="sequence", loss_agg="seq-mean-token-mean")],
                         ids=["default", "gspo-seq-mean"])
def test_loss_on_a_grouped_layout_equals_the_reference(case, device):
    """Padding rows may name any sample (they belong to none): the loss and its gradient are the reference's, and
    bit for bit those of the same batch with the padding naming sample 0."""
    batch = grouped_batch(device)
    results = []
    for backend, padding_sample in (("torch", None), ("triton", None), ("triton", 0)):
        sample_index = batch["sample_index"].clone()
        if padding_sample is not None:
            sample_index[batch["token_kind"] == 0] = padding_sample
        logits = batch["logits"].clone().requires_grad_(True)
        out = erpo_loss(logits, batch["targets"], batch["token_kind"], sample_index, backend=backend,
                        **loss_inputs(batch), **case)
        out.loss.backward()
        results.append((out.loss.detach(), out.query_logp, logits.grad))
    (ref_loss, ref_query, ref_grad), (loss, query, grad), (loss_0, query_0, grad_0) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(query, ref_query, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(loss, loss_0) and torch.equal(query, query_0) and torch.equal(grad, grad_0)
