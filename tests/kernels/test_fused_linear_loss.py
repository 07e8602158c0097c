"""The fused-linear ERPO loss in row chunks (erpo_kernels/fused_linear_loss.py): values, gradients and metrics
against the logits path with many chunks, samples split by chunks, the chunk plan, FLOPs (6 N D V plus the
pre-pass), the workspace, launches, determinism, batch invariance and the accuracy of the fp32 d weight, on the
`device` fixture's device: Triton compiled on a GPU when one is present, the interpreter on CPU. Random values are
drawn on the CPU (the same on every device) and then moved."""
import contextlib
import dataclasses
import itertools
import os
import weakref

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton` (also done by conftest.py)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import erpo_kernels.fused_linear_loss as chunked  # noqa: E402
import erpo_kernels.triton_chunk_objective as chunk_objective  # noqa: E402
import erpo_kernels.triton_logits_gemm as triton_logits_gemm  # noqa: E402
from erpo_kernels.api import erpo_loss, segment_sum_of  # noqa: E402
from erpo_kernels.fused_linear import fused_linear_erpo_loss  # noqa: E402
from erpo_kernels.triton_chunk_objective import chunk_layout  # noqa: E402
from erpo_kernels.triton_objective import NUM_PARTIALS  # noqa: E402
from erpo_kernels.triton_segment import sample_spans  # noqa: E402
from erpo_kernels.validation import LossInputs, LossOptions  # noqa: E402
from launch_counts import LaunchCounter  # noqa: E402
from test_reference import OPTION_CASES  # noqa: E402

VOCAB, HIDDEN_DIM = 300, 24
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=2e-2)}


def packed_batch(kinds_per_sample, device, vocab=VOCAB, seed=0):
    """Samples in consecutive rows: kinds_per_sample[s] = (query rows, response rows), each sample followed by one
    padding row (kind 0, target -100); every input tensor of the loss filled, on `device`."""
    g = torch.Generator().manual_seed(seed)
    kinds, samples = [], []
    for s, (queries, responses) in enumerate(kinds_per_sample):
        kinds += [1] * queries + [2] * responses + [0]
        samples += [s] * (queries + responses) + [0]
    kind = torch.tensor(kinds, device=device)
    num_rows, num_samples = len(kinds), len(kinds_per_sample)
    targets = torch.randint(0, vocab, (num_rows,), generator=g).to(device)
    targets[kind == 0] = -100
    guess = (-torch.rand(num_rows, generator=g) * 4 - 0.5).to(device)
    return dict(targets=targets, token_kind=kind, sample_index=torch.tensor(samples, device=device),
                advantages=torch.randn(num_samples, generator=g).to(device),
                ref_query_logp=(-torch.rand(num_samples, generator=g) * 20 - 10).to(device),
                query_weight=(torch.rand(num_samples, generator=g) * 2).to(device),
                old_logp=guess + 0.3 * torch.randn(num_rows, generator=g).to(device),
                ref_logp=guess + 0.3 * torch.randn(num_rows, generator=g).to(device))


def interleaved_batch(device, num_rows=48, num_samples=5, seed=0):
    """Rows of the samples mixed at random (no sample-aligned cut exists), on `device`."""
    g = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 3, (num_rows,), generator=g).to(device)
    batch = packed_batch([(1, 1)] * num_samples, device, seed=seed)
    sample_index = torch.randint(0, num_samples, (num_rows,), generator=g).to(device)
    targets = torch.randint(0, VOCAB, (num_rows,), generator=g).to(device)
    targets[kind == 0] = -100
    guess = (-torch.rand(num_rows, generator=g) * 4 - 0.5).to(device)
    batch.update(token_kind=kind, sample_index=sample_index, targets=targets,
                 old_logp=guess + 0.3 * torch.randn(num_rows, generator=g).to(device),
                 ref_logp=guess + 0.3 * torch.randn(num_rows, generator=g).to(device))
    return batch


ROW_TENSORS = ("targets", "token_kind", "sample_index")


def linear(num_rows, dtype, device, seed=1, bias=True):
    """(hidden [num_rows, D], weight [V, D], bias [V] or None) of `dtype` on `device`."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, HIDDEN_DIM, generator=g).to(device, dtype)
    weight = (torch.randn(VOCAB, HIDDEN_DIM, generator=g) * 2.0 / HIDDEN_DIM ** 0.5).to(device, dtype)
    b = (torch.randn(VOCAB, generator=g) * 0.5).to(device, dtype) if bias else None
    return hidden, weight, b


def logits_row_bytes(dtype, backend="triton", vocab=VOCAB, epilogue=None):
    """Workspace bytes of one row of the logits buffer as `plan_workspace` counts it: with the epilogue's row of
    statistics when `epilogue` (None: when the loss forms them, `epilogue_row_pass`: EPILOGUE_ROW_PASS on the Triton
    backend)."""
    kernels = chunked.ROW_KERNELS[backend]
    epilogue = chunked.epilogue_row_pass(kernels) if epilogue is None else epilogue
    return chunked.logits_row_bytes(vocab, kernels,
                                    triton_logits_gemm.stats_row_bytes(vocab, dtype) if epilogue else 0)


def budget_for(rows, dtype, device, backend="triton", vocab=VOCAB, hidden_dim=HIDDEN_DIM, epilogue=None):
    """workspace_bytes giving chunks of `rows` rows of `dtype` inputs on `device`, their dlogits over their logits
    (the budget per row depends on both: `logits_row_bytes`, `gradient_row_bytes`), for an lm_head [vocab,
    hidden_dim] (epilogue: `logits_row_bytes`')."""
    return rows * (logits_row_bytes(dtype, backend, vocab, epilogue)
                   + chunked.gradient_row_bytes(vocab, hidden_dim, dtype, device))


def budget_for_groups(chunk_rows, group_rows, dtype, device, backend="triton"):
    """workspace_bytes giving chunks of `chunk_rows` rows beside a dlogits store of `group_rows` rows (with
    chunked.LOGITS_ROWS == chunk_rows; `plan_workspace` takes the store when it holds more rows than the dlogits
    over the logits would)."""
    item = dtype.itemsize
    return (chunk_rows * logits_row_bytes(dtype, backend)
            + group_rows * (VOCAB * item + chunked.gradient_row_bytes(VOCAB, HIDDEN_DIM, dtype, device)))


def logits_gemm_launch(bias=True):
    """LaunchCounter's entry of a chunk's logits GEMM on the Triton backend: the epilogue's Triton GEMM with
    EPILOGUE_ROW_PASS, else cuBLAS's (aten's addmm with a bias, mm without)."""
    if chunked.EPILOGUE_ROW_PASS:
        return ("launch", "triton._logits_gemm_kernel")
    return ("launch", "aten.addmm" if bias else "aten.mm")


def forward_row_launch():
    """LaunchCounter's entry of a chunk's forward row pass on the Triton backend: the epilogue's merge of its
    statistics with EPILOGUE_ROW_PASS, else the forward row kernel of CHUNK_FORWARD_VARIANT."""
    from erpo_kernels.triton_logits import FORWARD_VARIANTS
    if chunked.EPILOGUE_ROW_PASS:
        return ("launch", "triton._combine_kernel")
    return ("launch", f"triton.{FORWARD_VARIANTS[chunked.CHUNK_FORWARD_VARIANT].kernel.__name__}")


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.fixture(params=[False, True], ids=["dhidden-as-hidden", "dhidden-fp32"])
def grad_hidden_fp32(request, monkeypatch):
    """The test run with `fused_linear_loss.GRAD_HIDDEN_FP32` off (d hidden held in hidden's dtype, the library's
    default) and on (held in fp32 until the backward rounds it once): the oracle tests that must pass both ways."""
    monkeypatch.setattr(chunked, "GRAD_HIDDEN_FP32", request.param)
    return request.param


@pytest.fixture
def dlogits_over_logits(monkeypatch):
    """No cap on the dlogits store (GROUP_ROWS = None, whatever a session's --fused-options geometry): fp32 chunks on
    the Triton backend then hold their dlogits over their logits in chunks of the rows the budget gives
    (`budget_for`), whatever LOGITS_ROWS, since an fp32 store row costs what the logits row it would free does. For
    the tests whose launches, GEMMs, pre-passes and host order are those of that plan (with a cap, a LOGITS_ROWS
    under their chunks' rows takes the store: test_capped_groups_give_the_uncapped_gradients has those)."""
    monkeypatch.setattr(chunked, "GROUP_ROWS", None)


def fused_and_logits_path(batch, tensors, backend, rows, batch_invariant=False, workspace_bytes=None, **options):
    """((fused LossOutput, grads), (logits-path LossOutput, grads)) with chunks of `rows` rows (or the workspace
    `workspace_bytes`)."""
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    ours = leaves(*tensors)
    budget = workspace_bytes or budget_for(rows, tensors[0].dtype, tensors[0].device, backend)
    out = fused_linear_erpo_loss(ours[0], ours[1], *(batch[k] for k in ROW_TENSORS), bias=ours[2], backend=backend,
                                 workspace_bytes=budget, batch_invariant=batch_invariant, **inputs, **options)
    out.loss.backward()
    ref = leaves(*(None if t is None else t.float() for t in tensors))  # the exact logits: fp32 from the inputs
    logits = ref[0] @ ref[1].t() if ref[2] is None else torch.addmm(ref[2], ref[0], ref[1].t())
    expected = erpo_loss(logits, *(batch[k] for k in ROW_TENSORS), backend="torch", **inputs, **options)
    expected.loss.backward()
    return (out, [t.grad for t in ours if t is not None]), (expected, [t.grad for t in ref if t is not None])


def assert_same_loss(ours, expected, dtype=torch.float32):
    (out, grads), (want, want_grads) = ours, expected
    torch.testing.assert_close(out.loss, want.loss.detach(), rtol=1e-5, atol=1e-5, equal_nan=True)
    for name in ("token_logp", "query_logp", "response_logp", "entropy"):
        torch.testing.assert_close(getattr(out, name), getattr(want, name), rtol=1e-5, atol=5e-5, equal_nan=True)
    assert set(out.metrics) == set(want.metrics)
    for name, value in want.metrics.items():
        torch.testing.assert_close(out.metrics[name].float(), value.float(), rtol=1e-5, atol=1e-5, equal_nan=True)
    for got, wanted in zip(grads, want_grads):
        assert got.dtype == dtype
        scale = wanted.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(got.float() / scale, wanted.float() / scale, **TOLERANCE[dtype])


# Samples of 4 to 13 rows (query and response rows), some without query or without response rows.
SAMPLES = [(3, 5), (0, 4), (6, 7), (2, 0), (1, 2), (4, 9), (0, 6), (0, 3), (2, 2)]
# The host-order and host-layout tests' batch: 28 rows in 3 samples; chunks of 10 rows keep every query and response
# set whole, chunks of 6 split sample 2's 7 response rows (a pre-pass).
ORDER_SAMPLES = SAMPLES[:3]


def option_id(options):
    return ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in options.items()) or "default"


def gather_with_a_higher_set(entropies):
    """A top_entropy_gather standing in for other processes: this call's entropies and the same plus 1 nat (the
    pool's quantile is then not this call's)."""
    return torch.cat((entropies, entropies + 1.0))


@pytest.mark.parametrize("options", OPTION_CASES, ids=option_id)
def test_every_option_with_many_chunks_torch(options, device):
    """Chunks of 6 rows: most samples whole in a chunk, the longer ones (13 rows) split (their coupled rows come
    from the pre-pass)."""
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.float32, device)
    assert_same_loss(*fused_and_logits_path(batch, tensors, "torch", rows=6, **options))


TRITON_CASES = [{}, {"ratio_level": "sequence"}, {"pg_objective": "vespo"}, {"off_policy_mask_threshold": 0.1},
                {"top_entropy_quantile": 0.4, "entropy_coef": 0.05, "entropy_agg": "token-mean"},
                {"loss_agg": "seq-mean-token-mean", "qkl_coef": 0.5}, {"qkl_estimator": "k3-token", "qkl_coef": 0.5},
                {"temperature": 0.7, "logit_softcap": 3.0, "entropy_coef": 0.1},
                {"ratio_level": "sequence", "pg_objective": "sapo", "off_policy_mask_threshold": 0.05,
                 "policy_kl_coef": 0.1, "policy_kl_bias_correction": True, "loss_agg": "seq-mean-token-mean"},
                {"top_entropy_quantile": 0.5, "top_entropy_gather": gather_with_a_higher_set, "entropy_coef": 0.05,
                 "entropy_agg": "token-mean", "ratio_level": "sequence"},
                {"top_entropy_quantile": 0.6, "pg_objective": "vespo", "loss_agg": "seq-mean-token-sum",
                 "num_seqs": 7}]


@pytest.mark.parametrize("options", TRITON_CASES, ids=option_id)
@pytest.mark.parametrize("layout", ["packed", "interleaved"])
def test_options_with_many_chunks_triton(options, layout, device):
    batch = packed_batch(SAMPLES, device) if layout == "packed" else interleaved_batch(device)
    tensors = linear(len(batch["targets"]), torch.float32, device)
    assert_same_loss(*fused_and_logits_path(batch, tensors, "triton", rows=5, **options))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_with_many_chunks(backend, device, grad_hidden_fp32):
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.bfloat16, device)
    options = dict(qkl_coef=0.5, loss_agg="seq-mean-token-mean", entropy_coef=0.05)
    assert_same_loss(*fused_and_logits_path(batch, tensors, backend, rows=7, **options), dtype=torch.bfloat16)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_response_and_query_sample_counts_stay_apart(loss_agg, device):
    """num_seqs=None: the policy term divides by the samples with response rows, the Query-KL by those with query
    rows. Here they differ (8 and 6: 3 samples lack query rows, 1 lacks response rows) and no chunk holds all of
    either."""
    batch = packed_batch(SAMPLES, device)
    kind, sample = batch["token_kind"], batch["sample_index"]
    with_response = {int(s) for s in sample[kind == 2]}
    with_query = {int(s) for s in sample[kind == 1]}
    assert (len(with_response), len(with_query)) == (8, 6)
    tensors = linear(len(kind), torch.float32, device)
    ours, expected = fused_and_logits_path(batch, tensors, "torch", rows=4, loss_agg=loss_agg, qkl_coef=0.7)
    assert_same_loss(ours, expected)


@pytest.mark.parametrize("dtype, fp32", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16-dhidden-fp32"])
def test_nonfinite_padding_row_does_not_poison_the_gradients(dtype, fp32, monkeypatch, device):
    """A padding row of NaN hidden state in a chunk of several: exact-zero d hidden there, d weight finite and equal
    to the one with that row zeroed (d hidden's GEMM, in hidden's dtype or in fp32 with GRAD_HIDDEN_FP32, does not
    read its output's old contents)."""
    monkeypatch.setattr(chunked, "GRAD_HIDDEN_FP32", fp32)
    batch = packed_batch(SAMPLES[:3], device)
    hidden, weight, bias = linear(len(batch["targets"]), dtype, device)
    padding = int((batch["token_kind"] == 0).nonzero()[1])  # row 13, the last of the chunk of rows 9 to 13
    results = []
    for filler in (0.0, float("nan")):
        h = hidden.clone()
        h[padding] = filler
        (out, grads), _ = fused_and_logits_path(batch, (h, weight, bias), "triton", rows=6)
        assert torch.isfinite(out.loss)
        results.append(grads)
    for clean, got in zip(*results):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, clean, rtol=0, atol=0)
    assert torch.all(results[1][0][padding] == 0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype,hidden_dim", [(torch.float32, 24), (torch.bfloat16, 1030)])
def test_gradient_rows_are_the_hidden_rows_receiving_a_gradient(backend, dtype, hidden_dim, device):
    """d weight's operand (`RowKernels.gradient_rows_into`) is torch.where(rows_receiving_gradient, hidden, 0.0) bit
    for bit: rows with an ignored target and only a logp gradient, zero gradients or a NaN hidden row become +0.0, a
    NaN gradient keeps its row; D over one program's columns (1030) included. Written into a slice of a wider
    buffer, the rest left as it was."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(8, hidden_dim, generator=g).to(device, dtype)
    hidden[1] = float("nan")
    targets = torch.tensor([5, -100, 7, -100, 2, 9, 4, 1], device=device)
    grad_logp = torch.tensor([0.5, 0.3, 0.0, 0.0, -1.0, float("nan"), 0.0, 2.0], device=device)
    grad_entropy = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0], device=device)
    buffer = torch.full((10, hidden_dim), 7.0, dtype=dtype, device=device)
    chunked.ROW_KERNELS[backend].gradient_rows_into(buffer[1:9], hidden, targets, grad_logp, grad_entropy)
    receives = torch.tensor([True, False, False, True, True, True, False, True], device=device)
    expected = torch.where(receives.unsqueeze(1), hidden, 0.0)
    assert torch.equal(buffer[1:9], expected) and not torch.signbit(buffer[1:9][~receives]).any()
    assert torch.all(buffer[0] == 7) and torch.all(buffer[9] == 7)


def plan(batch, rows, **needs):
    flags = {**dict(query_sums=False, response_values=False, all_response_entropies=False), **needs}
    return chunked.plan_chunks(batch["token_kind"].cpu().numpy(), batch["sample_index"].cpu().numpy(),
                               len(batch["advantages"]), rows, **flags)


def test_plan_keeps_coupled_rows_together_and_splits_only_long_sets(device):
    # rows: queries 0-1, responses 2-4 | 6, 7 | 9-12, 13-18 | 20, 21-22 (each sample followed by a pad row)
    batch = packed_batch([(2, 3), (1, 1), (4, 6), (1, 2)], device)
    both = plan(batch, 8, query_sums=True, response_values=True)
    # from 8 the last cut that splits no sample's query rows nor its response rows is 13: sample 2's query rows
    # and its response rows lie in different chunks, at no cost
    assert both.chunks == [(0, 8), (8, 13), (13, 21), (21, 24)] and both.prepass_rows.size == 0
    # 4 rows: sample 2's 6 response rows are split (pre-passed), its query rows are not
    short = plan(batch, 4, query_sums=True, response_values=True)
    assert short.chunks == [(0, 2), (2, 6), (6, 9), (9, 13), (13, 17), (17, 21), (21, 24)]
    assert short.prepass_rows.tolist() == list(range(13, 19))
    queries = plan(batch, 4, query_sums=True)  # only query rows couple: sample 2's 4 are split at 12
    assert queries.chunks == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24)]
    assert queries.prepass_rows.tolist() == [9, 10, 11, 12]
    assert plan(batch, 8).chunks == [(0, 8), (8, 16), (16, 24)]  # nothing couples: chunks of the budget
    assert plan(batch, 8).prepass_rows.size == 0
    last_row_apart = plan(packed_batch([(0, 6)], device), 5, response_values=True)  # a cut before the sample's last row
    assert last_row_apart.chunks == [(0, 5), (5, 7)] and last_row_apart.prepass_rows.tolist() == list(range(6))
    kind = batch["token_kind"].cpu().numpy()
    everything = plan(batch, 100, all_response_entropies=True)
    assert everything.chunks == [(0, 24)] and everything.prepass_rows.tolist() == np.nonzero(kind == 2)[0].tolist()


def test_plan_of_interleaved_rows_cuts_at_the_budget(device):
    batch = interleaved_batch(device)
    result = plan(batch, 7, query_sums=True)
    # the one place no sample's query rows span before row 7 is 4 (sample 3's query rows start there)
    assert result.chunks == [(0, 4)] + [(start, start + 7) for start in range(4, 46, 7)] + [(46, 48)]
    kind, sample = batch["token_kind"].cpu().numpy(), batch["sample_index"].cpu().numpy()
    # samples 2 and 4 have their query rows (44; 34 and 36) in one chunk: only the others' are pre-passed
    assert result.prepass_rows.tolist() == np.nonzero((kind == 1) & np.isin(sample, [0, 1, 3]))[0].tolist()


class Recorder(TorchDispatchMode):
    """Per op: the matmul FLOPs (2 m n k) and the live bytes of every 2-D tensor the ops create apart from
    `exempt_shapes` (the gradients [N, D] and [V, D], the objective's per-sample partials [S, NUM_PARTIALS] and the
    samples' spans [2, S], which `loss_gradients` finds itself when its caller does not give them): the
    peak_workspace, the chunk buffers and temporaries; `launches` counts the row kernels' calls (`counted`)."""

    MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm}

    def __init__(self, exempt_shapes):
        super().__init__()
        self.flops = 0
        self.logits_gemm_rows = []
        self.group_rows = []  # rows of each d hidden GEMM (dlogits [G, V] @ W): one per group
        self.launches = {"forward": 0, "backward": 0}
        self.exempt = {tuple(s) for s in exempt_shapes}
        self.live = self.peak_workspace = self.largest_rows = 0

    def _release(self, nbytes):
        self.live -= nbytes

    def matmul(self, rows, inner, columns):
        """Count one GEMM [rows, inner] @ [inner, columns]."""
        self.flops += 2 * rows * inner * columns
        if columns == VOCAB:
            self.logits_gemm_rows.append(rows)
        if inner == VOCAB and columns == HIDDEN_DIM:
            self.group_rows.append(rows)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in self.MATMULS or packet in (torch.ops.aten.addmm_,):
            a, b = (args[0], args[1]) if packet is torch.ops.aten.mm else (args[1], args[2])
            self.matmul(a.shape[0], a.shape[1], b.shape[1])
        result = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            for t in torch.utils._pytree.tree_leaves(result):
                if isinstance(t, torch.Tensor) and t.dim() == 2 and tuple(t.shape) not in self.exempt:
                    nbytes = t.numel() * t.element_size()
                    self.live += nbytes
                    self.peak_workspace = max(self.peak_workspace, self.live)
                    self.largest_rows = max(self.largest_rows, t.shape[0] if t.shape[1] == VOCAB else 0)
                    weakref.finalize(t, self._release, nbytes)
        return result


def counted(kernels, launches):
    """`kernels` with each call of its backward counted in launches["backward"]."""
    def call(*args):
        launches["backward"] += 1
        return kernels.backward_into(*args)

    return dataclasses.replace(kernels, backward_into=call)


@contextlib.contextmanager
def row_passes_and_triton_gemms_recorded(recorder):
    """Each forward row pass (`LogitsBuffer.row_values`: the backend's forward row kernel, or the epilogue's merge)
    counted in recorder.launches["forward"], and each of the epilogue's Triton logits GEMMs (EPILOGUE_ROW_PASS),
    which no dispatch mode sees, recorded as the aten GEMMs are (`Recorder.matmul`)."""
    row_values, logits_gemm = chunked.LogitsBuffer.row_values, triton_logits_gemm.logits_gemm

    def counted_row_values(buffer, *args):
        recorder.launches["forward"] += 1
        return row_values(buffer, *args)

    def recorded_gemm(hidden, weight, *args, **kwargs):
        recorder.matmul(hidden.shape[0], hidden.shape[1], weight.shape[0])
        return logits_gemm(hidden, weight, *args, **kwargs)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(chunked.LogitsBuffer, "row_values", counted_row_values)
        monkeypatch.setattr(triton_logits_gemm, "logits_gemm", recorded_gemm)
        yield


def record(batch, tensors, rows, backend="triton", needs=(True, True), batch_invariant=False, budget=None,
           **options):
    """Run the chunk pass itself (inside the op a dispatch mode sees nothing) under a Recorder with chunks of `rows`
    rows (or the workspace `budget`); needs: d hidden, d weight (d bias with a bias)."""
    hidden, weight, bias = tensors
    needs = (*needs, bias is not None)
    opts = LossOptions(**options)
    inputs = LossInputs(**{k: v for k, v in batch.items() if k not in ROW_TENSORS})
    num_samples = len(batch["advantages"])
    recorder = Recorder([hidden.shape, weight.shape, (num_samples, NUM_PARTIALS), (2, num_samples)])
    with recorder, row_passes_and_triton_gemms_recorded(recorder):
        chunked.loss_gradients(hidden, weight, bias, *(batch[k] for k in ROW_TENSORS), inputs, opts,
                               counted(chunked.ROW_KERNELS[backend], recorder.launches),
                               segment_sum_of(backend == "triton"),
                               budget or budget_for(rows, hidden.dtype, hidden.device, backend), needs,
                               batch_invariant)
    return recorder


@pytest.mark.usefixtures("dlogits_over_logits")
def test_flops_are_6ndv_plus_the_prepass(device):
    batch = packed_batch([(2, 3), (1, 1), (4, 6), (1, 2)], device)
    tensors = linear(len(batch["targets"]), torch.float32, device)
    n, d, v = len(batch["targets"]), HIDDEN_DIM, VOCAB
    assert record(batch, tensors, rows=12).flops == 6 * n * d * v  # every sample whole in a chunk: no pre-pass
    # 8 rows: the 10-row sample split between its query and its response rows, which costs nothing
    assert record(batch, tensors, rows=8).flops == 6 * n * d * v
    # its 4 query rows split: pre-passed (the Query-KL reads their sum), and the first 2 rows (half a chunk), whose
    # logits were formed while the host planned, formed again after the pre-pass
    split = record(batch, tensors, rows=4)
    assert plan(batch, 4, query_sums=True).prepass_rows.tolist() == [9, 10, 11, 12]
    assert split.flops == 6 * n * d * v + 2 * (4 + 2) * d * v
    no_qkl = record(batch, tensors, rows=4, qkl_coef=0.0)  # nothing couples rows across chunks
    assert no_qkl.flops == 6 * n * d * v
    assert record(batch, tensors, rows=4, needs=(True, False)).flops == 4 * n * d * v + 2 * (4 + 2) * d * v


@pytest.mark.parametrize("backend,dtype", [("triton", torch.float32), ("triton", torch.bfloat16),
                                           ("torch", torch.bfloat16)], ids=str)
def test_workspace_stays_under_the_budget(backend, dtype, device):
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), dtype, device)
    rows = 6
    recorder = record(batch, tensors, rows=rows, backend=backend, entropy_coef=0.1)
    budget = budget_for(rows, dtype, device, backend)
    kernels = chunked.ROW_KERNELS[backend]
    workspace = chunked.workspace_of(len(batch["targets"]), *tensors[:2], kernels, budget, False,
                                     chunked.epilogue_row_pass(kernels))
    # the chunk buffer, or the dlogits store where a session's --fused-options geometry takes one (never N rows: N =
    # 67); chunks of `rows` rows with the library's geometry
    assert recorder.largest_rows == max(workspace.chunk_rows, workspace.group_rows)
    assert 0.5 * budget < recorder.peak_workspace <= budget


def test_workspace_gives_the_most_rows_per_d_weight_accumulation(monkeypatch):
    """Qwen2.5-7B's lm_head (V = 152064, D = 3584), bf16 on CUDA, N = 16384, chunks of 512 rows without a cap on the
    store (LOGITS_ROWS, GROUP_ROWS set here, whatever a session's --fused-options): 1 GiB holds 1744 rows with the
    dlogits over the logits, but chunks of 512 rows beside a bf16 store of 4 chunks, 2048 rows per d weight
    accumulation (8 instead of 10 passes over the fp32 [V, D] accumulator); 2 GiB, 11 chunks (erpo-ws2g in the
    bench); 4 GiB, 24 chunks. fp32 dlogits cost what their logits do: over them. A budget that holds every row: one
    chunk. batch_invariant: chunks of a multiple of 256 rows."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 512)
    monkeypatch.setattr(chunked, "GROUP_ROWS", None)

    def workspace(gib, dtype=torch.bfloat16, rows=16384, batch_invariant=False):
        return chunked.plan_workspace(rows, 3584, 152064, dtype, torch.device("cuda"), chunked.ROW_KERNELS["triton"],
                                      int(gib * 2**30), batch_invariant)

    assert workspace(1) == chunked.Workspace(512, 2048, True)
    assert workspace(2) == chunked.Workspace(512, 5632, True)
    assert workspace(4) == chunked.Workspace(512, 12288, True)
    assert workspace(1, torch.float32) == chunked.Workspace(1724, 1724, False)
    assert workspace(1, rows=1000) == chunked.Workspace(1000, 1000, False)
    assert workspace(0.001, batch_invariant=True) == chunked.Workspace(256, 256, False)  # 1 row's budget


def test_group_rows_cap_gives_that_group_in_whole_chunks(monkeypatch):
    """GROUP_ROWS (bench.fused_probe's knob) caps the store's rows, rounded down to whole chunks, and takes the store
    whenever it holds a chunk: in 1 GiB (Qwen2.5-7B, bf16, N = 16384) 2304 rows beside 256- and 384-row chunks,
    1536 beside 512-row chunks although the dlogits over the logits would hold 1744; a cap above the budget's group
    leaves the budget's; a cap under one chunk leaves the plan without it."""
    def workspace(chunk_rows, cap, gib=1):
        monkeypatch.setattr(chunked, "LOGITS_ROWS", chunk_rows)
        monkeypatch.setattr(chunked, "GROUP_ROWS", cap)
        return chunked.plan_workspace(16384, 3584, 152064, torch.bfloat16, torch.device("cuda"),
                                      chunked.ROW_KERNELS["triton"], int(gib * 2**30), False)

    assert workspace(256, 2304) == chunked.Workspace(256, 2304, True)
    assert workspace(384, 2304) == chunked.Workspace(384, 2304, True)
    assert workspace(512, 1536) == chunked.Workspace(512, 1536, True)
    assert workspace(512, 2000) == chunked.Workspace(512, 1536, True)  # whole chunks
    assert workspace(512, 4096) == chunked.Workspace(512, 2048, True)  # the budget's group
    assert workspace(2048, 1536) == chunked.Workspace(1744, 1744, False)  # no chunk fits under the cap
    assert workspace(512, None) == chunked.Workspace(512, 2048, True)  # the library's


def test_capped_groups_give_the_uncapped_gradients(monkeypatch, device):
    """bf16, chunks of 4 rows, the store capped at 12 rows (GROUP_ROWS) in a budget that holds 16: every d hidden
    GEMM serves at most 12 rows, and the loss and gradients are those of the uncapped groups (d weight summed in
    fp32 in another order: a few bf16 ulps)."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 4)
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.bfloat16, device)
    budget = budget_for_groups(4, 16, torch.bfloat16, device)
    options = dict(qkl_coef=0.5, loss_agg="seq-mean-token-mean", entropy_coef=0.05)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    results = []
    for cap in (None, 12):
        monkeypatch.setattr(chunked, "GROUP_ROWS", cap)
        recorder = record(batch, tensors, rows=4, budget=budget, **options)
        assert max(recorder.group_rows) == (16 if cap is None else 12)
        assert sum(recorder.group_rows) == len(batch["targets"])
        ours = leaves(*tensors)
        out = fused_linear_erpo_loss(ours[0], ours[1], *(batch[k] for k in ROW_TENSORS), bias=ours[2],
                                     workspace_bytes=budget, **inputs, **options)
        out.loss.backward()
        results.append([out.loss.detach(), *(t.grad for t in ours)])
    for uncapped, capped in zip(*results):
        torch.testing.assert_close(capped, uncapped, rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dlogits_store_groups_chunks_with_the_same_gradients(backend, monkeypatch, device):
    """bf16, chunks of 4 rows beside a store of 16: the d hidden and d weight GEMMs run once per group of 4 chunks,
    the workspace stays in its budget, and the loss and gradients are the logits path's, and those of the same
    chunks with their dlogits over their logits (d weight summed in fp32 in another order: a few bf16 ulps)."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 4)
    monkeypatch.setattr(chunked, "GROUP_ROWS", None)  # the store the budget holds, whatever the session's cap
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.bfloat16, device)
    budget = budget_for_groups(4, 16, torch.bfloat16, device, backend)
    workspace = chunked.plan_workspace(len(batch["targets"]), HIDDEN_DIM, VOCAB, torch.bfloat16, device,
                                       chunked.ROW_KERNELS[backend], budget, False)
    assert workspace == chunked.Workspace(4, 16, True)
    options = dict(qkl_coef=0.5, loss_agg="seq-mean-token-mean", entropy_coef=0.05)
    recorder = record(batch, tensors, rows=4, backend=backend, budget=budget, **options)
    chunks = plan(batch, 4, query_sums=True).chunks
    assert max(recorder.logits_gemm_rows) == 4 and max(recorder.group_rows) == 16
    assert sum(recorder.group_rows) == len(batch["targets"]) and len(recorder.group_rows) < len(chunks) / 3
    assert 0.5 * budget < recorder.peak_workspace <= budget
    grouped, expected = fused_and_logits_path(batch, tensors, backend, rows=4, workspace_bytes=budget, **options)
    assert_same_loss(grouped, expected, dtype=torch.bfloat16)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    alone = leaves(*tensors)  # the same chunks with their dlogits over their logits
    fused_linear_erpo_loss(alone[0], alone[1], *(batch[k] for k in ROW_TENSORS), bias=alone[2], backend=backend,
                           workspace_bytes=budget_for(4, torch.bfloat16, device, backend), **inputs,
                           **options).loss.backward()
    for got, want in zip(grouped[1], alone):
        torch.testing.assert_close(got, want.grad, rtol=1e-2, atol=1e-5)


@pytest.mark.usefixtures("dlogits_over_logits")
def test_two_row_pass_launches_and_three_gemms_per_chunk(device):
    batch = packed_batch([(2, 3), (1, 1), (4, 6), (1, 2)], device)
    tensors = linear(len(batch["targets"]), torch.float32, device, bias=False)
    recorder = record(batch, tensors, rows=12, qkl_coef=0.0)
    n, d, v = len(batch["targets"]), HIDDEN_DIM, VOCAB
    chunks = len(plan(batch, 12).chunks)
    assert recorder.launches == {"forward": chunks, "backward": chunks}
    assert recorder.flops == 6 * n * d * v


@pytest.mark.usefixtures("dlogits_over_logits")
def test_triton_chunks_cost_a_constant_plus_a_few_launches_each(device):
    """Launches per fwd+bwd (validate=False, LaunchCounter) at 1, 2 and 4 chunks of whole samples: a + b x chunks
    exactly, b small (the logits GEMM, the two row kernels writing straight into the call's vectors, the hidden rows
    d weight reads, d hidden, d weight and d bias, and the objective's gradient in two launches: its sample kernel
    on the chunk's samples, its gradient kernel on the chunk's rows), one host sync
    (the chunk plan reads token_kind and sample_index together; the layout goes back without a wait). a is the
    device's own: on CUDA one more, the copy of the plan's read into pinned memory."""
    batch = packed_batch([(1, 2)] * 4, device)  # 4 samples of 4 rows (the last a padding row)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    counts, names = {}, {}
    for rows in (16, 8, 4):
        hidden, weight, bias = leaves(*linear(16, torch.float32, device))
        with LaunchCounter() as counter:
            fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                                   validate=False, workspace_bytes=budget_for(rows, torch.float32, device),
                                   qkl_coef=0.5, ratio_level="sequence", **inputs).loss.backward()
        chunks = 16 // rows
        # the chunk plan's one read of the layout (on CUDA a wait for its copy to pinned memory)
        assert counter.syncs == 1 and set(counter.sync_names) <= {"Tensor.cpu", "event.synchronize"}
        # once over every sample for the global factors, once per chunk on its samples, once for the value
        assert counter.names["triton._objective_sample_kernel"] == 2 + chunks
        assert counter.names["triton._objective_grad_kernel"] == chunks
        counts[chunks], names[chunks] = counter.launches, counter.names
    per_chunk = counts[2] - counts[1]
    constant = counts[1] - per_chunk
    assert all(launches == constant + per_chunk * chunks for chunks, launches in counts.items()), counts
    # per chunk (its own group here: fp32 dlogits over the logits) 6 + 4: the logits GEMM, the two row kernels, the
    # objective's two, d weight's hidden rows; d hidden, d weight, d bias's column sum and its addition (the first
    # group writes d bias: its addition is one of the constant's)
    # per call 13 (26 before 2026-11-26: the backward filled zeros for the op's five outputs that take no gradient,
    # and the scored targets' mask and `where` and the objective's own spans kernel are now the spans kernel's one
    # pass; bf16 / fp16 inputs also save d weight's and d bias's rounding in the forward, now in the backward's
    # scale passes; 18 before branch fusedsetup: one launch zero-fills logp, entropy and the anchor instead of three
    # aten fills, d bias is written by its first group instead of filled, d loss / d loss is the gradient kernel's
    # constant instead of an aten `ones`). On CUDA 14 (the H100 run of 2026-11-26, torch 2.11, commit b8b4a78): one
    # more, the copy of the plan's read into pinned memory (`validation.read_later`'s copy_, a launch there; on the CPU
    # the read takes the tensor itself). The chunk layout's upload (`common.host_to_device`) is in both counts alike:
    # with the caller's layout, which spares the read but not that upload, that run counted 82 launches, as the CPU
    # does (torch 2.13; test_a_host_layout_spares_the_chunk_plan_its_read)
    assert per_chunk <= 10 and constant <= (14 if device.type == "cuda" else 13), (constant, per_chunk, names[1])


@pytest.mark.parametrize("dtype, validate, bias", [(torch.bfloat16, True, False), (torch.float32, False, True)],
                         ids=["bf16-validate", "fp32-bias-no-validate"])
@pytest.mark.usefixtures("dlogits_over_logits")
def test_a_fwd_bwd_makes_no_fill_and_no_constant_tensor(dtype, validate, bias, device):
    """The small launches the op once made every call are gone (LaunchCounter's names over one fwd+bwd): the zeros of
    logp, entropy and the anchor are one Triton launch (`triton_fill`), d bias is written by its first group, not
    filled, and d loss / d loss is the gradient kernel's constant 1, not an aten `ones`. What aten launches remain:
    the value checks' buffer (`full`), the read's copy (`cat`), the GEMMs, d bias's column sums and additions, the
    loss's addition of the anchor and autograd's seed (`ones_like`, loss.backward()'s); on CUDA also the copies to
    and from host memory (the layout's upload, the read's copy), which the CPU makes without a launch."""
    batch = packed_batch([(1, 2)] * 8, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    hidden, weight, b = leaves(*linear(32, dtype, device, bias=bias))
    with LaunchCounter() as counter:
        fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=b, backend="triton",
                               validate=validate, workspace_bytes=budget_for(8, dtype, device), qkl_coef=0.5,
                               **inputs).loss.backward()
    aten = {name.removeprefix("aten.") for name in counter.names if name.startswith("aten.")}
    gemms = {"mm", "addmm", "addmm_"}
    copies = {"_to_copy", "copy_"} if device.type == "cuda" else set()
    assert aten <= {"full", "cat", "add", "ones_like", *gemms, *copies, *({"sum", "add_"} if bias else ())}, \
        counter.names
    assert counter.names["triton._zero_kernel"] == 1
    assert counter.names["aten.add"] == 1 and counter.names["aten.add_"] == (3 if bias else 0)  # 4 chunks, 4 groups
    assert torch.isfinite(hidden.grad).all() and (b is None or torch.isfinite(b.grad).all())


def test_triton_groups_cost_a_few_launches_each(monkeypatch, device):
    """bf16, 8 chunks of 4 rows with their dlogits in a store of 32, 16 or 12 rows (the last group 8), or over their
    logits: launches per fwd+bwd are a + c x groups exactly, c small (the d hidden GEMM, the d weight GEMM and d
    bias: the hidden rows that d weight reads are written chunk by chunk), one host sync."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 4)
    monkeypatch.setattr(chunked, "GROUP_ROWS", None)  # the stores the budgets hold, whatever the session's cap
    batch = packed_batch([(1, 2)] * 8, device)  # 8 samples of 4 rows (the last a padding row)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    counts = {}
    for groups, budget in ((1, budget_for_groups(4, 32, torch.bfloat16, device)),
                           (3, budget_for_groups(4, 12, torch.bfloat16, device)),
                           (2, budget_for_groups(4, 16, torch.bfloat16, device)),
                           (8, budget_for(4, torch.bfloat16, device))):
        hidden, weight, bias = leaves(*linear(32, torch.bfloat16, device))
        with LaunchCounter() as counter:
            fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                                   validate=False, workspace_bytes=budget, qkl_coef=0.5, **inputs).loss.backward()
        assert counter.syncs == 1 and set(counter.sync_names) <= {"Tensor.cpu", "event.synchronize"}
        assert counter.names["triton._objective_grad_kernel"] == 8  # one per chunk, whatever the groups
        counts[groups] = counter.launches
    per_group = counts[2] - counts[1]
    assert all(launches == counts[1] + per_group * (groups - 1) for groups, launches in counts.items()), counts
    assert 0 < per_group <= 4, per_group  # d hidden, d weight, d bias's column sum and its addition


def test_fp32_dhidden_keeps_the_calls_launches_and_host_reads(monkeypatch, device):
    """GRAD_HIDDEN_FP32 changes what d hidden's GEMM writes, not what a fwd+bwd launches or reads (LaunchCounter,
    validate=False): bf16, 8 chunks of 4 rows in 2 groups of 16 rows, the same launches by name both ways (d hidden's
    GEMM is aten's addmm, counted with the `addmm_` of the CPU's fp32 path: on CUDA the fp32 output is cuBLAS's own,
    `out_dtype`, and the CPU's copies of its operands to fp32, `fused_linear_loss.cpu_fp32_operand`, which CUDA does
    not make, the counter leaves out; the bf16 bias's cast to fp32, CUDA's too, it counts: once per call, not once for
    each of the 9 logits GEMMs), one `_scale_kernel` pass per gradient and the call's one host read."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 4)
    batch = packed_batch([(1, 2)] * 8, device)  # 8 samples of 4 rows (the last a padding row)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    counts = []
    for fp32 in (False, True):
        monkeypatch.setattr(chunked, "GRAD_HIDDEN_FP32", fp32)
        hidden, weight, bias = leaves(*linear(32, torch.bfloat16, device))
        with LaunchCounter() as counter:
            fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                                   validate=False, workspace_bytes=budget_for_groups(4, 16, torch.bfloat16, device),
                                   qkl_coef=0.5, **inputs).loss.backward()
        assert hidden.grad.dtype == torch.bfloat16 and counter.names["triton._scale_kernel"] == 3
        # the bias's cast: one for the call's 9 logits GEMMs (the first chunk's in halves, one a chunk after), made
        # with its logits buffer (none where the epilogue's GEMM, with EPILOGUE_ROW_PASS, reads the bias as it is)
        assert counter.names.get("aten.to", 0) == (0 if chunked.EPILOGUE_ROW_PASS else 1)
        gemms = counter.names.pop("aten.addmm_", 0)
        counter.names["aten.addmm"] += gemms
        counts.append((dict(counter.names), dict(counter.sync_names)))
    assert counts[0] == counts[1], counts
    assert sum(counts[0][1].values()) == 1


def host_layout_of(batch):
    """[2, N] int64 host copy of the batch's token_kind and sample_index (what a caller passes as host_layout)."""
    return torch.stack((batch["token_kind"], batch["sample_index"])).long().cpu()


@pytest.mark.parametrize("validate", [False, True])
def test_a_host_layout_spares_the_chunk_plan_its_read(validate, device):
    """fused_linear_erpo_loss(host_layout=...) plans its chunks on the caller's host copy of token_kind and
    sample_index: the same loss, per-row values and gradients bit for bit, with samples split by chunks (a pre-pass)
    as with whole ones. Host reads per fwd+bwd: without it one, the rows' layout read by the op (with validate=True
    together with the value checks' code); with it none with validate=False, and with True the checks' one, where
    the copy is checked against the rows. Launches: with validate=False the read's fewer, 1 on the CPU (the
    concatenation of the rows for it) and 2 on CUDA (its copy into pinned memory too); with True 6 more (the copy's
    comparison with the rows, and its place in the read), on CUDA perhaps 7 (its upload)."""
    batch = packed_batch(ORDER_SAMPLES, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    results = []
    for host_layout in (None, host_layout_of(batch)):
        hidden, weight, bias = leaves(*linear(len(batch["targets"]), torch.float32, device))
        with LaunchCounter() as counter:
            if host_layout is not None:
                counter.host_memory(host_layout)  # on the CPU, else taken for a device tensor
            out = fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias,
                                         backend="triton", validate=validate, host_layout=host_layout,
                                         workspace_bytes=budget_for(6, torch.float32, device), qkl_coef=0.5,
                                         ratio_level="sequence", **inputs)
            out.loss.backward()
        results.append((counter.syncs, counter.launches, out.loss, out.token_logp, hidden.grad, weight.grad,
                        bias.grad))
    (reads, launches, *without), (reads_with, launches_with, *given) = results
    assert (reads, reads_with) == (1, int(validate))
    # on CUDA (the H100 run of 2026-11-26, torch 2.11, commit b8b4a78) 82 - 84 with validate=False: the read's
    # concatenation and its copy into pinned memory (`validation.read_later`'s copy_, a launch there); with True the
    # checks' code is read either way (its copy in both counts) and the copy's upload is one launch more on CUDA, or
    # none as the chunk layout's upload seems to be there (test_triton_chunks_cost_a_constant_plus_a_few_launches_each)
    cuda = device.type == "cuda"
    expected = ({6, 7} if cuda else {6}) if validate else ({-2} if cuda else {-1})
    assert launches_with - launches in expected, (launches_with, launches)
    assert all(torch.equal(a, b) for a, b in zip(without, given))


def test_a_host_layout_that_disagrees_with_the_rows_is_refused_with_validate(device):
    """With validate=True a host_layout whose token_kind or sample_index differs from the rows' raises, naming the
    first row that differs, before the loss is returned."""
    batch = packed_batch(SAMPLES, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    hidden, weight, bias = linear(len(batch["targets"]), torch.float32, device)
    for row, value in ((0, 2), (5, 1)):  # row 0's kind (1 -> 2); row 5's sample (0 -> 1)
        stale = host_layout_of(batch)
        stale[int(row == 5), row] = value
        with pytest.raises(ValueError, match=rf"^host_layout disagrees with the rows at row {row}: "):
            fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                                   host_layout=stale, **inputs)


def launches_and_read(batch, rows, host_layout=None, counter=None, gradients=False, **options):
    """[(kind, name)] of one forward's launches and host reads in order (LaunchCounter.order, or that of `counter`, a
    LaunchCounter), Triton backend, validate=True, chunks of `rows` rows, the Query-KL and the sequence-level ratio;
    gradients: hidden, weight and bias require them (the op forms them in its forward)."""
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    hidden, weight, bias = linear(len(batch["targets"]), torch.float32, batch["targets"].device)
    if gradients:
        hidden, weight, bias = leaves(hidden, weight, bias)
    with counter or LaunchCounter() as counter:
        if host_layout is not None:
            counter.host_memory(host_layout)  # on the CPU, else taken for a device tensor
        fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                               host_layout=host_layout, workspace_bytes=budget_for(rows, torch.float32, hidden.device),
                               qkl_coef=0.5, ratio_level="sequence", **inputs, **options)
    return counter.order


@pytest.mark.parametrize("rows, prepass", [(10, False), (6, True)], ids=["whole-sets", "split-sets"])
@pytest.mark.usefixtures("dlogits_over_logits")
def test_the_op_s_read_waits_after_the_gemms_it_can_queue(rows, prepass, device):
    """validate=True: the op's one host read (the checks' code, with the rows' layout unless the caller holds it)
    waits after the first half chunk's logits GEMM and the objective's global factors (two launches) are queued, and,
    with the caller's host_layout, after the plan's work too: the pre-pass (when a chunk splits a coupled set), the
    rest of the first chunk's logits and its forward row kernel, and the objective's setup on the layout (its
    upload), so that the chunk loop follows the read at once; without it no launch but the plan's comes between the
    read and the chunk loop, the first chunk's forward row kernel last, before the objective's setup. On CUDA the
    read waits for the code's copy alone (`validation.read_later`), not for those GEMMs."""
    batch = packed_batch(ORDER_SAMPLES, device)
    layout = host_layout_of(batch)
    gemm, forward = logits_gemm_launch(), forward_row_launch()
    objective_setup = [("launch", "triton._objective_sample_kernel"), ("launch", "triton._objective_finish_kernel")]
    for host_layout in (None, layout):
        order = launches_and_read(batch, rows, host_layout)
        reads = [i for i, (kind, _) in enumerate(order) if kind == "sync"]
        assert len(reads) == 1, order
        before, after = order[:reads[0]], order[reads[0] + 1:]
        zero_fill = before.index(("launch", "triton._zero_kernel"))
        assert before[zero_fill + 1:zero_fill + 3] == objective_setup, before
        loop = first_chunk_in(after)
        early = before.index(gemm)  # the first half chunk's logits, queued before the read on both ways
        # queued by the plan: per pre-pass piece (when a chunk splits a coupled set) its GEMM and forward row kernel,
        # then the rest of the first chunk's logits and its forward row kernel; with host_layout before the read,
        # else after it
        planned = before[zero_fill + 3:] if host_layout is not None else after[:loop]
        assert planned[-2:] == [gemm, forward], order
        planned = planned[:-1]
        assert (forward in planned) == prepass, order
        assert planned.count(gemm) == 1 + planned.count(forward), order
        assert gemm not in (after[:loop] if host_layout is not None else before[early + 1:]), order
        assert host_layout is None or after[:loop] == [], order


def first_chunk_in(order) -> int:
    """Where the chunk loop begins in `order` (entries after the op's read): the first chunk's objective sample
    kernel (its forward row kernel, without the entropy filter, is the plan's last launch, before the objective's
    setup)."""
    return order.index(("launch", "triton._objective_sample_kernel"))


class AllocationsInOrder(LaunchCounter):
    """A LaunchCounter whose `order` also lists each aten allocation, as ("alloc", name): host work that the GPU
    waits through when it falls between the call's read and its next launch."""

    ALLOCATIONS = ("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name in self.ALLOCATIONS and not self._inside_triton:
            self.order.append(("alloc", f"aten.{name}"))
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("rows, prepass", [(10, False), (6, True)], ids=["whole-sets", "split-sets"])
@pytest.mark.usefixtures("dlogits_over_logits")
def test_the_op_makes_before_its_read_all_that_needs_no_layout(rows, prepass, device):
    """validate=True without host_layout (`python -m bench --paths fused`'s call): what needs no layout is made
    before the op's one host read (the objective's outputs, its [N] gradients and its global factors' two launches,
    the op's gradients: on CUDA host work the GPU waits through once the GEMMs queued run out), so that between the
    read and the first chunk's objective come the plan's GEMMs (with a pre-pass its three vectors too), the groups'
    buffers (after the pre-pass: the workspace budget does not hold its gathered rows beside them) and the first
    chunk's forward row kernel, nothing else."""
    batch = packed_batch(ORDER_SAMPLES, device)
    order = launches_and_read(batch, rows, counter=AllocationsInOrder(), gradients=True)
    read = next(i for i, (kind, _) in enumerate(order) if kind == "sync")
    gemm, forward = logits_gemm_launch(), forward_row_launch()
    objective_setup = [("launch", "triton._objective_sample_kernel"), ("launch", "triton._objective_finish_kernel")]
    before, after = order[:read], order[read + 1:]
    after = after[:first_chunk_in(after)]
    launched = [entry for entry in before if entry[0] == "launch"]
    zero_fill = launched.index(("launch", "triton._zero_kernel"))
    assert launched.index(gemm) < zero_fill and launched[zero_fill + 1:zero_fill + 3] == objective_setup, before
    # after the read: the pre-pass's logp, entropy and lse, then d weight's masked hidden rows (budget_for's plan:
    # the dlogits over the logits, no store), then the host buffer the chunk layout is uploaded from
    prepass_vectors = [("alloc", "aten.empty")] * 3 * prepass
    assert [entry for entry in after if entry[0] == "alloc"] == prepass_vectors + [
        ("alloc", "aten.new_empty"), ("alloc", "aten.empty")], after
    planned = [entry for entry in after if entry[0] == "launch"]  # per pre-pass piece its gathers, GEMM, forward
    assert planned[-2:] == [gemm, forward], after  # the first chunk's rest of logits, then its forward row kernel
    planned = planned[:-1]
    assert planned.count(gemm) == 1 + planned.count(forward), after
    assert (forward in planned) == prepass, after



@pytest.mark.parametrize("rows, prepass", [(10, False), (6, True)], ids=["whole-sets", "split-sets"])
@pytest.mark.usefixtures("dlogits_over_logits")
def test_after_the_read_the_host_works_behind_the_launches_it_does_not_feed(rows, prepass, device, monkeypatch):
    """validate=True without host_layout: between the op's read and the first chunk's objective sample kernel the
    GPU runs only what is queued there, so the host queues the first chunk's logits and forward row kernel before
    its work that feeds neither (the groups' buffers, the chunk layout and its staging buffer), and the layout's
    upload, which the sample kernel reads, is the last thing before that kernel: no launch, allocation or read
    between them (the GPU profile's gaps after the read, bench/RESULTS.md "Host order of the default fused call")."""
    batch = packed_batch(ORDER_SAMPLES, device)
    counter = AllocationsInOrder()
    upload = chunk_objective.host_to_device

    def recorded_upload(host, to):
        counter.order.append(("upload", "chunk layout"))
        return upload(host, to)

    monkeypatch.setattr(chunk_objective, "host_to_device", recorded_upload)
    order = launches_and_read(batch, rows, counter=counter, gradients=True)
    read = next(i for i, (kind, _) in enumerate(order) if kind == "sync")
    after = order[read + 1:]
    after = after[:first_chunk_in(after)]
    gemm, forward = logits_gemm_launch(), forward_row_launch()
    assert after[-5:] == [gemm, forward, ("alloc", "aten.new_empty"), ("alloc", "aten.empty"),
                          ("upload", "chunk layout")], after
    assert after.count(("upload", "chunk layout")) == 1 and (forward in after[:-4]) == prepass, after


@pytest.mark.parametrize("entropy_filter", [False, True], ids=["counts", "entropy-filter"])
@pytest.mark.usefixtures("dlogits_over_logits")
def test_the_global_factors_are_queued_before_the_read_but_with_the_entropy_filter(entropy_filter, device):
    """The Triton chunk objective's global factors (its sample kernel over every sample's span, then the finish
    kernel: once per call) read counts alone. Without the entropy filter they come from token_kind and sample_index
    and are queued before the op's read; with it the kept rows' count comes from the pre-passed response rows'
    entropies, so they follow the read and the pre-pass's forward row kernels, and the first chunk's forward row
    kernel, which would replace some of those entropies, follows them (without the filter the plan queues it before
    the objective's setup). Either way before the first chunk's own sample kernel."""
    options = dict(top_entropy_quantile=0.5, entropy_coef=0.05, entropy_agg="token-mean") if entropy_filter else {}
    order = launches_and_read(packed_batch(ORDER_SAMPLES, device), 10, **options)
    read = next(i for i, (kind, _) in enumerate(order) if kind == "sync")
    sample, finish = ("launch", "triton._objective_sample_kernel"), ("launch", "triton._objective_finish_kernel")
    forward = forward_row_launch()
    factors = order.index(finish)  # the first finish (the objective's value at the end launches another)
    assert order[factors - 1] == sample and order.index(sample) == factors - 1, order
    assert (factors > read) == entropy_filter, order
    assert (forward in order[read:factors]) == entropy_filter, order  # the pre-pass (every response row)
    if entropy_filter:  # per pre-pass piece a GEMM and a forward row kernel, then the first chunk's rest of logits
        gemm = logits_gemm_launch()
        assert order[read:factors].count(gemm) == 1 + order[read:factors].count(forward), order
    # once more per chunk (beside its gradient kernel), once for the objective's value
    assert order.count(sample) == 2 + order.count(("launch", "triton._objective_grad_kernel")), order


def test_the_chunk_objective_finds_the_spans_when_not_given(device):
    """loss_gradients with each sample's span of scored rows given (as the value checks leave them) and without
    (the chunk objective finds them itself, one launch more): the same log-probs, entropies and gradients bit for
    bit."""
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.float32, device)
    inputs = LossInputs(**{k: v for k, v in batch.items() if k not in ROW_TENSORS})
    opts = LossOptions(qkl_coef=0.5, ratio_level="sequence", entropy_coef=0.01)
    spans = sample_spans(batch["sample_index"], len(batch["advantages"]), batch["token_kind"])
    results = [chunked.loss_gradients(*tensors, *(batch[k] for k in ROW_TENSORS), inputs, opts,
                                      chunked.ROW_KERNELS["triton"], segment_sum_of(True),
                                      budget_for(6, torch.float32, device), (True, True, True), spans=given)
               for given in (spans, None)]
    assert all(torch.equal(a, b) for a, b in zip(*results))

BAD_ROWS = [
    ("token_kind", 5, 3, r"^token_kind must be 0, 1 or 2; row 5 holds 3$"),
    ("sample_index", 2, 40, r"^sample_index must lie in \[0, 9\) \(S = len\(advantages\)\) on scored rows; row 2 "
                            r"holds 40$"),
    ("targets", 7, VOCAB, rf"^targets must lie in \[0, {VOCAB}\) on scored rows; row 7 holds {VOCAB}$"),
]


@pytest.mark.parametrize("column, row, value, message", BAD_ROWS)
def test_a_bad_row_is_raised_from_the_op_s_one_read_before_any_plan(column, row, value, message, monkeypatch,
                                                                     device):
    """validate=True on the Triton backend: the value checks' code is read by the op together with the rows' layout
    (one host read, after the first GEMM is queued); a bad row raises that row's own one-line ValueError, chained to
    nothing, before the chunk plan sees the rows (a sample_index of 40 among 9 samples would index past its arrays)."""
    def no_plan(*args, **kwargs):
        raise AssertionError("the chunk plan ran on rows the checks refuse")

    monkeypatch.setattr(chunked, "plan_chunks", no_plan)
    batch = packed_batch(SAMPLES, device)
    batch[column] = batch[column].clone()
    batch[column][row] = value
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    hidden, weight, bias = linear(len(batch["targets"]), torch.float32, device)
    with pytest.raises(ValueError, match=message) as raised:
        fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                               qkl_coef=0.5, **inputs)
    assert raised.value.__context__ is None and raised.value.__cause__ is None


@pytest.mark.parametrize("column, row, value, message", BAD_ROWS, ids=["token_kind", "sample_index", "targets"])
def test_a_bad_row_with_the_caller_s_layout_raises_its_own_error_after_the_plan_s_gemms(column, row, value, message,
                                                                                       monkeypatch, device):
    """With a host_layout that holds the rows as they are, the plan runs before the checks' read when the layout's
    own values allow it (a bad target: the pre-pass's forward row kernels and the first chunk's GEMMs run on it,
    safe on any target), never on a token_kind or sample_index they refuse (it would index past its arrays); either
    way the bad row's own one-line ValueError, chained to nothing, before the loss is returned."""
    plans = []
    plan_chunks = chunked.plan_chunks
    monkeypatch.setattr(chunked, "plan_chunks", lambda *args, **kwargs: plans.append(1) or plan_chunks(*args, **kwargs))
    batch = packed_batch(SAMPLES, device)
    batch[column] = batch[column].clone()
    batch[column][row] = value
    with pytest.raises(ValueError, match=message) as raised:
        launches_and_read(batch, 6, host_layout_of(batch))  # chunks of 6 rows: a pre-pass
    assert raised.value.__context__ is None and raised.value.__cause__ is None
    assert len(plans) == (column == "targets")


def test_a_layout_is_planned_on_only_where_the_value_checks_accept_it():
    """plannable_layout: token_kind in {0, 1, 2}, and sample_index in [0, S) on scored rows (rows of kind 0 may hold
    anything), on the host layout alone."""
    layout = torch.tensor([[1, 2, 0, 1, 2], [0, 0, 1, 2, 2]], device="cpu")  # host memory, as a host layout is
    assert chunked.plannable_layout(layout, 3) and chunked.plannable_layout(
        torch.zeros(2, 0, dtype=torch.int64, device="cpu"), 0)
    assert not chunked.plannable_layout(layout, 2)  # sample 2 on scored rows, S = 2
    for row, kind_or_sample, value, plannable in ((2, 1, -7, True), (2, 1, 9, True), (0, 1, -1, False),
                                                  (4, 1, 3, False), (1, 0, 3, False), (1, 0, -1, False)):
        changed = layout.clone()
        changed[kind_or_sample, row] = value
        assert chunked.plannable_layout(changed, 3) == plannable, (row, kind_or_sample, value)


@pytest.mark.parametrize("host_layout, error, message", [
    (np.zeros((2, 4), dtype=np.int64), TypeError, r"host_layout must be a \[2, N\] int64 CPU tensor .* got ndarray"),
    (torch.zeros(2, 4, dtype=torch.int64, device="meta"), ValueError, r"host_layout must be in host memory .* on meta"),
    (torch.zeros(2, 4, dtype=torch.int32, device="cpu"), TypeError, r"host_layout must be int64, got torch.int32"),
    (torch.zeros(4, 2, dtype=torch.int64, device="cpu"), ValueError,
     r"host_layout must have shape \[2, N\] = \(2, 4\) .* got \(4, 2\)"),
], ids=["numpy", "device", "dtype", "shape"])
def test_a_malformed_host_layout_is_one_line_naming_it(host_layout, error, message, device):
    batch = packed_batch([(1, 2)], device)  # 4 rows
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    hidden, weight, bias = linear(4, torch.float32, device)
    for validate in (False, True):
        with pytest.raises(error, match=message) as raised:
            fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                                   validate=validate, host_layout=host_layout, **inputs)
        assert "\n" not in str(raised.value)


def test_triton_chunk_gradient_takes_no_autograd(monkeypatch, device):
    """The Triton backend forms each chunk's d loss / d logp and d loss / d H with the objective's kernels: no
    autograd.grad inside the op (under a TorchDispatchMode on CUDA it fails: PythonFallbackKernel's tls_on_entry
    assert)."""
    def no_grad_taken(*args, **kwargs):
        raise AssertionError("autograd.grad called inside the fused-linear op")

    monkeypatch.setattr(torch.autograd, "grad", no_grad_taken)
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.float32, device)
    options = dict(ratio_level="sequence", qkl_coef=0.5, top_entropy_quantile=0.5, entropy_coef=0.05)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    hidden, weight, bias = leaves(*tensors)
    fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                           workspace_bytes=budget_for(5, torch.float32, device), **inputs, **options).loss.backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0


def plan_by_definition(kind, sample, max_rows, query_sums, response_values, all_response_entropies):
    """plan_chunks' rule, row by row: a cut c (between rows c - 1 and c) is free when no coupled set (a sample's rows
    of one coupled kind) has rows on both sides; each chunk ends at the last free cut up to max_rows rows when that
    leaves it at least half full; the rows of a set some cut splits are pre-passed (every response row with
    all_response_entropies)."""
    coupled = [k for k, reads in ((1, query_sums), (2, response_values and not all_response_entropies)) if reads]
    sets = [np.flatnonzero((kind == k) & (sample == s)) for k in coupled for s in np.unique(sample)]
    sets = [rows for rows in sets if rows.size]
    free = [c for c in range(len(kind) + 1) if not any(rows[0] < c <= rows[-1] for rows in sets)]
    chunks, start = [], 0
    while start < len(kind):
        stop = min(start + max_rows, len(kind))
        if stop < len(kind):
            best = max(c for c in free if c <= stop)
            stop = best if best - start >= (stop - start) / 2 else stop
        chunks.append((start, stop))
        start = stop
    cuts = [stop for _, stop in chunks[:-1]]
    needed = set(np.flatnonzero(kind == 2).tolist()) if all_response_entropies else set()
    for rows in sets:
        if any(rows[0] < c <= rows[-1] for c in cuts):
            needed |= set(rows.tolist())
    return chunks, sorted(needed)


@pytest.mark.parametrize("seed", range(6))
def test_plan_matches_its_definition_on_random_layouts(seed):
    """plan_chunks (its sets' spans by one pass over packed samples or a scatter over interleaved ones, its cuts from
    the merged ranges the sets forbid) against `plan_by_definition` on random layouts: packed samples of random
    lengths (some without query or response rows) and interleaved rows, every coupling and chunk size."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 12, size=9)
    packed_kind = np.concatenate([np.r_[[1] * rng.integers(0, n + 1), [2] * n][:n] for n in lengths])
    packed_sample = np.repeat(np.arange(9), lengths)
    packed_kind[rng.random(packed_kind.shape[0]) < 0.1] = 0  # padding rows inside samples
    layouts = [(packed_kind, packed_sample), (rng.integers(0, 3, 60), rng.integers(0, 9, 60))]
    for (kind, sample), max_rows in itertools.product(layouts, (3, 7, 16, 100)):
        for query_sums, response_values, all_response_entropies in itertools.product((False, True), repeat=3):
            flags = dict(query_sums=query_sums, response_values=response_values,
                         all_response_entropies=all_response_entropies)
            plan = chunked.plan_chunks(kind, sample, 9, max_rows, **flags)
            chunks, needed = plan_by_definition(kind, sample, max_rows, **flags)
            assert plan.chunks == chunks and plan.prepass_rows.tolist() == needed, (max_rows, flags)


def test_chunk_layout_lists_each_chunks_samples_with_all_their_rows():
    # rows: 0 1 2 | 3 4 5 | 6 7 | 8 (chunks); samples: 0 0 1 | 1 - 2 | 0 2 | - (rows 4 and 8 not scored)
    kind = np.array([1, 2, 1, 2, 0, 2, 2, 1, 0])
    sample = np.array([0, 0, 1, 1, 9, 2, 0, 2, 0])
    layout = chunk_layout([(0, 3), (3, 6), (6, 8), (8, 9)], kind, sample, 3)
    assert layout.program_offsets.tolist() == [0, 2, 4, 6, 6]  # the last chunk runs no program
    assert layout.sample_ids.tolist() == [0, 1, 1, 2, 0, 2]
    assert layout.sample_starts.tolist() == [0, 3, 5, 7]
    assert layout.rows_by_sample.tolist() == [0, 1, 6, 2, 3, 5, 7]
    runs = [layout.rows_by_sample[layout.sample_starts[s]:layout.sample_starts[s + 1]].tolist()
            for s in layout.sample_ids]  # what each chunk's programs walk
    assert runs == [[0, 1, 6], [2, 3], [2, 3], [5, 7], [0, 1, 6], [5, 7]]


def test_chunk_layout_of_packed_samples_takes_no_sort():
    """Samples in consecutive rows (the scored rows' samples ascending): the same layout as the sorting path gives
    for the same rows with the samples renumbered in reverse (a descending order, so sorted), mapped back."""
    kind = np.array([0, 1, 1, 2, 2, 0, 1, 2, 2, 2, 0, 2, 1, 2])
    sample = np.array([5, 0, 0, 0, 0, 5, 1, 1, 1, 1, 5, 3, 3, 3])  # sample 2 has no rows, 4 none either
    chunks = [(0, 4), (4, 8), (8, 13), (13, 14)]
    packed = chunk_layout(chunks, kind, sample, 5)
    assert packed.rows_by_sample.tolist() == [1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13]
    assert packed.sample_starts.tolist() == [0, 4, 8, 8, 11, 11]
    assert packed.program_offsets.tolist() == [0, 1, 3, 5, 6]
    assert packed.sample_ids.tolist() == [0, 0, 1, 1, 3, 3]
    assert_sorting_path_agrees(packed, chunks, kind, sample, 5)


def assert_sorting_path_agrees(packed, chunks, kind, sample, num_samples):
    """`packed` (chunk_layout of packed samples) lists, per chunk, the samples and rows that the sorting path lists
    for the same rows with the samples renumbered in reverse (a descending order), mapped back."""
    top = num_samples - 1
    reversed_ids = np.where(kind != 0, top - sample, sample)  # descending: the sorting path
    unsorted = chunk_layout(chunks, kind, reversed_ids, num_samples)
    assert packed.program_offsets.tolist() == unsorted.program_offsets.tolist()
    for c in range(len(chunks)):
        ids = unsorted.sample_ids[unsorted.program_offsets[c]:unsorted.program_offsets[c + 1]]
        packed_ids = packed.sample_ids[packed.program_offsets[c]:packed.program_offsets[c + 1]]
        assert sorted((top - ids).tolist()) == packed_ids.tolist()
        for s in ids:
            rows = unsorted.rows_by_sample[unsorted.sample_starts[s]:unsorted.sample_starts[s + 1]].tolist()
            mine = packed.rows_by_sample[packed.sample_starts[top - s]:packed.sample_starts[top - s + 1]].tolist()
            assert rows == mine


@pytest.mark.parametrize("seed", range(4))
def test_chunk_layout_of_packed_samples_agrees_with_the_sorting_path_on_random_layouts(seed):
    """Packed samples of random lengths (some without scored rows, padding rows of any sample_index inside and
    between them) cut into random chunks (some without a scored row): each chunk's samples, found from the samples'
    runs alone, are those the sorting path finds from every row."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        num_samples = int(rng.integers(1, 12))
        sample = np.repeat(np.arange(num_samples), rng.integers(0, 10, num_samples))
        kind = rng.integers(0, 3, sample.shape[0])
        sample = np.where(kind == 0, rng.integers(0, num_samples + 3, sample.shape[0]), sample)
        cuts = sorted({int(c) for c in rng.integers(1, max(sample.shape[0], 2), 4)} - {sample.shape[0]})
        edges = [0, *cuts, sample.shape[0]] if sample.shape[0] else []
        chunks = list(zip(edges[:-1], edges[1:]))
        assert_sorting_path_agrees(chunk_layout(chunks, kind, sample, num_samples), chunks, kind, sample, num_samples)


@pytest.mark.parametrize("options", [dict(qkl_coef=0.5),
                                     dict(ratio_level="sequence", top_entropy_quantile=0.5, entropy_coef=0.05,
                                          entropy_agg="token-mean", off_policy_mask_threshold=0.1)],
                         ids=option_id)
def test_results_repeat_bit_for_bit(options, device):
    batch = interleaved_batch(device)
    tensors = linear(len(batch["targets"]), torch.bfloat16, device)
    runs = [fused_and_logits_path(batch, tensors, "triton", rows=5, **options)[0] for _ in range(2)]
    (first, first_grads), (second, second_grads) = runs
    assert torch.equal(first.loss, second.loss) and torch.equal(first.token_logp, second.token_logp)
    assert all(torch.equal(a, b) for a, b in zip(first_grads, second_grads))


def test_a_rows_logprob_does_not_depend_on_the_rest_of_the_batch(monkeypatch, device):
    """batch_invariant: sample 0 alone, and first in a batch of 9 cut into other chunks, gets the same log-probs and
    entropies bit for bit. (Without it even the CPU's fp32 GEMMs differ here in the entropies' last bits: the BLAS
    picks its kernel by shape, as cuBLAS does.)"""
    monkeypatch.setattr(chunked, "INVARIANT_ROWS", 4)
    batch = packed_batch(SAMPLES, device)
    alone = packed_batch(SAMPLES[:1], device)
    hidden, weight, bias = linear(len(batch["targets"]), torch.bfloat16, device)
    rows = len(alone["targets"])
    inputs = {k: v for k, v in alone.items() if k not in ROW_TENSORS}
    small = fused_linear_erpo_loss(hidden[:rows], weight, *(alone[k] for k in ROW_TENSORS), bias=bias,
                                   backend="triton", batch_invariant=True, **inputs)
    whole = fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                                   workspace_bytes=budget_for(5, torch.bfloat16, device), batch_invariant=True,
                                   **{k: v for k, v in batch.items() if k not in ROW_TENSORS})
    assert torch.equal(small.token_logp, whole.token_logp[:rows])
    assert torch.equal(small.entropy, whole.entropy[:rows])


def test_batch_invariant_gemms_have_one_shape(monkeypatch, device):
    """batch_invariant: every logits GEMM (forward and pre-pass) has INVARIANT_ROWS rows, the same loss."""
    monkeypatch.setattr(chunked, "INVARIANT_ROWS", 4)
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.float32, device)
    plain = record(batch, tensors, rows=9, ratio_level="sequence")
    invariant = record(batch, tensors, rows=9, batch_invariant=True, ratio_level="sequence")
    assert set(invariant.logits_gemm_rows) == {4} and len(set(plain.logits_gemm_rows)) > 1
    (out, grads), expected = fused_and_logits_path(batch, tensors, "triton", rows=9, batch_invariant=True,
                                                   ratio_level="sequence")
    assert_same_loss((out, grads), expected)


def test_dweight_accumulated_in_fp32_is_as_accurate_as_one_gemm(device):
    """bf16 inputs, 40 chunks: d weight against float64 on the same bf16 dlogits is as close as one bf16 GEMM over
    all rows (a single rounding); accumulating the chunks in bf16 instead is measurably worse."""
    g = torch.Generator().manual_seed(4)
    num_rows, hidden_dim, vocab, rows = 800, 32, 256, 20
    dlogits = (torch.randn(num_rows, vocab, generator=g) * 1e-3).to(device, torch.bfloat16)
    hidden = torch.randn(num_rows, hidden_dim, generator=g).to(device, torch.bfloat16)
    exact = dlogits.double().t() @ hidden.double()
    accumulator = torch.zeros(vocab, hidden_dim, device=device)
    bf16_sum = torch.zeros(vocab, hidden_dim, dtype=torch.bfloat16, device=device)
    for start in range(0, num_rows, rows):
        chunk = slice(start, start + rows)
        chunked._accumulate_product(accumulator, dlogits[chunk].t(), hidden[chunk])
        bf16_sum += dlogits[chunk].t() @ hidden[chunk]

    def error(grad):
        return float((grad.double() - exact).norm() / exact.norm())

    ours, one_gemm = error(accumulator.bfloat16()), error(dlogits.t() @ hidden)
    assert ours <= 1.01 * one_gemm
    assert error(bf16_sum) > 2 * one_gemm


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backward_scales_the_stored_gradients_by_the_incoming_one(backend, device, grad_hidden_fp32):
    """(loss / 3).backward(): the bf16 gradients are the stored ones times the fp32 1/3, rounded once (one bf16 ulp
    of the exact product at most: to nearest even, on the interpreter too, triton_scale)."""
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.bfloat16, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    grads = []
    for factor in (1.0, 1 / 3):
        ours = leaves(*tensors)
        loss = fused_linear_erpo_loss(ours[0], ours[1], *(batch[k] for k in ROW_TENSORS), bias=ours[2],
                                      backend=backend, **inputs).loss
        (loss * torch.tensor(factor, device=device)).backward()
        grads.append([t.grad for t in ours])
    for plain, scaled in zip(*grads):
        assert scaled.dtype == torch.bfloat16 and not torch.equal(plain, scaled)
        torch.testing.assert_close(scaled.float(), plain.float() / 3, rtol=2**-7, atol=0)  # one bf16 ulp


class VocabByHidden(TorchDispatchMode):
    """The [V, D] tensors (d weight's size) that aten operators make, in order: (operator, dtype), and the zero fills
    of any shape."""

    def __init__(self):
        super().__init__()
        self.made, self.fills = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.fills += name in ("zeros", "zeros_like", "zero_", "fill_", "full")
        if not func.is_view and not func._schema.is_mutable:
            self.made += [(name, t.dtype) for t in torch.utils._pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor) and tuple(t.shape) == (VOCAB, HIDDEN_DIM)]
        return out


@pytest.mark.parametrize("factor", [1.0, 3.0, 1 / 3])
def test_dweight_is_rounded_once_from_its_fp32_accumulator(factor, device):
    """bf16 inputs, Triton backend: d weight stays the fp32 accumulator from the forward to the backward, whose scale
    pass rounds it once to bf16, to nearest even (as torch's cast: the Triton interpreter's own truncates). For
    loss.backward() (factor 1) that is the accumulator rounded, as before; for another upstream gradient it is the fp32
    product rounded once, at least as close to the float64 product as the old rounding twice (the accumulator to bf16
    in the forward, the product again). The [V, D] tensors made in one fwd+bwd: the fp32 accumulator and the rounded
    result, no bf16 copy in the forward (peak memory: the accumulator and its rounded copy were both alive at the end
    of the forward, beside the workspace), and no zero fill of any output's size in the backward."""
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.bfloat16, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    options = dict(qkl_coef=0.5, ratio_level="sequence")
    opts = LossOptions(**options)
    _, _, _, _, accumulator, _ = chunked.loss_gradients(
        *tensors, *(batch[k] for k in ROW_TENSORS), LossInputs(**inputs), opts, chunked.ROW_KERNELS["triton"],
        segment_sum_of(True), chunked.DEFAULT_WORKSPACE_BYTES, (True, True, True))
    assert accumulator.dtype == torch.float32
    ours = leaves(*tensors)
    with VocabByHidden() as forward_made:
        loss = fused_linear_erpo_loss(ours[0], ours[1], *(batch[k] for k in ROW_TENSORS), bias=ours[2],
                                      backend="triton", **inputs, **options).loss
    with VocabByHidden() as backward_made:
        (loss * torch.tensor(factor, device=device)).backward()
    assert [dtype for _, dtype in forward_made.made] == [torch.float32]
    assert [dtype for _, dtype in backward_made.made] == [torch.bfloat16] and backward_made.fills == 0
    grad = ours[1].grad
    assert torch.equal(grad, (accumulator * factor).to(torch.bfloat16))
    exact = accumulator.double() * factor

    def error(value):
        return float((value.double() - exact).norm() / exact.norm())

    twice = (accumulator.to(torch.bfloat16).float() * factor).to(torch.bfloat16)
    assert error(grad) <= error(twice)
    if factor != 1.0:
        assert not torch.equal(grad, twice)  # the double rounding differs somewhere on these values


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_backward_scales_on_the_backend_the_op_was_given(backend, device):
    """The op's backward finds the backend by the name of its argument (`fused_linear_loss.OP_ARGUMENTS`, the schema's
    order), not by a position that an argument added before it would move: on "triton" one `triton_scale` pass per
    gradient (hidden, weight, bias), on "torch" none; and it returns one gradient slot per argument of the op
    (autograd refuses another count)."""
    schema = torch.ops.erpo.fused_linear_erpo_loss_gradients.default._schema
    assert chunked.OP_ARGUMENTS == tuple(argument.name for argument in schema.arguments)
    batch = packed_batch([(1, 2)] * 3, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    hidden, weight, bias = leaves(*linear(len(batch["targets"]), torch.float32, device))
    with LaunchCounter() as counter:
        fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend=backend,
                               validate=False, **inputs).loss.backward()
    assert counter.names["triton._scale_kernel"] == (3 if backend == "triton" else 0)
    assert all(t.grad is not None for t in (hidden, weight, bias))



def test_the_torch_backends_chunk_gradient_keeps_the_python_snapshot_key(monkeypatch, device):
    """The torch backend's chunk gradient is an autograd.grad inside the op's body. Under LaunchCounter (a dispatch
    mode that re-enters itself in __torch_dispatch__ to count inside an op) that body runs with the mode's Python key
    included and, but for `fused_linear_loss._KEYS_PUT_BACK`, the PythonTLSSnapshot key excluded; on CUDA autograd
    runs the gradient's backward on its device thread, which takes these key sets and the mode but not the snapshot
    that the Python key's fallback reads: torch 2.11 asserted there (`tls_on_entry.has_value()`, the H100 run of
    2026-11-26, in the test above with "torch"). The CPU runs that backward on the calling thread and torch 2.13 no
    longer asserts, so what is checked, on any device, is the state the device thread would take: wherever the
    gradient is taken, the Python key is not without the snapshot's."""
    keys = torch._C.DispatchKey
    states = []
    grad = torch.autograd.grad

    def recording_grad(*args, **kwargs):
        states.append((torch._C._dispatch_tls_is_dispatch_key_included(keys.Python),
                       torch._C._dispatch_tls_is_dispatch_key_excluded(keys.PythonTLSSnapshot)))
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", recording_grad)
    batch = packed_batch([(1, 2)] * 3, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    hidden, weight, bias = leaves(*linear(len(batch["targets"]), torch.float32, device))
    with LaunchCounter():
        fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="torch",
                               validate=False, **inputs).loss.backward()
    assert states and all(python for python, _ in states), states  # the mode's key, as on the device thread
    assert not any(snapshot_excluded for _, snapshot_excluded in states), states

def test_opcheck_with_fp32_dhidden(monkeypatch, device):
    """bf16 inputs with GRAD_HIDDEN_FP32: the op's fake gives d hidden in fp32, as its implementation does."""
    monkeypatch.setattr(chunked, "GRAD_HIDDEN_FP32", True)
    batch = packed_batch([(2, 3), (1, 1), (4, 6)], device)
    hidden, weight, bias = (t.requires_grad_(True) for t in linear(len(batch["targets"]), torch.bfloat16, device))
    inputs = LossInputs(**{k: v for k, v in batch.items() if k not in ROW_TENSORS})
    arguments = (hidden, weight, bias, batch["targets"], batch["token_kind"], batch["sample_index"],
                 *inputs.as_kwargs().values(), None, None, None, chunked.options_argument(LossOptions(qkl_coef=0.3)),
                 "triton", budget_for(5, torch.bfloat16, device), False, True, True, True, None, None, None)
    assert chunked.loss_gradients_op(*arguments)[3].dtype == torch.float32
    torch.library.opcheck(chunked.loss_gradients_op, arguments)


def test_scaled_op_passes_opcheck(device):
    from erpo_kernels.triton_scale import scaled_op
    x = torch.randn(5, 7, device=device).bfloat16()
    torch.library.opcheck(scaled_op, (x, torch.tensor(0.5, device=device), torch.bfloat16))
    torch.library.opcheck(scaled_op, (x.float(), torch.tensor(0.5, device=device), torch.bfloat16))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_opcheck(kernels, device):
    batch = packed_batch([(2, 3), (1, 1), (4, 6)], device)
    hidden, weight, bias = (t.requires_grad_(True) for t in linear(len(batch["targets"]), torch.float32, device))
    opts = LossOptions(qkl_coef=0.3, loss_agg="seq-mean-token-mean")
    inputs = LossInputs(**{k: v for k, v in batch.items() if k not in ROW_TENSORS})
    torch.library.opcheck(chunked.loss_gradients_op, (
        hidden, weight, bias, batch["targets"], batch["token_kind"], batch["sample_index"],
        *inputs.as_kwargs().values(), None, None, None, chunked.options_argument(opts), kernels,
        budget_for(5, torch.float32, device), False, True, True, True, None, None, None))


@pytest.mark.parametrize("grouped", [False, True], ids=["over-logits", "store"])
def test_fp16_keeps_tiny_dlogits(grouped, monkeypatch, device):
    """fp16 with a token-mean over 10^5 items: g_logp ~ 1e-5 and p_j ~ 1 / V put every non-target dlogit g p_j
    below fp16's smallest subnormal. Each chunk's dlogits are written scaled by a power of two and unscaled inside
    the GEMMs (a group holding chunks of one power: `grouped`, chunks of 6 rows beside a store of 24). With hidden
    states large enough that d weight is a normal fp16 number, d weight then matches fp32 to fp16's precision
    (< 1%); unscaled it is 9% off."""
    monkeypatch.setattr(chunked, "LOGITS_ROWS", 6)
    batch = packed_batch(SAMPLES, device)
    hidden, weight, bias = linear(len(batch["targets"]), torch.float16, device)
    hidden, weight = hidden * 64, weight / 64  # the same logits; d weight 64 times larger
    options = dict(num_items=1e5, qkl_coef=0.0)
    exact = leaves(hidden.float(), weight.float(), bias.float())
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    erpo_loss(torch.addmm(exact[2], exact[0], exact[1].t()), *(batch[k] for k in ROW_TENSORS), backend="torch",
              **inputs, **options).loss.backward()

    budget = budget_for_groups(6, 24, torch.float16, device) if grouped else budget_for(6, torch.float16, device)
    assert chunked.plan_workspace(len(batch["targets"]), HIDDEN_DIM, VOCAB, torch.float16, device,
                                  chunked.ROW_KERNELS["triton"], budget, False).separate_store == grouped

    def weight_error():
        grads = fused_and_logits_path(batch, (hidden, weight, bias), "triton", rows=6, workspace_bytes=budget,
                                      **options)[0][1]
        return float((grads[1].float() - exact[1].grad).norm() / exact[1].grad.norm())

    assert exact[1].grad.abs().max() > 1e-4  # fp16 normals start at 6.1e-5
    assert weight_error() < 1e-2
    monkeypatch.setattr(chunked, "_fp16_gradient_scale", lambda *grads: 1.0)
    assert weight_error() > 0.05  # about 9%: the dlogits below 6e-8 flushed to 0


def test_the_chunks_backward_kernel_goes_with_their_forward_whatever_the_process_wide_variant(device):
    """The chunks' forward is CHUNK_FORWARD_VARIANT's kernel (or the epilogue's merge, EPILOGUE_ROW_PASS); their
    dlogits come from that variant's backward kernel, not from the process-wide variant's
    (`triton_logits.forward_variant`, here a variant of another pair)."""
    from erpo_kernels.fused_linear_loss import CHUNK_FORWARD_VARIANT
    from erpo_kernels.triton_logits import FORWARD_VARIANTS, forward_variant
    chunk_pair = FORWARD_VARIANTS[CHUNK_FORWARD_VARIANT]
    other = next(name for name, variant in FORWARD_VARIANTS.items() if variant.backward is not chunk_pair.backward)
    batch = packed_batch(SAMPLES, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    hidden, weight, bias = leaves(*linear(len(batch["targets"]), torch.float32, device))
    with forward_variant(other), LaunchCounter() as counter:
        fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias, backend="triton",
                               qkl_coef=0.5, **inputs).loss.backward()
    launched = {name.removeprefix("triton.") for name in counter.names if name.startswith("triton.")}
    forward = forward_row_launch()[1].removeprefix("triton.")  # the epilogue's merge with EPILOGUE_ROW_PASS
    assert {forward, chunk_pair.backward.__name__} <= launched, launched
    assert FORWARD_VARIANTS[other].backward.__name__ not in launched, launched
