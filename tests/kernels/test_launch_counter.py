"""LaunchCounter's host syncs (tests/support/launch_counts.py): every read of a device value on the host, and every
blocking copy from the host, counted as CUDA synchronizes (an aten kernel that reads twice counts twice), on the CPU
too (where `.cpu()`, `.numpy()`, `.tolist()` and the reads inside a data-dependent shape dispatch nothing that shows
them); a host tensor's reads and the operators that do not read values count none. On CUDA the counts are checked
against PyTorch's own sync detector (torch.cuda.set_sync_debug_mode)."""
import warnings

import numpy as np
import pytest
import torch

from erpo_kernels import fused_linear_loss
from launch_counts import LaunchCounter


def _mask(values):
    return values % 2 == 0


# name -> (call on a device tensor of 6 int64 values [0, 6), host syncs on CUDA: reads of device values by aten's CUDA
# kernels, blocking copies)
READS = {
    "cpu": (lambda t: t.cpu(), 1),
    "to-cpu": (lambda t: t.to("cpu"), 1),
    "cpu-then-numpy": (lambda t: t.cpu().numpy(), 1),
    "tolist": (lambda t: t.tolist(), 1),
    "item": (lambda t: t[0].item(), 1),
    "bool": (lambda t: bool(t[1]), 1),
    "int": (lambda t: int(t[1]), 1),
    "float": (lambda t: float(t[1]), 1),
    "index-by-tensor": (lambda t: [0, 1][t[1]], 1),
    "equal": (lambda t: torch.equal(t, t.clone()), 1),  # of t itself aten answers without reading
    "nonzero": (lambda t: t.nonzero(), 1),
    "where-one-argument": (lambda t: torch.where(_mask(t)), 1),
    "boolean-index": (lambda t: t[_mask(t)], 1),
    "boolean-index-put-of-a-tensor": (lambda t: t.clone().__setitem__(_mask(t), t[:3] + 1), 1),
    "unique": (lambda t: torch.unique(t), 1),
    "masked-select": (lambda t: t.masked_select(_mask(t)), 1),
    "repeat-interleave": (lambda t: t.repeat_interleave(t), 2),  # the total, and that no count is negative
    "bincount": (lambda t: torch.bincount(t), 2),  # the min (>= 0) and the max (the bins)
    "upload-from-numpy": (lambda t: torch.from_numpy(np.arange(3)).to(t.device), 1),
    "tensor-on-the-device": (lambda t: torch.tensor([1, 2], device=t.device), 1),
    "one-read-of-two-tensors": (lambda t: torch.stack([t, t + 1]).cpu().numpy(), 1),
    # no sync
    "repeat-interleave-with-output-size": (lambda t: t.repeat_interleave(t, output_size=15), 0),
    "boolean-index-put-of-a-number": (lambda t: t.clone().__setitem__(_mask(t), 7), 0),
    "upload-non-blocking": (lambda t: torch.from_numpy(np.arange(3)).to(t.device, non_blocking=True), 0),
    "host-tensor-read": (lambda t: int(torch.from_numpy(np.arange(3))[1]), 0),
    "host-tensor-tolist": (lambda t: torch.tensor([1, 2], device="cpu").tolist(), 0),
    "device-math": (lambda t: (t.to(torch.float32) * 2).sum().to(t.device), 0),
}
@pytest.mark.parametrize("name", READS)
def test_each_host_read_counts_as_on_cuda(name, device):
    call, syncs = READS[name]
    values = torch.arange(6, device=device)
    with LaunchCounter() as counter:
        call(values)
    assert counter.syncs == syncs, counter.sync_names


def test_order_lists_launches_and_reads_as_they_happen(device):
    """`order`: each launch and each read, in the order they happened."""
    values = torch.arange(6, device=device)
    with LaunchCounter() as counter:
        doubled = values * 2
        doubled.sum().item()
        (doubled + 1).tolist()
    read_copy = [("launch", "aten._to_copy")] if device.type == "cuda" else []  # as in test_host_work_is_no_launch
    assert counter.order == [("launch", "aten.mul"), ("launch", "aten.sum"), ("sync", "aten._local_scalar_dense"),
                             ("launch", "aten.add"), ("sync", "Tensor.tolist"), *read_copy], counter.order


def test_numpy_of_a_device_tensor_is_one_sync(device):
    if device.type != "cpu":
        pytest.skip("a CUDA tensor has no numpy(): its read is .cpu(), test_each_host_read_counts_as_on_cuda")
    with LaunchCounter() as counter:
        torch.arange(6, device=device).numpy()
    assert counter.sync_names == {"Tensor.numpy": 1}


def test_a_tensor_declared_host_memory_reads_without_a_sync():
    """A CPU tensor made before the counter counts as device memory on the CPU (a read of it one sync) until
    `host_memory` declares it host memory (a read of it none), as it is on CUDA."""
    made_before = torch.arange(6, device="cpu")  # host memory on any machine
    for declared, syncs in ((False, 1), (True, 0)):
        with LaunchCounter(device="cpu") as counter:
            if declared:
                counter.host_memory(made_before)
            made_before.numpy()
        assert counter.syncs == syncs, counter.sync_names


# name -> (call on a device tensor, what the host does: Counter of aten operators; none launches on the device)
HOST_WORK = {
    "factory-without-a-device": (lambda t: torch.zeros(3, device=None), {"aten.zeros": 1}),  # None: the default
    "factory-on-the-cpu-string": (lambda t: torch.full((2, 3), 7, device="cpu"), {"aten.full": 1}),
    "math-on-host-tensors": (lambda t: torch.arange(4, device="cpu") * torch.tensor([1, 2, 3, 4], device="cpu"),
                             {"aten.arange": 1, "aten.mul": 1}),
    "a-host-read-then-math": (lambda t: t.cpu() + 1, {"aten.add": 1}),
    "zeros-like-of-a-host-tensor": (lambda t: torch.zeros_like(torch.ones(2, device="cpu")),
                                    {"aten.ones": 1, "aten.zeros_like": 1}),
}


@pytest.mark.parametrize("name", HOST_WORK)
def test_host_work_is_no_launch(name, device):
    """The operators on host memory alone (a factory given no device, math on host tensors) are host work: counted in
    host_names, not as launches; their results are host memory (a read of them is no sync)."""
    call, host_work = HOST_WORK[name]
    values = torch.arange(6, device=device)
    with LaunchCounter() as counter:
        result = call(values)
        result.tolist()
    reads = name == "a-host-read-then-math"
    launches = {"aten._to_copy": 1} if reads and device.type == "cuda" else {}  # the read's copy (on the CPU: none)
    assert counter.host_names == host_work and counter.names == launches, (counter.host_names, counter.names)
    assert counter.sync_names == ({"Tensor.cpu": 1} if reads else {}), counter.sync_names


def test_device_work_next_to_host_work(device):
    """A factory given the device, the upload of a host tensor and math on it are the device's launches, beside the
    host's work."""
    with LaunchCounter() as counter:
        host = torch.zeros(3)
        on_device = torch.ones(3, device=device) + host.to(device, non_blocking=True)
        on_device.sum()
    expected = {"aten.ones": 1, "aten.add": 1, "aten.sum": 1}
    if device.type == "cuda":
        expected["aten._to_copy"] = 1  # the upload's copy (on the CPU `.to` returns the host tensor: no operator)
    assert counter.host_names == {"aten.zeros": 1} and counter.names == expected, (counter.host_names, counter.names)


def _casts(x: torch.Tensor) -> torch.Tensor:
    """A cast that copies (x: bf16), one that returns its input, a view, a `contiguous` that copies, and the fused
    path's CPU-only upcast of a GEMM operand: 4 launches counted (2 copies, 2 additions), wherever it runs."""
    y = x.float()
    same = y.float()
    transposed_copy = y.t().contiguous()
    return fused_linear_loss.cpu_fp32_operand(x) + transposed_copy.t() + same


_casts_op = torch.library.custom_op("launch_counts_test::casts", _casts, mutates_args=())


@pytest.mark.parametrize("inside", [False, True], ids=["outside", "inside-a-custom-op"])
def test_copies_count_inside_a_custom_op_as_outside_it_but_the_cpu_upcasts(inside, device):
    """Inside a custom op a composite reaches the counter whole (`aten.to`, `aten.contiguous`), outside it its copy
    does (`aten._to_copy`, `aten.clone`): either way a cast or `contiguous` that copies is one launch, one that returns
    its input or a view none; `fused_linear_loss.cpu_fp32_operand` (the fused path's CPU-only copy of a bf16 / fp16
    GEMM operand to fp32, which CUDA's GEMMs with fp32 output do without) is no launch, in or out of an op."""
    x = torch.arange(6, dtype=torch.bfloat16, device=device).reshape(2, 3)
    upcast = fused_linear_loss.cpu_fp32_operand
    with LaunchCounter() as counter:
        out = (_casts_op if inside else _casts)(x)
    copies = {"aten.to": 1, "aten.contiguous": 1} if inside else {"aten._to_copy": 1, "aten.clone": 1}
    assert counter.names == {**copies, "aten.add": 2}, counter.names
    torch.testing.assert_close(out, 3 * x.float(), rtol=0, atol=0)
    with LaunchCounter() as counter:  # the upcast alone, where the fused path makes it
        fused_linear_loss.cpu_fp32_operand(x)
    assert counter.names == {}, counter.names
    assert fused_linear_loss.cpu_fp32_operand is upcast  # put back after the block


def test_the_wrapped_methods_are_restored(device):
    """The counter patches Tensor methods and torch functions only while it is active, nested entries included."""
    originals = (torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.numpy, torch.Tensor.tolist, torch.from_numpy,
                 torch.tensor, torch.zeros)
    counter = LaunchCounter()
    with counter:
        with counter:
            assert torch.Tensor.cpu is not originals[0] and torch.zeros is not originals[-1]
        assert torch.Tensor.cpu is not originals[0]
    assert (torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.numpy, torch.Tensor.tolist, torch.from_numpy,
            torch.tensor, torch.zeros) == originals
    with LaunchCounter() as after:
        torch.arange(3, device=device).tolist()
    assert after.syncs == 1 and counter.syncs == 0


# What the sync detector warns at each synchronizing call (c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync).
# Not its other warning: set_sync_debug_mode's own notice, "Synchronization debug mode is a prototype feature and
# does not yet detect all synchronizing operations" (TORCH_WARN_ONCE, torch/csrc/cuda/Module.cpp), said by the first
# call of each process, which the H200 run of 2026-11-26 (torch 2.11) counted as a second sync of `.cpu()` and
# `bool()` in whichever test came first in its worker.
SYNC_WARNING = "called a synchronizing CUDA operation"


def cuda_syncs(call) -> list:
    """The messages of PyTorch's sync detector (torch.cuda.set_sync_debug_mode) while `call()` runs: one per
    synchronizing CUDA call."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sync_detections([str(w.message) for w in caught])


def sync_detections(messages: list) -> list:
    """The sync detector's warnings among `messages` (warning texts), one per synchronizing call."""
    return [message for message in messages if SYNC_WARNING in message]


def test_the_detectors_notice_is_no_sync():
    """The two warnings the H200 run recorded for one `.cpu()` (torch 2.11): the mode's notice and one sync."""
    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    sync = "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:162.)"
    assert sync_detections([notice, sync, "an unrelated warning"]) == [sync]


@pytest.mark.parametrize("name", [name for name, (_, syncs) in READS.items() if syncs])
def test_cuda_agrees(name, device):
    """On CUDA: the counter's syncs are the ones PyTorch's sync detector warns about."""
    if device.type != "cuda":
        pytest.skip("the sync detector is CUDA's")
    call, syncs = READS[name]
    values = torch.arange(6, device=device)
    assert len(cuda_syncs(lambda: call(values))) == syncs


# entry -> the counter's host syncs per fwd+bwd on CUDA
ENTRY_SYNCS = {"erpo_loss": 0, "fused_linear_erpo_loss": 1, "padded_erpo_loss-hidden": 1,
               "fused_linear_erpo_loss-host_layout": 0, "fused_linear_erpo_loss-host_layout-validate": 1}


@pytest.mark.parametrize("entry", ENTRY_SYNCS)
def test_cuda_agrees_on_the_entry_points(entry, device):
    """On CUDA, fwd+bwd with validate=False (with True the row checks wait on an event, which the detector does not
    report): the counter counts 0 syncs on the logits path, 1 for the fused-linear chunk plan, 0 when the caller
    gives the plan its host_layout, 1 for padded_erpo_loss's fused-linear path (its selection of the scored rows,
    whose host layout the plan reuses); the detector sees each of them but the waits on an event
    (`validation.read_code_later` on the logits path, `read_later` on the fused path: the counter's
    "event.synchronize"). With
    validate=True and a host_layout, the row checks' wait alone: the layout's upload for its check against the rows
    does not block."""
    if device.type != "cuda":
        pytest.skip("the sync detector is CUDA's")
    from erpo_kernels import erpo_loss, fused_linear_erpo_loss, padded_erpo_loss
    from helpers import loss_inputs, random_batch
    from test_padded import OPTIONS, batch_inputs, leaves_of, trl_batch

    batch, data = random_batch(device=device), trl_batch(device=device)
    hidden, weight = torch.randn(48, 8, device=device), torch.randn(37, 8, device=device)
    rows = (batch["targets"], batch["token_kind"], batch["sample_index"])
    host_layout = torch.stack(rows[1:]).long().cpu()  # read before the counting: the caller's host copy
    calls = {
        "erpo_loss": lambda: erpo_loss(batch["logits"].clone().requires_grad_(), *rows, backend="triton",
                                       validate=False, **loss_inputs(batch)).loss,
        "fused_linear_erpo_loss": lambda: fused_linear_erpo_loss(
            hidden.clone().requires_grad_(), weight.clone().requires_grad_(), *rows, backend="triton",
            validate=False, **loss_inputs(batch)).loss,
        **{f"fused_linear_erpo_loss-host_layout{'-validate' * validate}": lambda validate=validate: (
            fused_linear_erpo_loss(hidden.clone().requires_grad_(), weight.clone().requires_grad_(), *rows,
                                   backend="triton", validate=validate, **loss_inputs(batch),
                                   host_layout=host_layout).loss) for validate in (False, True)},
        "padded_erpo_loss-hidden": lambda: padded_erpo_loss(
            **dict(zip(("hidden", "weight", "bias"), leaves_of(data, "hidden"))), **batch_inputs(data),
            **dict(OPTIONS, backend="triton"), validate=False).loss,
    }
    calls[entry]().backward()  # compiles the kernels first
    with LaunchCounter() as counter:
        calls[entry]().backward()
    detected = cuda_syncs(lambda: calls[entry]().backward())
    assert counter.syncs == ENTRY_SYNCS[entry], counter.sync_names
    assert len(detected) == counter.syncs - counter.sync_names["event.synchronize"], (
        detected, counter.sync_names)
