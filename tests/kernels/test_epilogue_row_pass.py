"""fused_linear_loss.EPILOGUE_ROW_PASS: the fused loss's chunks with their logits and (logp, entropy, lse) formed by
the Triton GEMM with the forward row pass in its epilogue (erpo_kernels/triton_logits_gemm.py). Against the torch
oracle and against the option off (cuBLAS + the forward row kernel), values and every gradient, across the logit
transforms, a bias, bf16 / fp16 / fp32 inputs, -100 targets, the pre-pass and batch_invariant; the same launches and
host reads as the option off; two calls bitwise equal; a persistent launch sized by the device at the call
(Launch(DEVICE_SMS)) the bits of its count given and of one program per tile; a row's values the same whatever rows
share its GEMM; the torch backend untouched. Small blocks (LOSS_CONFIGS set to 16 x 64 x 16 tiles) against D = 24,
V = 300 and chunks of 5 to 7 rows: no size a multiple of its block, several vocabulary tiles a row for the combine to
merge."""
from __future__ import annotations

import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton` (also done by conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402

from erpo_kernels import fused_linear_loss as chunked  # noqa: E402
from erpo_kernels import triton_logits_gemm as gemm  # noqa: E402
from erpo_kernels.fused_linear import fused_linear_erpo_loss, fused_linear_token_logprobs  # noqa: E402
from erpo_kernels.validation import LogitTransform  # noqa: E402
from launch_counts import LaunchCounter  # noqa: E402
from test_fused_linear_loss import (  # noqa: E402
    HIDDEN_DIM,
    ROW_TENSORS,
    SAMPLES,
    TOLERANCE,
    VOCAB,
    assert_same_loss,
    budget_for,
    fused_and_logits_path,
    leaves,
    linear,
    packed_batch,
    plan,
)

SMALL = gemm.GemmConfig(16, 64, 16, 4, 1)  # D = 24, V = 300 and the chunks' rows: multiples of no block
TOLERANCE[torch.float16] = TOLERANCE[torch.bfloat16]


@pytest.fixture
def small_blocks(monkeypatch):
    """LOSS_CONFIGS at 16 x 64 x 16 for every dtype and transform (5 vocabulary tiles a row, ragged)."""
    monkeypatch.setattr(gemm, "LOSS_CONFIGS", {key: SMALL for key in gemm.LOSS_CONFIGS})


def budget(rows, dtype, device, epilogue=True):
    """workspace_bytes giving chunks of `rows` rows of `dtype` inputs, their dlogits over their logits, with the
    option's row of statistics (`triton_logits_gemm.stats_row_bytes`) when `epilogue`."""
    return budget_for(rows, dtype, device, epilogue=epilogue)


def run(batch, tensors, backend, rows, epilogue, monkeypatch, batch_invariant=False, **options):
    """(LossOutput, [d hidden, d weight, d bias]) of the fused loss with chunks of `rows` rows and EPILOGUE_ROW_PASS
    = `epilogue` (put back after)."""
    monkeypatch.setattr(chunked, "EPILOGUE_ROW_PASS", epilogue)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    ours = leaves(*tensors)
    dtype, device = tensors[0].dtype, tensors[0].device
    out = fused_linear_erpo_loss(ours[0], ours[1], *(batch[k] for k in ROW_TENSORS), bias=ours[2], backend=backend,
                                 workspace_bytes=budget(rows, dtype, device, epilogue and backend == "triton"),
                                 batch_invariant=batch_invariant, **inputs, **options)
    out.loss.backward()
    monkeypatch.setattr(chunked, "EPILOGUE_ROW_PASS", False)
    return out, [t.grad for t in ours if t is not None]


# (dtype, bias, options): every transform, with and without a bias, each dtype; the pre-pass (the Query-KL's sums and
# the sequence-level ratio split by chunks of 5 rows, every response row with the entropy filter)
CASES = [
    (torch.float32, True, dict(qkl_coef=0.5, ratio_level="sequence")),
    (torch.float32, False, dict(temperature=0.7, logit_scale=1.3, logit_softcap=3.0, entropy_coef=0.1)),
    (torch.bfloat16, True, dict(temperature=1.4, entropy_coef=0.05, loss_agg="seq-mean-token-mean")),
    (torch.float16, True, dict(logit_softcap=2.5, top_entropy_quantile=0.5, entropy_coef=0.05,
                               entropy_agg="token-mean")),
    (torch.bfloat16, False, dict(logit_scale=0.6, pg_objective="vespo", qkl_coef=0.3)),
]


@pytest.mark.parametrize("dtype,bias,options", CASES,
                         ids=[f"{str(d)[6:]}-{'bias' if b else 'nobias'}-{','.join(o)}" for d, b, o in CASES])
def test_the_option_equals_the_oracle_and_the_option_off(dtype, bias, options, small_blocks, monkeypatch, device):
    """With EPILOGUE_ROW_PASS the loss, its metrics, logp and entropy and every gradient equal the torch oracle's
    (the logits path on the exact logits) as the default's do, and the default's own within the dtype's rounding:
    the same raw logits in the buffer (the bias added) for the backward row kernel, (logp, entropy, lse) of the
    transformed ones; -100 rows at logp 0."""
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), dtype, device, bias=bias)
    monkeypatch.setattr(chunked, "EPILOGUE_ROW_PASS", True)
    ours, expected = fused_and_logits_path(batch, tensors, "triton", rows=5,
                                           workspace_bytes=budget(5, dtype, device), **options)
    monkeypatch.setattr(chunked, "EPILOGUE_ROW_PASS", False)
    assert_same_loss(ours, expected, dtype=dtype)
    (on, on_grads), (off, off_grads) = ours, run(batch, tensors, "triton", 5, False, monkeypatch, **options)
    assert bool((on.token_logp[batch["targets"] == -100] == 0).all())
    for name in ("token_logp", "entropy"):
        torch.testing.assert_close(getattr(on, name), getattr(off, name), rtol=0, atol=2e-5)
    torch.testing.assert_close(on.loss, off.loss, rtol=1e-5, atol=1e-6)
    for got, wanted in zip(on_grads, off_grads):
        scale = wanted.float().abs().max()
        torch.testing.assert_close(got.float() / scale, wanted.float() / scale, **TOLERANCE[dtype])


# (config, launch, dtype, bias, options): a lease's pick (bench.epilogue_pick) sets LOSS_CONFIGS and LOSS_LAUNCH; here
# another tile than SMALL (10 vocabulary tiles a row, 32-row tiles over 7-row chunks), persistent programs walking
# several tiles each, TMA loads (rows of 48 and 96 bytes) and both at once, under the soft-cap and a bias
PICKED_CASES = [
    (gemm.GemmConfig(32, 32, 16, 4, 2), gemm.Launch(3, True), torch.bfloat16, True,
     dict(logit_softcap=3.0, temperature=0.8, entropy_coef=0.1)),
    (gemm.GemmConfig(16, 64, 16, 4, 1), gemm.Launch(2, False), torch.float32, False, dict(qkl_coef=0.5)),
    (gemm.GemmConfig(32, 32, 16, 4, 2), gemm.Launch(None, True), torch.float16, True, dict(logit_scale=1.3)),
]


@pytest.mark.parametrize("config,launch,dtype,bias,options", PICKED_CASES,
                         ids=[f"{config}-{launch}-{str(d)[6:]}".replace(" ", "") for config, launch, d, _, _ in
                              PICKED_CASES])
def test_a_picked_config_and_launch_equal_the_oracle(config, launch, dtype, bias, options, monkeypatch, device):
    """With EPILOGUE_ROW_PASS under another LOSS_CONFIGS and LOSS_LAUNCH (read when the loss runs, as a lease's pick
    sets them) the loss, logp, entropy and every gradient equal the torch oracle's, over ragged chunks of 7 rows."""
    monkeypatch.setattr(gemm, "LOSS_CONFIGS", {key: config for key in gemm.LOSS_CONFIGS})
    monkeypatch.setattr(gemm, "LOSS_LAUNCH", launch)
    monkeypatch.setattr(chunked, "EPILOGUE_ROW_PASS", True)
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), dtype, device, bias=bias)
    ours, expected = fused_and_logits_path(batch, tensors, "triton", rows=7,
                                           workspace_bytes=budget(7, dtype, device), **options)
    assert_same_loss(ours, expected, dtype=dtype)


GEMM_ROWS = 37  # `gemm_operands`' rows: two 16-row tiles and a ragged one


def gemm_operands(device, seed: int):
    """(hidden [GEMM_ROWS, D], weight [V, D], bias [V] bf16, targets [GEMM_ROWS] int64, a transform with every part)
    for the epilogue GEMM on its own (`gemm_values`)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(GEMM_ROWS, HIDDEN_DIM, generator=g).to(device, torch.bfloat16)
    weight = (torch.randn(VOCAB, HIDDEN_DIM, generator=g) * 0.4).to(device, torch.bfloat16)
    bias = torch.randn(VOCAB, generator=g).to(device, torch.bfloat16)
    targets = torch.randint(0, VOCAB, (GEMM_ROWS,), generator=g).to(device)
    return hidden, weight, bias, targets, LogitTransform(0.8, 1.1, 4.0)


def gemm_values(operands, rows, launch=gemm.Launch()):
    """(logits [n, V], stats [n, tiles, 3], logp, entropy, lse [n]) fp32 of the n rows `rows` (int64 [n]) of
    `gemm_operands`' hidden: the epilogue GEMM at SMALL, launched as `launch`, then its combine; every output filled
    with NaN first, so that what a launch leaves unwritten shows."""
    hidden, weight, bias, targets, transform = operands
    device = hidden.device
    logits = torch.full((rows.shape[0], VOCAB), float("nan"), device=device)
    stats = torch.full((rows.shape[0], gemm.tile_count(VOCAB, SMALL), 3), float("nan"), device=device)
    out = tuple(torch.full((rows.shape[0],), float("nan"), device=device) for _ in range(3))
    gemm.logits_gemm(hidden[rows], weight, logits, SMALL, launch, stats=stats, bias=bias, transform=transform)
    gemm.combine_stats(stats, logits, targets[rows], out, transform)
    return (logits, stats, *out)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "TMA"])
def test_a_device_sized_persistent_launch_gives_the_bits_of_a_count_and_of_a_program_per_tile(tma, device):
    """Launch(DEVICE_SMS): one persistent program per SM of the operands' device (`sm_count`: INTERPRETER_SMS on the
    CPU, fewer than the 15 tiles here, so each program walks several), the same logits, statistics and (logp,
    entropy, lse) bits as that count given explicitly and as one program per tile (bf16, a bias, the soft-cap)."""
    operands, rows = gemm_operands(device, seed=7), torch.arange(GEMM_ROWS, device=device)
    tiles = 3 * gemm.tile_count(VOCAB, SMALL)  # 37 rows in 16-row tiles
    sms = gemm.sm_count(device)
    assert gemm.program_count(gemm.Launch(gemm.DEVICE_SMS, tma), device, tiles) == min(sms, tiles)
    if device.type == "cpu":
        assert sms == gemm.INTERPRETER_SMS < tiles
    else:
        assert sms == torch.cuda.get_device_properties(device).multi_processor_count
    device_sized = gemm_values(operands, rows, gemm.Launch(gemm.DEVICE_SMS, tma))
    assert all(bool(torch.isfinite(tensor).all()) for tensor in device_sized)
    for launch in (gemm.Launch(sms, tma), gemm.Launch(None, tma)):
        assert all(torch.equal(got, wanted) for got, wanted in zip(gemm_values(operands, rows, launch), device_sized))


def test_the_loss_with_a_device_sized_persistent_launch_gives_the_same_bits(small_blocks, monkeypatch, device):
    """LOSS_LAUNCH = Launch(DEVICE_SMS, True), as bench.decide writes a persistent pick: the loss, its metrics, logp,
    entropy and every gradient (bf16, a bias, chunks of 7 rows) are the bits of that count given explicitly and of
    one program per tile."""
    batch = packed_batch(SAMPLES[:5], device)  # 35 rows in chunks of 7
    tensors = linear(len(batch["targets"]), torch.bfloat16, device)
    results = []
    for launch in (gemm.Launch(gemm.DEVICE_SMS, True), gemm.Launch(gemm.sm_count(device), True), gemm.Launch(tma=True)):
        monkeypatch.setattr(gemm, "LOSS_LAUNCH", launch)
        out, grads = run(batch, tensors, "triton", 7, True, monkeypatch, logit_softcap=3.0, qkl_coef=0.5)
        results.append((out.loss, out.token_logp, out.entropy, *out.metrics.values(), *grads))
    for other in results[1:]:
        assert all(torch.equal(got, wanted) for got, wanted in zip(other, results[0]))


def test_sm_count_reads_each_cuda_device_once(monkeypatch):
    """`sm_count` asks torch for a CUDA device's properties once and keeps the count (a fake device pair here, 114
    and 132 SMs: an H100 PCIe and an H200); off CUDA it is INTERPRETER_SMS."""
    asked = []

    def properties(device):
        asked.append(device)
        return type("Properties", (), {"multi_processor_count": {0: 114, 1: 132}[device.index]})

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    gemm.sm_count.cache_clear()
    try:
        counts = [gemm.sm_count(torch.device("cuda", index)) for index in (0, 1, 0, 1)]
    finally:
        gemm.sm_count.cache_clear()  # the fake counts leave with the test
    assert counts == [114, 132, 114, 132] and asked == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert gemm.sm_count(torch.device("cpu")) == gemm.INTERPRETER_SMS


@pytest.mark.parametrize("programs", [0, -2, "device", 2.0, True])
def test_a_program_count_that_is_no_count_is_refused(programs, device):
    hidden = torch.randn(5, HIDDEN_DIM, device=device)
    weight = torch.randn(VOCAB, HIDDEN_DIM, device=device)
    with pytest.raises(ValueError, match=rf"^Launch.programs must be a count of at least 1, DEVICE_SMS or None \(one "
                                         rf"program per tile\); got {re.escape(repr(programs))}$"):
        gemm.logits_gemm(hidden, weight, torch.empty(5, VOCAB, device=device), SMALL, gemm.Launch(programs))


def test_tma_falls_back_to_pointer_loads_where_it_cannot_load(monkeypatch, device):
    """LOSS_LAUNCH with TMA, hidden rows starting 2 bytes past a 16-byte boundary (a tensor descriptor cannot take
    them): the loss's GEMM uses pointer loads for them (the same logits and statistics as the pointer launch, where
    logits_gemm itself refuses TMA with a one-line error); aligned rows of 48 bytes take TMA, rows of 36 cannot."""
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(9 * HIDDEN_DIM + 1, generator=g).to(device, torch.bfloat16)
    hidden = flat[1:].view(9, HIDDEN_DIM)  # contiguous, 2 bytes past its storage's start
    weight = (torch.randn(VOCAB, HIDDEN_DIM, generator=g) * 0.4).to(device, torch.bfloat16)
    assert not gemm.tma_loads(hidden, weight) and gemm.tma_loads(hidden.clone(), weight)
    assert not gemm.tma_loads(hidden[:, :18].contiguous(), weight[:, :18].contiguous())
    logits = torch.empty(9, VOCAB, device=device)
    with pytest.raises(ValueError, match=r"TMA loads need rows of a multiple of 16 bytes; hidden's are 24 x 2 bytes, "
                                         r"and 16-byte-aligned tensors; hidden and weight start 2 and 0 bytes past"):
        gemm.logits_gemm(hidden, weight, logits, SMALL, gemm.Launch(tma=True))
    monkeypatch.setattr(gemm, "LOSS_CONFIGS", {key: SMALL for key in gemm.LOSS_CONFIGS})
    written = []
    for launch in (gemm.Launch(tma=True), gemm.Launch()):
        monkeypatch.setattr(gemm, "LOSS_LAUNCH", launch)
        row_pass = gemm.EpilogueRowPass(9, hidden, weight, None, LogitTransform())
        row_pass.write(logits, hidden, 0)
        written.append((logits.clone(), row_pass.stats.clone()))
    assert all(torch.equal(tma, pointers) for tma, pointers in zip(*written))


def test_batch_invariant_with_the_option(small_blocks, monkeypatch, device):
    """batch_invariant=True with the option: its padded GEMMs of INVARIANT_ROWS rows (here 16) go through the epilogue
    GEMM, the statistics of the padding rows never read; the oracle's values and gradients, and a row's logp and
    entropy the same bits whether the batch is all the samples or the first few."""
    monkeypatch.setattr(chunked, "INVARIANT_ROWS", 16)
    batch = packed_batch(SAMPLES, device)
    tensors = linear(len(batch["targets"]), torch.float32, device)
    monkeypatch.setattr(chunked, "EPILOGUE_ROW_PASS", True)
    ours, expected = fused_and_logits_path(batch, tensors, "triton", rows=20, batch_invariant=True,
                                           workspace_bytes=budget(20, torch.float32, device))
    assert_same_loss(ours, expected)
    few = packed_batch(SAMPLES[:3], device)
    rows = len(few["targets"])
    part, _ = run(few, (tensors[0][:rows], *tensors[1:]), "triton", 20, True, monkeypatch, batch_invariant=True)
    assert torch.equal(part.token_logp, ours[0].token_logp[:rows]) and torch.equal(part.entropy, ours[0].entropy[:rows])


def test_a_rows_values_do_not_depend_on_the_rows_beside_it(small_blocks, monkeypatch, device):
    """The epilogue GEMM's row independence (erpo_kernels/triton_logits_gemm.py, module docstring), which would make
    batch_invariant's padding needless with the option: rows 3 to 10 of a 37-row chunk and the same 8 rows as a chunk
    of their own, at another place in their row tile, give the same bits in their logits and (logp, entropy, lse);
    and the loss with the option, batch_invariant=False, gives the first samples' rows the same logp and entropy
    whether the batch is all the samples or those alone. Compiled only (a GPU lease's kernel tier runs it)."""
    if device.type != "cuda":
        pytest.skip("compiled kernels only: the interpreter's tl.dot is numpy's matmul, whose BLAS sums a row's "
                    "products in an order that depends on the row's place in its block (OpenBLAS: 28 of 8 x 64 "
                    "products of one 16 x 16 x 64 step differed in the last bit, 2026-11-27)")
    operands = gemm_operands(device, seed=5)
    logits, _, *row_values = gemm_values(operands, torch.arange(GEMM_ROWS, device=device))
    own_logits, _, *own_row_values = gemm_values(operands, torch.arange(3, 11, device=device))
    for everything, own in zip((logits, *row_values), (own_logits, *own_row_values)):
        assert torch.equal(everything[3:11], own)
    batch, few = packed_batch(SAMPLES, device), packed_batch(SAMPLES[:3], device)
    tensors = linear(len(batch["targets"]), torch.bfloat16, device)
    rows = len(few["targets"])
    full, _ = run(batch, tensors, "triton", 7, True, monkeypatch)
    part, _ = run(few, (tensors[0][:rows], *tensors[1:]), "triton", 7, True, monkeypatch)
    assert torch.equal(part.token_logp, full.token_logp[:rows]) and torch.equal(part.entropy, full.entropy[:rows])


def test_the_same_launches_and_host_reads_and_the_same_bits_twice(small_blocks, monkeypatch, device):
    """Per fwd+bwd (bf16, a bias, validate=False, chunks of 12 rows) the option launches no more than the default
    (its GEMM and its combine for cuBLAS's GEMM and the forward row kernel; the bias read by the GEMM, no fp32 copy
    of it) and reads the host as often; two calls with it give the same bits in every output and gradient."""
    batch = packed_batch([(1, 2)] * 6, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    tensors = linear(24, torch.bfloat16, device)
    counts, results = {}, []
    for epilogue in (False, True, True):
        monkeypatch.setattr(chunked, "EPILOGUE_ROW_PASS", epilogue)
        hidden, weight, bias = leaves(*tensors)
        with LaunchCounter() as counter:
            out = fused_linear_erpo_loss(hidden, weight, *(batch[k] for k in ROW_TENSORS), bias=bias,
                                         backend="triton", validate=False,
                                         workspace_bytes=budget(12, torch.bfloat16, device, epilogue), qkl_coef=0.5,
                                         **inputs)
            out.loss.backward()
        counts[epilogue] = counter
        results.append((out.loss, out.token_logp, out.entropy, hidden.grad, weight.grad, bias.grad))
    off, on = counts[False], counts[True]
    # a row kernel a chunk (2 of 12 rows, whole samples: no pre-pass; as many as the plan makes under a session's
    # --fused-options geometry); the first chunk's logits in two GEMMs (the rows before the host read, then the
    # rest), as cuBLAS's
    workspace = chunked.workspace_of(24, *tensors[:2], chunked.ROW_KERNELS["triton"],
                                     budget(12, torch.bfloat16, device), False, epilogue=True)
    chunks = len(plan(batch, workspace.chunk_rows, query_sums=True).chunks)
    assert on.names["triton._combine_kernel"] == off.names["triton._logp_entropy_forward_log2_kernel"] == chunks
    assert on.names["triton._logits_gemm_kernel"] == chunks + 1
    assert "triton._logp_entropy_forward_log2_kernel" not in on.names
    assert on.launches <= off.launches and on.syncs == off.syncs == 1, (on.names, off.names)
    assert all(torch.equal(first, second) for first, second in zip(results[1], results[2]))


# the interpreter's tl.max is numpy's nanmax, which warns on the NaN row's tiles (compiled, the max skips NaN silently)
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_a_nonfinite_padding_row_poisons_nothing_with_the_option(small_blocks, monkeypatch, device):
    """A padding row (kind 0, target -100) of NaN hidden state: its statistics NaN, the merge's max skipping NaN but
    its sums not; the loss finite, every gradient the same as with that row zeroed, and exact zeros in its d hidden."""
    batch = packed_batch(SAMPLES[:5], device)  # 35 rows in chunks of 6, the NaN row the third padding row
    hidden, weight, bias = linear(len(batch["targets"]), torch.bfloat16, device)
    padding = int((batch["token_kind"] == 0).nonzero()[2])
    results = []
    for filler in (0.0, float("nan")):
        h = hidden.clone()
        h[padding] = filler
        out, grads = run(batch, (h, weight, bias), "triton", 6, True, monkeypatch)
        assert torch.isfinite(out.loss)
        results.append(grads)
    for clean, got in zip(*results):
        assert torch.equal(got, clean)
    assert torch.all(results[1][0][padding] == 0)


def test_the_torch_backend_ignores_the_option(monkeypatch, device):
    """The torch backend, the oracle, keeps cuBLAS and its row pass with the option on: the same bits."""
    batch = packed_batch(SAMPLES[:4], device)
    tensors = linear(len(batch["targets"]), torch.float32, device)
    (on, on_grads), (off, off_grads) = (run(batch, tensors, "torch", 6, epilogue, monkeypatch)
                                        for epilogue in (True, False))
    assert torch.equal(on.loss, off.loss) and torch.equal(on.token_logp, off.token_logp)
    assert all(torch.equal(got, wanted) for got, wanted in zip(on_grads, off_grads))


def test_an_operand_dtype_the_gemm_lacks_is_refused(device):
    with pytest.raises(ValueError, match="the epilogue's logits GEMM takes bf16, fp16 or fp32 operands; got "
                                         "torch.float64"):
        gemm.loss_config(torch.float64, LogitTransform())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_token_logprobs_score_the_rows_as_the_loss_does(dtype, small_blocks, monkeypatch, device):
    """With the option, fused_linear_token_logprobs (what a trainer scores its old and reference log-probs with, and
    ell_theta0(q) at theta0) forms its logits with the loss's GEMM: each scored row's logp and entropy are the loss's
    bits (so the Query-KL stays exactly 0 at theta0, tests/integrations/test_trl_integration.py), and its gradients,
    the same GEMM forming the logits again in its backward, are the torch oracle's."""
    monkeypatch.setattr(chunked, "EPILOGUE_ROW_PASS", True)
    batch = packed_batch(SAMPLES, device)
    inputs = {k: v for k, v in batch.items() if k not in ROW_TENSORS}
    tensors = linear(len(batch["targets"]), dtype, device)
    out = fused_linear_erpo_loss(*tensors[:2], *(batch[k] for k in ROW_TENSORS), bias=tensors[2], backend="triton",
                                 **inputs)
    scored = batch["token_kind"] != 0
    grads, weights = [], torch.linspace(-1.0, 1.0, len(batch["targets"]), device=device)
    for backend in ("triton", "torch"):
        hidden, weight, bias = leaves(*tensors)
        logp, entropy = fused_linear_token_logprobs(hidden, weight, batch["targets"], bias=bias, backend=backend,
                                                    return_entropy=True)
        if backend == "triton":
            assert torch.equal(logp[scored], out.token_logp[scored]) and torch.equal(entropy[scored],
                                                                                       out.entropy[scored])
        ((logp + 0.5 * entropy) * weights).sum().backward()
        grads.append([hidden.grad, weight.grad, bias.grad])
    for got, wanted in zip(*grads):
        scale = wanted.float().abs().max()
        torch.testing.assert_close(got.float() / scale, wanted.float() / scale, **TOLERANCE[dtype])
