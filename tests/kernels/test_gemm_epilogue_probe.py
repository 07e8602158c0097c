"""bench.gemm_epilogue_probe: its Triton GEMM and its epilogue's row statistics against torch in float64 (compiled on a
GPU, in the interpreter on the CPU) at shapes whose rows, vocabulary and D are and are not multiples of the blocks,
with -100 targets; both tile orders giving the same bits; its refusals; its on-device check and its answer; its
dry run end to end; its real configs compiled for sm_90."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gemm_epilogue_probe as probe
from compile_check import COMPILE_TIMEOUT_S, run_compile_script
from erpo_kernels.triton_logits_gemm import INTERPRETER_SMS, LOSS_CONFIGS, GemmConfig, Launch, tile_count
from interpreter_as_gpu import NUMPY_SCALAR_ERROR
from paths import worker_pythonpath

REPO = Path(__file__).resolve().parents[2]
CASES = [  # (rows, D, V, config)
    (24, 40, 200, GemmConfig(16, 32, 16, 4, 1)),    # no size a multiple of its block: the K mask, ragged edges
    (37, 64, 130, GemmConfig(32, 64, 32, 4, 2)),    # ragged rows and vocabulary, D a multiple of the K step
    (32, 32, 128, GemmConfig(16, 64, 16, 4, 1)),    # every size a multiple of its block
    (5, 48, 1000, GemmConfig(16, 128, 16, 4, 1)),   # fewer rows than a block, many vocabulary tiles
]


def operands(rows: int, dim: int, vocab: int, device):
    """bf16 hidden [rows, D] and weight [V, D] whose logits spread over several nats (a column counted twice or lost
    moves lse by far more than the tolerance), targets [rows] with every third -100."""
    hidden = torch.randn(rows, dim).to(device, torch.bfloat16)
    weight = (torch.randn(vocab, dim) * (2.0 / math.sqrt(dim))).to(device, torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,))
    targets[::3] = -100
    return hidden, weight, targets.to(device)


def float64_reference(hidden, weight, targets):
    """(logits, logp, entropy, lse) in float64 from the bf16 operands, by the definitions: lse = logsumexp(z),
    entropy = -sum p log p, logp = z_t - lse (0 where the target is -100)."""
    z = hidden.double() @ weight.double().T
    log_p = torch.log_softmax(z, 1)
    logp = torch.where(targets != -100, log_p.gather(1, targets.clamp_min(0)[:, None])[:, 0], 0.0)
    return z, logp, -(log_p.exp() * log_p).sum(1), torch.logsumexp(z, 1)


def epilogue_run(hidden, weight, targets, config, launch):
    """(d): the GEMM with its row statistics, then the combine: (logits, logp, entropy, lse)."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    logits = torch.full((rows, vocab), math.nan, device=hidden.device)
    stats = torch.full((rows, probe.tile_count(vocab, config), 3), math.nan, device=hidden.device)
    vectors = tuple(torch.full((rows,), math.nan, device=hidden.device) for _ in range(3))
    probe.logits_gemm(hidden, weight, logits, config, launch, stats)
    probe.combine_stats(stats, logits, targets, vectors)
    return (logits, *vectors)


@pytest.mark.parametrize("launch", probe.launches(3), ids=str)
@pytest.mark.parametrize("rows,dim,vocab,config", CASES, ids=[f"{r}x{d}x{v}" for r, d, v, _ in CASES])
def test_epilogue_statistics_equal_torch(rows, dim, vocab, config, launch, device):
    hidden, weight, targets = operands(rows, dim, vocab, device)
    logits, logp, entropy, lse = epilogue_run(hidden, weight, targets, config, launch)
    z, want_logp, want_entropy, want_lse = float64_reference(hidden.cpu(), weight.cpu(), targets.cpu())
    torch.testing.assert_close(logits.cpu().double(), z, rtol=0, atol=1e-5 * (1 + float(z.abs().max())))
    for got, want in ((lse, want_lse), (entropy, want_entropy), (logp, want_logp)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=2e-5)
    assert (logp[targets == -100] == 0).all() and (logp <= 0).all()
    # the plain GEMM (c) writes the same bits: the statistics are added to the epilogue, the product is unchanged
    plain = torch.full_like(logits, math.nan)
    probe.logits_gemm(hidden, weight, plain, config, launch)
    assert torch.equal(plain, logits)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "TMA"])
def test_tile_orders_give_the_same_bits_run_to_run(tma, device):
    """The grouped and the persistent launch compute each tile alike (their difference is only which program takes
    it): both, twice each, write identical logits and (logp, entropy, lse)."""
    rows, dim, vocab, config = CASES[1]
    hidden, weight, targets = operands(rows, dim, vocab, device)
    runs = [epilogue_run(hidden, weight, targets, config, Launch(programs, tma)) for programs in (None, 2, None, 2)]
    for run in runs[1:]:
        assert all(torch.equal(got, first) for got, first in zip(run, runs[0]))


def test_bad_operands_are_refused_naming_them(device):
    hidden, weight, _ = operands(8, 32, 64, device)
    config = CASES[2][3]
    logits = torch.empty(8, 64, device=device)
    with pytest.raises(ValueError, match=r"hidden \[n, D\] and weight \[V, D\] must share D; got \(8, 32\) and "
                                         r"\(64, 16\)"):
        probe.logits_gemm(hidden, weight[:, :16].contiguous(), logits, config)
    with pytest.raises(ValueError, match="must be contiguous and of one dtype"):
        probe.logits_gemm(hidden, weight.float(), logits, config)
    with pytest.raises(ValueError, match=r"logits must be fp32 \[8, 64\]"):
        probe.logits_gemm(hidden, weight, logits.to(torch.bfloat16), config)
    with pytest.raises(ValueError, match=r"stats must be a contiguous fp32 \[8, 1, 3\] tensor for 16x64x16 w4 s1"):
        probe.logits_gemm(hidden, weight, logits, config, stats=torch.empty(8, 2, 3, device=device))
    hidden, weight, _ = operands(8, 36, 64, device)  # rows of 72 bytes
    with pytest.raises(ValueError, match=r"TMA loads need rows of a multiple of 16 bytes; hidden's are 36 x 2 bytes"):
        probe.logits_gemm(hidden, weight, logits, config, Launch(tma=True))


def test_the_on_device_check_fails_a_wrong_variant(device):
    """Chunk's check, as the GPU run applies it: each variant as written passes; a logit off by 1e-2 or a statistic
    off by 1e-3 fails, and so does what a variant left unwritten (the reset before each puts NaN there)."""
    chunk = probe.Chunk(24, 40, 200, device)
    for variant in chunk.variants(probe.SMOKE["configs"], 3):
        chunk.reset()
        variant.call()
        assert chunk.passes(chunk.errors(variant.part)), (variant, chunk.errors(variant.part))
    chunk.reset()
    assert all(math.isnan(error) for error in chunk.errors("d").values()) and not chunk.passes(chunk.errors("d"))
    chunk.cublas()  # the logits right, the statistics never written: the combine reads NaN
    probe.combine_stats(chunk.side_buffers[0], chunk.logits, chunk.targets, chunk.vectors)
    errors = chunk.errors("d")
    assert errors["logits"] == 0 and math.isnan(errors["lse"]) and not chunk.passes(errors)
    chunk.row_pass()
    chunk.logits[3, 7] += 1e-2
    assert not chunk.passes(chunk.errors("c"))
    chunk.logits[3, 7] -= 1e-2
    chunk.vectors[2][5] += 1e-3  # lse
    errors = chunk.errors("d")
    assert errors["lse"] == pytest.approx(1e-3, abs=1e-5) and not chunk.passes(errors)


def timed(part, ms, passed=True, config="c1", launch="grouped"):
    return {"part": part, "config": config, "launch": launch, "passed": passed, "median_ms": ms}


def test_the_answer_takes_the_fastest_passing_rows():
    rows = [timed("a", 2.0), timed("b", 2.5), timed("c", 1.5, passed=False), timed("c", 2.2, config="c2"),
            timed("d", 1.0, passed=False), timed("d", 2.4, launch="persistent (132)"), timed("d", 2.6),
            {"part": "d", "config": "c3", "launch": "grouped", "passed": False, "error": "OutOfResources: shared"}]
    pairs = probe.answer(rows, chunk_rows=2048)
    assert pairs["d"] == {"config": "c1", "launch": "persistent (132)", "ms": 2.4, "base_ms": 2.5,
                          "saved_ms": pytest.approx(0.1), "ratio": pytest.approx(0.96), "chunks": 8,
                          "total_ms": pytest.approx(19.2), "base_total_ms": 20.0}
    assert pairs["c"]["config"] == "c2" and pairs["c"]["saved_ms"] == pytest.approx(-0.2)
    (line_d, line_c) = probe.answer_lines(pairs, 2048)
    assert "(d) c1 persistent (132) beats (b): 2.400 against 2.500 ms" in line_d
    assert "in 8 chunks, 19.2 against 20.0 ms" in line_d and "not a measurement" in line_d
    assert "(c) c2 grouped does not beat (a)" in line_c
    assert probe.answer([timed("b", 1.0), timed("d", 0.5, passed=False)], 512)["d"] is None
    assert probe.answer_lines({"d": None, "c": None}, 512)[0].endswith("(d) or (b) has no passing timed row")


def test_smoke_needs_the_interpreter_and_the_full_run_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "INTERPRETED", False)
    with pytest.raises(SystemExit, match="--smoke runs the kernels in Triton's interpreter; set TRITON_INTERPRET=1"):
        probe.main(["--smoke", "--out", str(tmp_path)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        probe.main(["--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


@pytest.mark.cpu_only  # a process of its own in Triton's interpreter, on any machine (pytest.ini)
def test_the_dry_run_writes_a_checked_row_per_variant(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": worker_pythonpath(),
           "PYTHONWARNINGS": NUMPY_SCALAR_ERROR}
    done = subprocess.run([sys.executable, "-m", "bench.gemm_epilogue_probe", "--smoke", "--commit", "abc123",
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = json.loads((tmp_path / "gemm_epilogue_probe.json").read_text())
    command = f"python -m bench.gemm_epilogue_probe --smoke --commit abc123 --out {tmp_path}"
    assert measured["meta"]["command"] == command
    assert measured["meta"]["commit"] == "abc123" and measured["meta"]["programs"] == INTERPRETER_SMS
    (chunk,) = measured["chunks"]
    assert (chunk["shape"], chunk["rows"]) == (probe.SMOKE["shape"], int(probe.SMOKE["rows"]))
    variants = [(row["part"], row["config"], row["launch"]) for row in chunk["results"]]
    configs = [str(config) for config in probe.SMOKE["configs"]]
    assert variants == [("a", None, None), ("b", None, None)] + [
        (part, config, str(launch)) for part in "cd" for config in configs
        for launch in probe.launches(INTERPRETER_SMS)]
    for row in chunk["results"]:
        assert row["passed"] and row["median_ms"] > 0, row
        assert set(row["errors"]) == ({"logits", "logp", "entropy", "lse"} if row["part"] in "bd" else {"logits"})
    assert set(chunk["answer"]) == {"c", "d"} and all(pair["chunks"] == math.ceil(probe.PROBE_N / 24)
                                                      for pair in chunk["answer"].values())
    markdown = (tmp_path / "gemm_epilogue_probe.md").read_text()
    assert markdown.count("| passed |") == len(variants) and "| FAILED |" not in markdown
    assert "- command: `python -m bench.gemm_epilogue_probe --smoke --commit abc123 --out " in markdown
    assert "- the forward row pass in the GEMM's epilogue: (d) " in markdown and "not a measurement" in markdown


@pytest.mark.cpu_only  # on a GPU the probe compiles and runs these itself; here, what only a compile can show
@pytest.mark.timeout(COMPILE_TIMEOUT_S)
def test_the_gpu_configs_compile_for_hopper_without_spills():
    """Each of CONFIGS, with and without the row statistics, its operands through pointers and through TMA, at both
    lm_heads' D; the fused loss's LOSS_CONFIGS (erpo_kernels/triton_logits_gemm.py) for bf16 and fp32, with a bias
    and the soft-cap where the config is the soft-cap's, else with neither; and the combine at each tile count:
    compiled for sm_90 (tests/workers/gemm_epilogue_compile_check.py) with the bf16 operands on the tensor cores
    (wgmma; fp32 in IEEE products, not TF32's, off them), TMA's copies where asked for, within the shared memory
    (compile_for_hopper), no register spilled."""
    out = run_compile_script("gemm_epilogue_compile_check.py")
    for dim in (3584, 5120):
        for config in probe.CONFIGS:
            for row_stats in (False, True):
                for tma in (False, True):
                    assert re.search(rf"compiled gemm D={dim} {config} row_stats={row_stats} tma={tma} registers=\d+ "
                                     rf"spill_bytes=0 wgmma=True tma_copies={tma}\n", out), out
    for (size, softcap), config in LOSS_CONFIGS.items():  # with the soft-cap, with a bias too (the most registers)
        dtype = {2: "bf16", 4: "fp32"}[size]
        assert re.search(rf"compiled loss gemm {dtype} {config} bias={softcap} softcap={softcap} registers=\d+ "
                         rf"spill_bytes=0 wgmma={dtype == 'bf16'} tma_copies=False\n", out), out
    tiles = sorted({tile_count(152064, config) for config in (*probe.CONFIGS, *LOSS_CONFIGS.values())})
    combined = re.findall(r"compiled combine tiles=(\d+) softcap=(\w+) registers=\d+ spill_bytes=0 ", out)
    assert combined == [(str(count), softcap) for count in tiles for softcap in ("False", "True")], out
