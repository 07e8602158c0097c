"""The bench's geometry contenders (`erpo-geom-ROWS[-GROUP]`, bench.geometry): their keys and the one-line refusal of
a malformed one, their chunk and group rows set around every call of the contender in a bench run (its check,
timing and peak memory) and put back after it, also when a call fails, and ours' loss and gradients under that other
geometry, checked with ours' tolerance and against ours with the library's geometry; and `erpo-dh32`, ours with
d hidden held in fp32 (`fused_linear_loss.GRAD_HIDDEN_FP32`, set the same way); and the epilogue contenders
(`erpo-epi-BMxBNxBK-wW-sS[-persistentP|-persistentsm][-tma]`, gpu_check's pick for erpo-epi's place): the config
and launch their key names reach the epilogue GEMM in each of their calls, and the library's are back after the run."""
import pytest
import torch

import erpo_kernels
from bench import geometry
from bench.__main__ import main as bench_main
from bench.check import OURS
from bench.contenders import CONTENDER_KEYS, ERPO_OPTIONS, select
from bench.geometry import EpilogueLaunch, Geometry, epilogue_key, geometry_key, parse_epilogue_key, parse_geometry_key
from bench.problem import SMOKE_SHAPE, build_problem
from bench.run import BenchConfig, run_benchmark
from erpo_kernels import fused_linear_loss
from erpo_kernels import triton_logits_gemm as gemm

KEY = "erpo-geom-16-32"  # chunks of 16 rows, groups of 32: 4 chunks and 2 groups in the 64 rows below
KEY_KNOBS = (16, 32)
ROWS, PER_SAMPLE = 64, 32


def knobs() -> tuple:
    return fused_linear_loss.LOGITS_ROWS, fused_linear_loss.GROUP_ROWS


@pytest.mark.parametrize("key, geometry", [("erpo-geom-256-2304", Geometry(256, 2304)),
                                           ("erpo-geom-384", Geometry(384, None))])
def test_a_geometry_key_names_its_chunk_and_group_rows(key, geometry):
    assert parse_geometry_key(key) == geometry and geometry_key(geometry) == key
    (contender,) = select(["erpo-ws2g", key], ["fused"])[1:]  # after the fixed contenders: each case's last row
    assert (contender.key, contender.path, contender.ours, contender.held_to_ours) == (key, "fused", False, True)
    assert f"LOGITS_ROWS={geometry.rows}" in contender.label
    assert select([key], ["logits"]) == []  # a fused-path contender


def test_every_variant_of_ours_and_no_peer_is_held_to_ours_tolerance():
    held = {(c.path, c.key): c.held_to_ours for c in select(list(CONTENDER_KEYS), ["logits", "fused"])}
    assert held[("fused", "erpo-ws2g")] and held[("fused", "erpo-invariant")] and held[("logits", "erpo-log2")]
    assert held[("fused", "erpo-dh32")] and held[("fused", "erpo-epi")]
    assert not any(held[(path, key)] for path, key in held if key in ("torch", "compile", "liger", "cce"))


# (key, kind, form): malformed geometry and epilogue keys, the kind of contender their prefix means, their form
MALFORMED_KEYS = (
    [(key, "geometry", "erpo-geom-ROWS-GROUP") for key in (
        "erpo-geom-", "erpo-geom-256-", "erpo-geom-0-512", "erpo-geom-256-1000", "erpo-geom-two",
        "erpo-geom-256-2304-1", "erpo-geom-0256")]
    + [(key, "epilogue", "erpo-epi-BMxBNxBK-wW-sS[-persistentP|-persistentsm][-tma]") for key in (
        "erpo-epi-", "erpo-epi-128x256x64-w8", "erpo-epi-96x256x64-w8-s3", "erpo-epi-128x256x64-w6-s3",
        "erpo-epi-128x256x64-w8-s0", "erpo-epi-128x256x64-w8-s3-persistent0",
        "erpo-epi-128x256x64-w8-s3-tma-persistent4", "erpo-epi-128x256x64-w8-s3-TMA",
        "erpo-epi-128x256x64-w8-s3-persistentSM", "erpo-epi-128x256x64-w8-s3-persistentsms")])


@pytest.mark.parametrize("key, kind, form", MALFORMED_KEYS)
def test_a_malformed_contender_key_is_one_line_naming_it_and_the_form(key, kind, form):
    with pytest.raises(ValueError) as error:
        select(["erpo", key], ["fused"])
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"--contenders: {key!r} is no {kind} contender; expected ")
    assert form in message
    for option in ("--contenders", "--skip"):  # the bench's command line: its one line, before any run
        with pytest.raises(SystemExit, match=f"^{option}: '{key}' is no {kind} contender"):
            bench_main(["--smoke", option, key, "--plan"])


def test_a_key_of_no_rule_is_refused_with_the_known_keys_and_both_forms():
    with pytest.raises(ValueError, match=r"^--contenders: unknown \['erpo-epilogue'\]; known: \[.*\] and "
                                         r"erpo-geom-ROWS .* and erpo-epi-BMxBNxBK"):
        select(["erpo", "erpo-epilogue"], ["fused"])


def _config(keys, dtype=torch.bfloat16, reps=1) -> BenchConfig:
    return BenchConfig(shapes=[SMOKE_SHAPE], ns=[ROWS], paths=["fused"], contenders=select(keys, ["fused"]),
                       device=torch.device("cpu"), dtype=dtype, reps=reps, warmup=0, rows_per_sample=PER_SAMPLE,
                       query_frac=0.25, check_rows=ROWS, budget_s=1.0, time_wrong=False, seed=0)


@pytest.fixture
def calls(monkeypatch):
    """The knobs each call of the fused loss saw, in order."""
    seen = []
    loss = erpo_kernels.fused_linear_erpo_loss

    def recording(*args, **kwargs):
        seen.append(knobs())
        return loss(*args, **kwargs)
    monkeypatch.setattr(erpo_kernels, "fused_linear_erpo_loss", recording)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the contender's requirement on the CPU
    return seen


@pytest.mark.cpu_only  # ours in Triton's interpreter on the CPU on any machine (pytest.ini)
def test_every_call_of_a_bench_run_has_the_geometry_and_then_the_library_s_again(calls):
    library = knobs()
    rows = run_benchmark(_config(["erpo", KEY], reps=2), log=lambda text: None)["rows"]
    assert knobs() == library
    assert [(row["contender"], row["status"], row["correct"]) for row in rows] == [("erpo", "ok", True),
                                                                                 (KEY, "ok", True)]
    assert rows[1]["tolerance"] == rows[0]["tolerance"] == {"loss_atol": OURS.loss_atol, "loss_rtol": OURS.loss_rtol,
                                                            "grad_rtol": OURS.grad_rtol}
    geometry = KEY_KNOBS
    # each one's check, then their timed calls in turns (bench.timing.time_in_turns), each under its own knobs: a
    # round is erpo's fwd and fwd+bwd, then the contender's (no warm-up here; no peak memory off CUDA)
    assert calls == [library, geometry] + [library, library, geometry, geometry] * 2
    assert [row["timed_with"] for row in rows] == [["erpo", KEY]] * 2
    assert [(row["fwd_reps"], len(row["fwdbwd_samples_ms"])) for row in rows] == [(2, 2)] * 2


@pytest.mark.cpu_only  # ours in Triton's interpreter on the CPU on any machine (pytest.ini)
@pytest.mark.parametrize("key,constant", [("erpo-dh32", "GRAD_HIDDEN_FP32"), ("erpo-epi", "EPILOGUE_ROW_PASS")])
def test_a_constant_contender_is_ours_with_the_constant_on_for_its_calls_alone(key, constant, monkeypatch):
    """erpo-dh32 (d hidden held in fp32) and erpo-epi (the row pass in the logits GEMM's epilogue) in a bf16 bench
    run: their fused_linear_loss constant on for each of its calls (its check, its fwd and fwd+bwd) and off again
    after the run (ours' calls beside it run as the geometry's test above shows); its row correct within ours'
    tolerance."""
    monkeypatch.setattr(fused_linear_loss, constant, False)  # off before the run, whatever a session's --fused-options
    seen = []
    loss = erpo_kernels.fused_linear_erpo_loss

    def recording(*args, **kwargs):
        seen.append(getattr(fused_linear_loss, constant))
        return loss(*args, **kwargs)
    monkeypatch.setattr(erpo_kernels, "fused_linear_erpo_loss", recording)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the contender's requirement on the CPU
    (contender,) = select([key], ["fused"])
    assert (contender.ours, contender.held_to_ours, f"{constant}=True" in contender.label) == (False, True, True)
    (row,) = run_benchmark(_config([key]), log=lambda text: None)["rows"]
    assert getattr(fused_linear_loss, constant) is False
    assert (row["contender"], row["status"], row["correct"]) == (key, "ok", True)
    assert row["tolerance"] == {"loss_atol": OURS.loss_atol, "loss_rtol": OURS.loss_rtol, "grad_rtol": OURS.grad_rtol}
    assert seen == [True] * 3  # its check, then its fwd and its fwd+bwd
    # the dtype its d hidden was held in, beside the inputs' (bench.report's memory budget target reads both)
    # (erpo-epi's: the session's GRAD_HIDDEN_FP32, which --fused-options may set)
    held = "float32" if key == "erpo-dh32" or fused_linear_loss.GRAD_HIDDEN_FP32 else "bfloat16"
    assert (row["dtype"], row["grad_hidden_dtype"]) == ("bfloat16", held)


@pytest.mark.cpu_only  # ours in Triton's interpreter on the CPU on any machine (pytest.ini)
def test_the_knobs_are_put_back_when_a_call_fails(calls, monkeypatch):
    library = knobs()

    def failing(*args, **kwargs):
        calls.append(knobs())
        raise RuntimeError("a call of the contender failed")
    monkeypatch.setattr(erpo_kernels, "fused_linear_erpo_loss", failing)
    (row,) = run_benchmark(_config([KEY]), log=lambda text: None)["rows"]
    assert row["status"] == "error" and "a call of the contender failed" in row["detail"]
    assert calls == [KEY_KNOBS] and knobs() == library

    class Stopped(BaseException):
        """Not a result the bench reports: it leaves the run."""

    def stopping(*args, **kwargs):
        raise Stopped()
    monkeypatch.setattr(erpo_kernels, "fused_linear_erpo_loss", stopping)
    with pytest.raises(Stopped):
        run_benchmark(_config([KEY]), log=lambda text: None)
    assert knobs() == library


@pytest.mark.cpu_only  # ours in Triton's interpreter on the CPU on any machine (pytest.ini)
def test_ours_under_the_geometry_gives_ours_loss_and_gradients(monkeypatch):
    """Same math, other chunks: in fp32 the loss and gradients of the geometry's chunks and groups (whose plan the
    knobs reach) equal ours in one chunk up to the sums' order."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # ours in one chunk (whatever a session's --fused-options geometry): chunks of ROWS rows, no cap
    monkeypatch.setattr(fused_linear_loss, "LOGITS_ROWS", ROWS)
    monkeypatch.setattr(fused_linear_loss, "GROUP_ROWS", None)
    problem = build_problem("fused", SMOKE_SHAPE, ROWS, rows_per_sample=PER_SAMPLE, query_frac=0.25,
                            dtype=torch.float32, device=torch.device("cpu"), seed=0, chunk_rows=ROWS,
                            clip_low=ERPO_OPTIONS["clip_low"], clip_high=ERPO_OPTIONS["clip_high"])
    results = {}
    for contender in select(["erpo", KEY], ["fused"]):
        with contender.knobs():
            plan = fused_linear_loss.workspace_of(ROWS, problem.hidden, problem.weight,
                                                  fused_linear_loss.ROW_KERNELS["triton"],
                                                  fused_linear_loss.DEFAULT_WORKSPACE_BYTES, False)
            prepared = contender.prepare(problem)
            value = prepared.run()
            results[contender.key] = (plan.chunk_rows, plan.group_rows,
                                      (value.detach(), *torch.autograd.grad(value, prepared.inputs)))
    assert results["erpo"][:2] == (ROWS, ROWS) and results[KEY][:2] == KEY_KNOBS
    for ours, other in zip(results["erpo"][2], results[KEY][2]):
        torch.testing.assert_close(other, ours, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key, epilogue", [
    ("erpo-epi-128x256x64-w8-s3", EpilogueLaunch((128, 256, 64, 8, 3))),
    ("erpo-epi-64x128x64-w4-s4-persistent132-tma", EpilogueLaunch((64, 128, 64, 4, 4), 132, True)),
    ("erpo-epi-64x128x64-w4-s4-persistentsm-tma", EpilogueLaunch((64, 128, 64, 4, 4), gemm.DEVICE_SMS, True)),
    ("erpo-epi-256x128x64-w8-s3-tma", EpilogueLaunch((256, 128, 64, 8, 3), None, True))])
def test_an_epilogue_key_names_its_config_and_launch(key, epilogue):
    assert geometry.DEVICE_SMS == gemm.DEVICE_SMS  # the bench's copy of the library's sentinel (no Triton import)
    assert parse_epilogue_key(key) == epilogue and epilogue_key(epilogue) == key
    (contender,) = select(["erpo-epi", key], ["fused"])[1:]  # after the fixed contenders: each case's last row
    assert (contender.key, contender.path, contender.ours, contender.held_to_ours) == (key, "fused", False, True)
    assert "EPILOGUE_ROW_PASS=True" in contender.label and str(gemm.GemmConfig(*epilogue.config)) in contender.label
    assert contender.label.endswith(str(gemm.Launch(epilogue.programs, epilogue.tma)))
    assert select([key], ["logits"]) == []  # a fused-path contender


@pytest.mark.cpu_only  # ours in Triton's interpreter on the CPU on any machine (pytest.ini)
def test_an_epilogue_contender_runs_its_config_and_launch_in_each_of_its_calls(monkeypatch):
    """A bf16 bench run of erpo-epi-32x128x32-w4-s2-persistent5-tma (D = 64, V = 1000, 64 rows: 2 x 8 tiles on 5
    programs): every epilogue GEMM of its calls (its check, its fwd and fwd+bwd) at that config and launch with
    EPILOGUE_ROW_PASS on; the library's LOSS_CONFIGS, LOSS_LAUNCH and EPILOGUE_ROW_PASS back after the run; its row
    correct within ours' tolerance."""
    key = "erpo-epi-32x128x32-w4-s2-persistent5-tma"
    monkeypatch.setattr(fused_linear_loss, "EPILOGUE_ROW_PASS", False)  # whatever a session's --fused-options
    seen = []
    launcher = gemm.logits_gemm

    def recording(hidden, weight, logits, config, launch=gemm.Launch(), *args, **kwargs):
        seen.append((config, launch, fused_linear_loss.EPILOGUE_ROW_PASS))
        return launcher(hidden, weight, logits, config, launch, *args, **kwargs)
    monkeypatch.setattr(gemm, "logits_gemm", recording)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the contender's requirement on the CPU
    library = dict(gemm.LOSS_CONFIGS), gemm.LOSS_LAUNCH
    (row,) = run_benchmark(_config([key]), log=lambda text: None)["rows"]
    assert (dict(gemm.LOSS_CONFIGS), gemm.LOSS_LAUNCH) == library and fused_linear_loss.EPILOGUE_ROW_PASS is False
    assert (row["contender"], row["status"], row["correct"]) == (key, "ok", True), row.get("detail")
    assert row["tolerance"] == {"loss_atol": OURS.loss_atol, "loss_rtol": OURS.loss_rtol, "grad_rtol": OURS.grad_rtol}
    assert seen and set(seen) == {(gemm.GemmConfig(32, 128, 32, 4, 2), gemm.Launch(5, True), True)}
