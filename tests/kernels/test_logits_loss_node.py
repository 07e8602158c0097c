"""The logits path's loss as one autograd node (erpo_kernels/triton_logits_loss.py), taken where nothing traces: the
same loss, outputs, metrics and d logits, bit for bit, as the two ops in a row (what torch.compile and any dispatch
mode get, `direct_ops.traced`), with two Triton launches fewer (the objective's gradient kernel, folded into dlogits,
and its finish kernel, run by the sample kernel's last program)."""
import contextlib
import threading
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import erpo_kernels.validation as validation
from erpo_kernels import erpo_loss
from erpo_kernels.triton_logits import DEFAULT_FORWARD_VARIANT, FORWARD_VARIANTS, forward_variant
from helpers import random_batch
from launch_counts import watched_launches
from test_objective_kernels import FUSED_CASES, call_arguments


class TwoOps(TorchDispatchMode):
    """A dispatch mode that changes nothing but sends erpo_loss through the two ops (`direct_ops.traced`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def triton_launches():
    """Counter of the Triton kernels launched in the block, by name (no dispatch mode: the one node's path)."""
    names = Counter()
    with watched_launches(lambda kernel, args, kwargs: names.update([kernel.fn.__name__])):
        yield names


def loss_and_grad(batch, case, two_ops: bool, **extra):
    tensors, options = call_arguments(batch, case)
    logits = batch["logits"].clone().requires_grad_(True)
    with TwoOps() if two_ops else contextlib.nullcontext():
        out = erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend="triton",
                        **tensors, **options, **extra)
        node = type(out.loss.grad_fn).__name__
        out.loss.backward()
    return out, logits.grad if logits.grad is not None else logits.detach(), node


def assert_bit_equal(one, two, same_node: bool = False):
    """one: the one node's (loss_and_grad), two: the two ops' (or, same_node, another call on the same path)."""
    (out, grad, node), (two_out, two_grad, two_node) = one, two
    if not same_node:
        assert node.startswith("_LogitsLoss") and not two_node.startswith("_LogitsLoss"), (node, two_node)
    assert torch.equal(out.loss, two_out.loss)
    assert torch.equal(grad, two_grad)
    for name in ("token_logp", "query_logp", "response_logp", "entropy"):
        assert torch.equal(getattr(out, name), getattr(two_out, name)), name
    assert list(out.metrics) == list(two_out.metrics)
    for name, value in two_out.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("case", FUSED_CASES.values(), ids=FUSED_CASES.keys())
def test_one_node_equals_the_two_ops_bit_for_bit(case, device, fma_as_compiled):
    batch = random_batch(device=device)
    assert_bit_equal(*(loss_and_grad(batch, case, two_ops) for two_ops in (False, True)))


def test_one_node_and_the_two_ops_add_in_the_same_order_as_compiled(device, tmp_path):
    """On a GPU, tl.sum adds a [BLOCK] tensor's lanes in an order its layout fixes, and Triton lays every [BLOCK] tensor
    of a kernel out from the best alignment among the kernel's loads of that shape. The one node's sample kernel also
    holds the finish's aligned loads of query_logp [S]: before `triton_segment.span_block_rows` told the compiler that a
    span walk's rows start at a multiple of BLOCK, it laid out its rows two to a thread where the two ops' sample kernel
    laid them one to a thread, and a sample's sums (response_logp, the Policy-KL's, ...) differed in the last bits
    (H100, 2026-11-26, at b8b4a78: bench/measured/h100-2026-11-26). Each kernel compiled for sm_90 as launched here
    (every pointer's and integer's divisibility by 16, as the launcher specializes them), at N a multiple of 16 and not,
    with few option flags and many: the one node's sample kernel, the two ops' sample and finish kernels and the
    per-sample sums' kernel (`sample_sums`, ell_theta(q)'s sums) reduce and carry their [BLOCK] tensors in one and the
    same layout, and none converts a layout in its loops (`compile_check.loop_layout_conversions`)."""
    import json

    from compile_check import launch_specializations, run_compile_script
    from erpo_kernels import sample_sums

    kernels = ("_objective_sample_finish_kernel", "_objective_sample_kernel", "_objective_finish_kernel",
               "_segment_sum_kernel")
    with launch_specializations(kernels) as launches:
        for num_rows, case in ((48, FUSED_CASES["vespo-rollout-pg-clamp"]), (47, FUSED_CASES["policy-kl-bias-gspo"])):
            batch = random_batch(num_rows=num_rows, device=device)
            for two_ops in (False, True):
                loss_and_grad(batch, case, two_ops)
            sample_sums(batch["old_logp"], batch["sample_index"], 5, backend="triton")
    assert Counter(launch["kernel"] for launch in launches) == dict.fromkeys(kernels, 2), launches
    node_launches = [launch for launch in launches if launch["kernel"] == "_objective_sample_finish_kernel"]
    assert all("row_stride" in launch["divisible_by_16"] for launch in node_launches), node_launches  # N = 47 too
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches))
    compiled = [json.loads(line) for line in run_compile_script("reduction_layout_check.py", str(path)).splitlines()]
    assert [layouts["kernel"] for layouts in compiled] == [launch["kernel"] for launch in launches]
    layouts = {layout for each in compiled for key in ("reduced", "carried") for layout in each[key]}
    assert len(layouts) == 1 and all(each["reduced"] and each["carried"] for each in compiled), compiled
    # and no loop converts a layout: the one node's workspace regions begin at multiples of 16 elements whatever N
    # (`triton_objective._node_regions`; at N = 47 its pass 2 took three conversions a step before)
    node_loops = [each["loop_conversions"] for each in compiled if each["kernel"] == "_objective_sample_finish_kernel"]
    assert all(len(loops) > 2 for loops in node_loops), node_loops  # the two passes, then the finish's
    assert not any(count for each in compiled for count in each["loop_conversions"]), compiled


@pytest.mark.parametrize("case", [{}, dict(ratio_level="sequence", loss_agg="seq-mean-token-mean")],
                         ids=["default", "gspo-seq-mean"])
def test_validate_false_gives_the_same_bits(case, device):
    """validate=False takes its scored targets and spans from the spans kernel, validate=True from the row checks'
    kernel: the same loss, outputs, metrics and d logits, bit for bit, on the one node's path and the two ops'.
    The batch's rows of kind 0 hold targets outside [0, V) (-1, V): the kernels give them -100, not their value."""
    batch = random_batch(device=device)
    padding = batch["token_kind"] == 0
    assert bool(padding.any())
    vocab_size = batch["logits"].shape[1]
    batch["targets"] = torch.where(padding, torch.arange(padding.shape[0], device=device) % 2 * (vocab_size + 1) - 1,
                                   batch["targets"])
    for two_ops in (False, True):
        checked, unchecked = (loss_and_grad(batch, case, two_ops, validate=validate) for validate in (True, False))
        assert checked[2] == unchecked[2]
        assert_bit_equal(*(checked, unchecked), same_node=True)


@pytest.mark.parametrize("variant", ["block", "log2-1024"])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_one_node_keeps_the_variant_and_the_inplace_backward(variant, inplace_backward, device, fma_as_compiled):
    """The backward kernel of the forward that ran (the variant in force then), written into the logits in place
    when asked; bf16 logits, the soft-cap and a temperature."""
    batch = random_batch(device=device, dtype=torch.bfloat16)
    case = dict(logit_softcap=5.0, temperature=0.8, entropy_coef=0.05)
    with forward_variant(variant):
        results = [loss_and_grad(batch, case, two_ops, inplace_backward=inplace_backward) for two_ops in (False, True)]
    assert_bit_equal(*results)


def test_one_node_launches_two_triton_kernels_fewer(device):
    """Forward: the row checks, logp / entropy, the objective's sample kernel whose last program finishes (kernel 2
    folded in); backward: dlogits alone (the two ops: the objective's finish and gradient kernels too). The aten
    operators are the same: the sample kernel's ticket counter sits in the row checks' buffer, zeroed by their kernel
    (test_sample_spans.py; LaunchCounter, a dispatch mode, counts the two ops' path: test_objective_kernels.py)."""
    batch = random_batch(device=device)
    for two_ops, expected in ((False, 4), (True, 6)):
        loss_and_grad(batch, {}, two_ops)  # compiled first on a GPU
        with triton_launches() as names:
            loss_and_grad(batch, {}, two_ops)
        assert sum(names.values()) == expected, names
        assert names["_objective_grad_kernel"] == names["_objective_finish_kernel"] == int(two_ops), names
        assert names["_objective_sample_finish_kernel"] == int(not two_ops), names


def test_one_node_plans_once_per_options_and_fills_the_metrics_by_name(device):
    """The objective's settings, kernel arguments and metric slots are built once per (options, given inputs)
    (`triton_objective.objective_plan`) and reused; options holding a tensor are planned every call, never stored.
    The metrics the slots fill are `LossMetrics.for_call`'s, by name; the outputs beside the loss carry no gradient."""
    from erpo_kernels import triton_objective
    from erpo_kernels.objective import LossMetrics
    from erpo_kernels.validation import LossInputs

    batch = random_batch(device=device)
    triton_objective._PLANS.clear()
    triton_objective._NODE_SCALARS.clear()
    first, _, _ = loss_and_grad(batch, dict(qkl_coef=0.3, entropy_coef=0.05), False)
    plans = dict(triton_objective._PLANS)
    assert len(plans) == 1
    (scalars, _), = triton_objective._NODE_SCALARS.values()  # the sample kernel's float settings, on the device
    second, _, _ = loss_and_grad(batch, dict(entropy_coef=0.05, qkl_coef=0.3), False)
    assert triton_objective._PLANS == plans and next(iter(triton_objective._PLANS.values())) is next(
        iter(plans.values()))
    assert [vector for vector, _ in triton_objective._NODE_SCALARS.values()] == [scalars]
    named = dict(zip(triton_objective.NODE_SCALARS, scalars.tolist()))
    assert scalars.device.type == device.type and scalars.dtype == torch.float32
    assert named["clip_low"] == named["clip_high"] == pytest.approx(0.2)
    assert (named["qkl_coef"], named["entropy_coef"], named["num_items"]) == (pytest.approx(0.3), pytest.approx(0.05),
                                                                            0.0)
    loss_and_grad(batch, FUSED_CASES["tensor-denominators"], False)
    assert triton_objective._PLANS == plans
    tensors, _ = call_arguments(batch, {})
    (options_key, _, _), = plans
    expected = LossMetrics.for_call(dict(second.metrics), LossInputs(**tensors), options_key)
    assert list(second.metrics) == list(expected) and len(second.metrics) < len(LossMetrics.__dataclass_fields__)
    assert all(second.metrics[name] is not None for name in expected)
    assert not any(tensor.requires_grad for tensor in (second.token_logp, second.entropy, second.query_logp,
                                                       second.response_logp, *second.metrics.values()))


def test_the_last_program_reduces_every_samples_partials_call_after_call(device, fma_as_compiled):
    """The fold's handoff between programs (a ticket taken with acq_rel after each program's partial sums are stored;
    the last ticket's program reads them all) under many concurrent programs: 2048 samples, 200 calls on a GPU,
    each bit for bit the first (a missing ordering would show now and then, not always), which is the two ops' (their
    finish kernel as the oracle; a difference in every call alike is the kernels' reduction order, not a race:
    test_one_node_and_the_two_ops_add_in_the_same_order_as_compiled). The interpreter runs programs one after
    another: two smaller calls are all it can check."""
    on_gpu = device.type == "cuda"
    batch = random_batch(num_rows=8192 if on_gpu else 256, vocab=64, num_samples=2048 if on_gpu else 64,
                         device=device)
    case = dict(ratio_level="sequence", loss_agg="seq-mean-token-mean")
    first = loss_and_grad(batch, case, two_ops=False)
    for _ in range(199 if on_gpu else 1):
        assert_bit_equal(loss_and_grad(batch, case, two_ops=False), first, same_node=True)
    assert_bit_equal(first, loss_and_grad(batch, case, two_ops=True))


def test_the_metrics_record_is_made_on_its_first_read(device):
    """The one node's LossMetrics holds the finish kernel's two vectors until a field is first read
    (`triton_objective.SlotMetrics`), then the fields `LossMetrics.for_call` gives by name; a copy, a pickle and
    `dataclasses.replace` see the same values, before and after."""
    import copy
    import dataclasses
    import pickle

    from erpo_kernels.objective import METRIC_NAMES, LossMetrics
    from erpo_kernels.validation import LossInputs, LossOptions

    batch = random_batch(device=device)
    case = dict(qkl_coef=0.3, entropy_coef=0.05)
    out, _, _ = loss_and_grad(batch, case, False)
    record = out.metrics
    assert isinstance(record, LossMetrics) and "_vectors" in vars(record) and "qkl" not in vars(record)
    unread = [copy.deepcopy(record), pickle.loads(pickle.dumps(record))]
    tensors, options = call_arguments(batch, case)
    expected = LossMetrics.for_call(dict(loss_and_grad(batch, case, True)[0].metrics), LossInputs(**tensors),
                                    LossOptions(**options))
    for metrics in [record, *unread]:
        assert list(metrics) == list(expected) and set(vars(metrics)) == set(METRIC_NAMES)
        for name in METRIC_NAMES:
            torch.testing.assert_close(getattr(metrics, name), getattr(expected, name), rtol=0, atol=0,
                                       equal_nan=True, msg=name)
    replaced = dataclasses.replace(loss_and_grad(batch, case, False)[0].metrics, qkl=None)
    assert replaced.qkl is None and torch.equal(replaced.pg_loss, record.pg_loss)
    with pytest.raises(AttributeError, match="no attribute 'not_a_metric'"):
        record.not_a_metric



@contextlib.contextmanager
def launches_and_reads(monkeypatch):
    """[name, ...]: the Triton kernels launched in the block and "read" where the value checks' host read waits
    (when the function `validation.read_code_later` returned is called: on CUDA the wait on the event recorded after
    the code's copy), in order."""
    order = []
    read_code_later = validation.read_code_later

    def logged_read_code_later(value):
        read = read_code_later(value)
        return lambda: order.append("read") or read()

    monkeypatch.setattr(validation, "read_code_later", logged_read_code_later)
    with watched_launches(lambda kernel, args, kwargs: order.append(kernel.fn.__name__)):
        yield order


@pytest.mark.parametrize("two_ops", [False, True], ids=["one-node", "two-ops"])
def test_the_checks_read_waits_after_the_forward_is_queued(two_ops, monkeypatch, device):
    """validate=True: the value checks' one host read waits only once the forward's kernels are queued (the
    log-prob / entropy kernel and the objective's), so the device runs them while the host waits for the checks'
    code (on CUDA a copy to pinned memory and an event recorded right after it: the wait is for the checks and the
    copy, not for the kernels queued after them); only the backward is launched after it."""
    batch = random_batch(device=device)
    loss_and_grad(batch, {}, two_ops)  # compiled first on a GPU
    with launches_and_reads(monkeypatch) as order:
        loss_and_grad(batch, {}, two_ops)
    objective = ["_objective_sample_kernel", "_objective_finish_kernel"] if two_ops else [
        "_objective_sample_finish_kernel"]
    variant = FORWARD_VARIANTS[DEFAULT_FORWARD_VARIANT]
    forward, backward = variant.kernel.__name__, (variant.backward if two_ops else variant.node_backward).__name__
    after = ["_objective_grad_kernel", backward] if two_ops else [backward]
    assert order == ["_first_bad_row_kernel", forward, *objective, "read", *after], order


def test_the_checks_code_read_reuses_its_pinned_buffer_but_not_under_a_pending_read(device):
    """`validation.read_code_later` (the value checks' one read): on CUDA each call after the previous one's read
    copies into the same pinned buffer (no allocation, no new event), and a call made while a read is pending gets a
    new buffer, which the later calls reuse, each read returning its own code; elsewhere the code itself."""
    first, second = torch.arange(3, device=device), torch.arange(10, 13, device=device)
    if device.type != "cuda":
        assert validation.read_code_later(first)() is first
        return
    host = validation.read_code_later(first)()
    assert host.is_pinned() and host.tolist() == [0, 1, 2]
    again = validation.read_code_later(second)()
    assert again.data_ptr() == host.data_ptr() and again.tolist() == [10, 11, 12]
    pending = validation.read_code_later(first)
    beside = validation.read_code_later(second)  # queued before the first one's read
    beside_host = beside()
    assert beside_host.tolist() == [10, 11, 12] and beside_host.data_ptr() != host.data_ptr()
    pending_host = pending()
    assert pending_host.tolist() == [0, 1, 2] and pending_host.data_ptr() == host.data_ptr()
    assert validation.read_code_later(first)().data_ptr() == beside_host.data_ptr()
    # without reuse (the fused path's reads, whose results are kept): a buffer per call, each keeping its value
    kept, later = validation.read_later(first)(), validation.read_later(second)()
    assert kept.is_pinned() and kept.data_ptr() not in (later.data_ptr(), host.data_ptr(), beside_host.data_ptr())
    assert kept.tolist() == [0, 1, 2] and later.tolist() == [10, 11, 12]


def test_a_reused_read_s_buffer_is_reused_only_once_the_previous_read_is_done(monkeypatch, device):
    """`validation.read_later(reuse=True)`'s choice of pinned buffer and event (`_reused_read`), on any machine (the
    buffer is CUDA's: a stand-in holds the value's shape here): one per device, shape and dtype, the same one again
    once its read is done, a new one while it is pending, which the later calls then get."""
    class Place:
        def __init__(self, value):
            self.shape, self.dtype, self.busy = value.shape, value.dtype, False

    monkeypatch.setattr(validation, "_PinnedRead", Place)
    monkeypatch.setattr(validation, "_REUSED_READS", threading.local())
    code = torch.zeros(3, dtype=torch.int64, device=device)
    first = validation._reused_read(code)
    assert validation._reused_read(torch.ones(3, dtype=torch.int64, device=device)) is first  # no read pending
    others = [validation._reused_read(torch.zeros(4, dtype=torch.int64, device=device)),
              validation._reused_read(code.float())]
    assert len({id(place) for place in (first, *others)}) == 3 and others[0].shape == (4,)
    first.busy = True  # a copy queued, its read to come
    beside = validation._reused_read(code)
    assert beside is not first and validation._reused_read(code) is beside
    first.busy = False  # the pending read done: its buffer is its reader's, the calls go on with the new one
    assert validation._reused_read(code) is beside


SAMPLE_RANGE = r"sample_index must lie in \[0, 5\) \(S = len\(advantages\)\) on scored rows;"


@pytest.mark.parametrize("column, value, message", [
    ("targets", 37, r"^targets must lie in \[0, 37\) on scored rows; row 4 holds 37$"),
    ("targets", -5, r"^targets must lie in \[0, 37\) on scored rows; row 4 holds -5$"),
    ("sample_index", 9, rf"^{SAMPLE_RANGE} row 4 holds 9$"),
    ("sample_index", -1, rf"^{SAMPLE_RANGE} row 4 holds -1$"),
    ("token_kind", 3, r"^token_kind must be 0, 1 or 2; row 4 holds 3$"),
], ids=["target-V", "target-negative", "sample-S", "sample-negative", "kind-3"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
def test_a_bad_row_raises_before_the_one_node_returns_and_leaves_the_logits(column, value, message, device):
    """The one node's kernels are queued before the checks' read (the test above): on a bad row (non-finite logits
    beside it) they run on it, and then the row's own one-line ValueError is raised before erpo_loss returns: no
    loss to call backward on, and with inplace_backward the logits are left as they were."""
    batch = random_batch(device=device)
    row = int((batch["token_kind"] != 0).nonzero()[4])  # the fifth scored row
    batch[column] = batch[column].clone()
    batch[column][row] = value
    batch["logits"][0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")], device=device)
    logits = batch["logits"].clone()
    with pytest.raises(ValueError, match=message.replace("row 4", f"row {row}")) as raised:
        loss_and_grad(batch, {}, two_ops=False, inplace_backward=True)
    assert "\n" not in str(raised.value)
    torch.testing.assert_close(batch["logits"], logits, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("num_samples", [0, 1, 5, 16])
@pytest.mark.parametrize("num_rows", [0, 1, 47, 48])
def test_the_workspace_regions_begin_at_multiples_of_16_in_one_allocation(num_rows, num_samples, device):
    """`triton_objective.NodeWorkspace`: its regions are views of `whole` (one allocation), in the fields' order,
    each of its own length and at a multiple of REGION_ALIGN = 16 elements, where `_node_regions` finds them (a region
    begins where the one before, rounded up, ends), whatever N and S."""
    from erpo_kernels.triton_objective import FLOAT_METRICS, NUM_PARTIALS, NodeWorkspace, aligned_length

    whole, *regions = NodeWorkspace.empty(num_rows, num_samples, device)
    lengths = [num_rows] * 5 + [num_samples] * 2 + [num_samples * NUM_PARTIALS, 1, len(FLOAT_METRICS), 3]
    offset = 0
    for region, length in zip(regions, lengths, strict=True):
        assert region.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        assert (region.storage_offset(), region.numel(), region.is_contiguous()) == (offset, length, True)
        assert offset % 16 == 0
        offset += aligned_length(length)
    assert whole.numel() == offset - aligned_length(3) + 3 and whole.storage_offset() == 0
    assert regions[-3].shape == ()  # the loss
