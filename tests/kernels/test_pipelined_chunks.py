"""The fused path's pipelined chunk loop (fused_linear_loss.PIPELINE, `run_pipelined`): bit for bit the serial
loop's results where both have the same chunks and groups, on the device's streams (on CUDA the race check) and
with either queue held back on the host until the other waits for it (a missing wait then reads a stale or unwritten
buffer); the reference's values for the options that change the loop; the budget with both logits buffers; the
launches and host reads of the serial loop; the SM carveout of its logits GEMMs put back, also on an exception."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton` (also done by conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402

import erpo_kernels.fused_linear_loss as chunked  # noqa: E402
from erpo_kernels.fused_linear import fused_linear_erpo_loss  # noqa: E402
from launch_counts import LaunchCounter  # noqa: E402
from test_fused_linear_loss import (  # noqa: E402
    HIDDEN_DIM,
    ROW_TENSORS,
    SAMPLES,
    VOCAB,
    assert_same_loss,
    budget_for,
    budget_for_groups,
    fused_and_logits_path,
    host_layout_of,
    interleaved_batch,
    leaves,
    linear,
    packed_batch,
    record,
)


class HeldBackQueue:
    """`chunk_streams.ChunkStreams` on one queue with the `held` one's work ("main" or "side") kept on the host and
    run, in order, only when the other queue waits for an event recorded after it (or at `join`): the schedule in
    which that queue lags as far as the events allow. A wait the loop lacks lets the other queue read a buffer
    before the held work wrote it, or overwrite one the held work has yet to read."""

    def __init__(self, held: str):
        self.held, self.pending, self.ran = held, [], 0

    def _queue(self, queue: str, work) -> None:
        if queue == self.held:
            self.pending.append(work)
        else:
            work()

    def _record(self, queue: str):
        return len(self.pending) if queue == self.held else None

    def _wait(self, queue: str, event) -> None:
        if queue != self.held and event is not None:
            self._run_until(event)

    def _run_until(self, count: int) -> None:
        while self.ran < count:
            self.ran += 1
            self.pending[self.ran - 1]()

    def on_main(self, work):
        self._queue("main", work)

    def on_side(self, work):
        self._queue("side", work)

    def record_main(self):
        return self._record("main")

    def record_side(self):
        return self._record("side")

    def main_waits(self, event):
        self._wait("main", event)

    def side_waits(self, event):
        self._wait("side", event)

    def join(self):
        self._run_until(len(self.pending))


QUEUES = ["device", "held-side", "held-main"]


def use_queues(monkeypatch, queues: str) -> list:
    """The pipelined loop on the device's queues (CUDA's two streams, or one elsewhere) or on a HeldBackQueue: the
    list of the HeldBackQueues made (one a call)."""
    made = []

    def held_back(device):
        made.append(HeldBackQueue(queues.removeprefix("held-")))
        return made[-1]

    if queues != "device":
        monkeypatch.setattr(chunked, "ChunkStreams", held_back)
    return made


def pipelined_budget(serial_budget: int, chunk_rows: int) -> int:
    """The serial budget plus a second fp32 logits buffer of chunk_rows rows: the same chunks and groups."""
    return serial_budget + chunk_rows * 4 * VOCAB


def loop_workspace(num_rows, dtype, device, budget, backend="triton", batch_invariant=False):
    """The `Workspace` the loss plans for num_rows rows of `dtype` on `device` within `budget` under the knobs."""
    return chunked.plan_workspace(num_rows, HIDDEN_DIM, VOCAB, dtype, device, chunked.ROW_KERNELS[backend], budget,
                                  batch_invariant, chunked.logits_buffers_for(dtype))


def run_loss(batch, tensors, backend, budget, batch_invariant=False, host_layout=None, **options):
    """(loss, token_logp, entropy, metrics..., gradients...) of one fwd+bwd."""
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    ours = leaves(*tensors)
    out = fused_linear_erpo_loss(ours[0], ours[1], *(batch[k] for k in ROW_TENSORS), bias=ours[2], backend=backend,
                                 workspace_bytes=budget, batch_invariant=batch_invariant, host_layout=host_layout,
                                 **inputs, **options)
    out.loss.backward()
    metrics = [out.metrics[name] for name in sorted(out.metrics)]
    return [out.loss, out.token_logp, out.entropy, *metrics, *(t.grad for t in ours if t is not None)]


# name: (dtype, backend, chunk rows, group rows (None: the dlogits over the logits), batch_invariant, host_layout,
# packed rows, options). Chunks of 4 rows cut SAMPLES' longer prompts (a pre-pass) and give groups of 4 chunks.
QKL = dict(qkl_coef=0.5, loss_agg="seq-mean-token-mean", entropy_coef=0.05)
CASES = {
    "bf16-store-query-kl-split": (torch.bfloat16, "triton", 4, 16, False, False, True, QKL),
    "bf16-store-sequence-ratio-interleaved": (torch.bfloat16, "triton", 4, 12, False, False, False,
                                             dict(ratio_level="sequence", off_policy_mask_threshold=0.1)),
    "fp32-over-logits-entropy-filter": (torch.float32, "triton", 5, None, False, False, True,
                                        dict(top_entropy_quantile=0.4, entropy_coef=0.05, entropy_agg="token-mean")),
    "fp32-batch-invariant-host-layout": (torch.float32, "triton", 8, None, True, True, True, QKL),
    "torch-bf16-store": (torch.bfloat16, "torch", 4, 16, False, False, True, QKL),
}


@pytest.mark.parametrize("queues", QUEUES)
@pytest.mark.parametrize("case", list(CASES))
def test_the_pipelined_loop_gives_the_serial_loop_s_results_bit_for_bit(case, queues, monkeypatch, device):
    """Loss, per-row values, metrics and gradients equal (torch.equal) to the serial loop's with the same chunks and
    groups: on CUDA's two streams a race would show here; with a queue held back, a wait the loop lacks."""
    dtype, backend, chunk_rows, group_rows, invariant, given_layout, packed, options = CASES[case]
    monkeypatch.setattr(chunked, "LOGITS_ROWS", chunk_rows)
    monkeypatch.setattr(chunked, "INVARIANT_ROWS", 4)  # batch_invariant: GEMMs of 4 rows, chunks of 8
    held_back = use_queues(monkeypatch, queues)
    batch = packed_batch(SAMPLES, device) if packed else interleaved_batch(device)
    num_rows = len(batch["targets"])
    tensors = linear(num_rows, dtype, device)
    serial = (budget_for_groups(chunk_rows, group_rows, dtype, device, backend) if group_rows
              else budget_for(chunk_rows, dtype, device, backend))
    host_layout = host_layout_of(batch) if given_layout else None
    results, plans = [], []
    for pipeline, budget in ((False, serial), (True, pipelined_budget(serial, chunk_rows))):
        monkeypatch.setattr(chunked, "PIPELINE", pipeline)
        plans.append(loop_workspace(num_rows, dtype, device, budget, backend, invariant))
        results.append(run_loss(batch, tensors, backend, budget, invariant, host_layout, **options))
    assert plans[0] == chunked.Workspace(chunk_rows, group_rows or chunk_rows, group_rows is not None, 1)
    assert plans[1] == chunked.Workspace(chunk_rows, group_rows or chunk_rows, group_rows is not None, 2)
    assert len(results[0]) == len(results[1])
    # the held queue's work did wait on the host: several chunks' worth, run in order by the other queue's waits
    assert queues == "device" or (len(held_back) == 1 and held_back[0].ran == len(held_back[0].pending) > 4)
    for serial_value, pipelined_value in zip(*results):
        assert torch.equal(serial_value, pipelined_value), (serial_value, pipelined_value)


@pytest.mark.parametrize("options", [dict(QKL), dict(ratio_level="sequence", pg_objective="vespo"),
                                     dict(top_entropy_quantile=0.5, entropy_coef=0.05, entropy_agg="token-mean",
                                          ratio_level="sequence")],
                         ids=["query-kl-split-prompts", "sequence-ratio-vespo", "entropy-filter"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_pipelined_loop_matches_the_reference(options, dtype, monkeypatch, device):
    """With a bias, chunks of 4 rows (the dlogits in a store of 12 in bf16, over the logits in fp32), several groups
    and, for the Query-KL, prompts longer than a chunk (pre-passed)."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 4)
    monkeypatch.setattr(chunked, "PIPELINE", True)
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), dtype, device)
    serial = budget_for_groups(4, 12, dtype, device) if dtype == torch.bfloat16 else budget_for(4, dtype, device)
    budget = pipelined_budget(serial, 4)
    assert loop_workspace(len(batch["targets"]), dtype, device, budget).logits_buffers == 2
    assert_same_loss(*fused_and_logits_path(batch, tensors, "triton", rows=4, workspace_bytes=budget, **options),
                     dtype=dtype)


def test_fp16_runs_the_serial_loop_under_the_knob(monkeypatch, device):
    """fp16 reads each chunk's gradient scale on the host: with PIPELINE it plans one logits buffer, makes no
    streams and gives what it gives without."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 4)
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.float16, device)
    budget = budget_for_groups(4, 16, torch.float16, device)
    results = []
    for pipeline in (False, True):
        monkeypatch.setattr(chunked, "PIPELINE", pipeline)
        assert loop_workspace(len(batch["targets"]), torch.float16, device, budget).logits_buffers == 1
        results.append(run_loss(batch, tensors, "triton", budget, **QKL))
        monkeypatch.setattr(chunked, "ChunkStreams", None)  # a pipelined loop would fail to make its queues
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_budget_holds_both_logits_buffers(monkeypatch, device):
    """The chunk pass itself under the Recorder (test_fused_linear_loss): with PIPELINE both fp32 buffers [4, V]
    live beside the store and the group's hidden rows, all within the budget."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 4)
    monkeypatch.setattr(chunked, "PIPELINE", True)
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.bfloat16, device)
    budget = pipelined_budget(budget_for_groups(4, 16, torch.bfloat16, device), 4)
    recorder = record(batch, tensors, rows=4, budget=budget, **QKL)
    store_row = VOCAB * 2 + chunked.gradient_row_bytes(VOCAB, HIDDEN_DIM, torch.bfloat16, device)
    assert 2 * 4 * VOCAB * 4 + 16 * store_row <= recorder.peak_workspace <= budget
    assert max(recorder.group_rows) == 16 and max(recorder.logits_gemm_rows) == 4


@pytest.mark.parametrize("hidden_dim", [3584, 5120], ids=["qwen2.5-7b", "qwen2.5-32b"])
def test_in_1_gib_the_second_buffer_costs_the_store_half_its_rows(hidden_dim, monkeypatch):
    """bf16, V = 152064 on CUDA, N = 16384: beside 512-row chunks the store holds 1024 rows instead of 2048 (16 d
    weight accumulations instead of 8); beside 256-row chunks, 2304 (bench.fused_probe times both)."""
    def plan(chunk_rows, buffers):
        monkeypatch.setattr(chunked, "LOGITS_ROWS", chunk_rows)
        return chunked.plan_workspace(16384, hidden_dim, 152064, torch.bfloat16, torch.device("cuda"),
                                      chunked.ROW_KERNELS["triton"], 1 << 30, False, buffers)

    assert plan(512, 1) == chunked.Workspace(512, 2048, True, 1)
    assert plan(512, 2) == chunked.Workspace(512, 1024, True, 2)
    assert plan(256, 2) == chunked.Workspace(256, 2304, True, 2)


@pytest.mark.parametrize("dtype, group_rows", [(torch.bfloat16, 16), (torch.float32, None)],
                         ids=["bf16-store", "fp32-over-logits"])
def test_the_pipelined_loop_launches_what_the_serial_one_does(dtype, group_rows, monkeypatch, device):
    """LaunchCounter over one fwd+bwd (validate=False): the same launches, by name, and the one host read, the
    plan's (the events and the side stream launch nothing; test_fused_linear_loss's launch formulas hold as they
    are)."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 4)
    batch = packed_batch([(1, 2)] * 12, device)
    serial = budget_for_groups(4, 16, dtype, device) if group_rows else budget_for(4, dtype, device)
    counts, tensors = [], linear(48, dtype, device)
    for pipeline, budget in ((False, serial), (True, pipelined_budget(serial, 4))):
        monkeypatch.setattr(chunked, "PIPELINE", pipeline)
        with LaunchCounter() as counter:
            run_loss(batch, tensors, "triton", budget, validate=False, qkl_coef=0.5, ratio_level="sequence")
        counts.append((counter.launches, dict(counter.names), counter.syncs))
    assert counts[0] == counts[1] and counts[0][2] == 1, counts


needs_carveout = pytest.mark.skipif(not hasattr(torch._C, "_set_sm_carveout_experimental"),
                                    reason="this torch has no SM carveout")


@needs_carveout
@pytest.mark.filterwarnings("ignore:Setting the SM carveout")  # torch's: the knob is experimental
def test_the_chunks_logits_gemms_run_under_the_carveout_and_it_is_put_back(monkeypatch, device):
    """ROW_PASS_SMS: the loop's logits GEMMs (chunks 1 on) see the carveout, those before the loop (the early half
    chunk, the rest of the first) and the groups' GEMMs do not; after the call, and after a GEMM that raised, the
    setting is what it was."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 4)
    monkeypatch.setattr(chunked, "PIPELINE", True)
    monkeypatch.setattr(chunked, "ROW_PASS_SMS", 8)
    before = torch._C._get_sm_carveout_experimental()
    seen, write_logits = [], chunked._write_logits

    def watched(out, *args):
        seen.append(torch._C._get_sm_carveout_experimental())
        if fail_at is not None and len(seen) == fail_at:
            raise RuntimeError("a logits GEMM failed")
        write_logits(out, *args)

    monkeypatch.setattr(chunked, "_write_logits", watched)
    batch = packed_batch([(1, 2)] * 12, device)  # 12 chunks of 4 rows, no pre-pass
    budget = pipelined_budget(budget_for_groups(4, 16, torch.bfloat16, device), 4)
    fail_at = None
    run_loss(batch, linear(48, torch.bfloat16, device), "triton", budget, qkl_coef=0.5)
    assert seen == [before, before] + [8] * 11
    assert torch._C._get_sm_carveout_experimental() == before
    seen.clear()
    fail_at = 5
    with pytest.raises(RuntimeError, match="a logits GEMM failed"):
        run_loss(batch, linear(48, torch.bfloat16, device), "triton", budget, qkl_coef=0.5)
    assert seen[-1] == 8 and torch._C._get_sm_carveout_experimental() == before
