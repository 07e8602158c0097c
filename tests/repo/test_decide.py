"""bench.decide on lease folders built from the H200 lease of 2026-11-27 at e17ad62 (bench/measured/: its
bench.jsonl, summary.md and kernel-tests.log), with the inputs that lease predates written in, as the code writes
them: the candidates' bench 1 rows (erpo-geom-*, erpo-dh32, erpo-epi, erpo-epi-*: copies of erpo's row at their
ratio, not measurements), both probes' pick lines, test_dhidden_rounding's reports, and a kernel tier of today's
command. Each rule's change and keep, a failed check, a missing input, one shape only, a rounding failure that forces
fp32, the rules' interaction, the kernel tier's order and limits, and the real folder as it is."""
import ast
import json
import shlex
from dataclasses import dataclass

import pytest

from bench import decide, gpu_check
from bench.epilogue_pick import SUMMARY_LABEL as EPILOGUE_LABEL
from bench.probe_pick import SUMMARY_LABEL as GEOMETRY_LABEL
from bench.problem import SHAPES

REPO = decide.REPO
MEASURED = REPO / "bench/measured/h200-2026-11-27-e17ad62"
N = 16384
GEOMETRY = "erpo-geom-256-2304"
EPILOGUE = "erpo-epi-128x128x64-w4-s4-persistent132-tma"
MEASURED_NONE = ("none: 'chunk rows 256' (erpo-geom-256-2816), fwd+bwd median over the library default's qwen2.5-7b "
                 "0.990, qwen2.5-32b 1.010, sum 2.000, the lowest of 5 geometry variants, not faster than the library "
                 "default on every shape")
WINS, LOSES = (0.97, 0.98), (0.97, 1.02)


def bench_rows(candidates: dict) -> str:
    """The real bench.jsonl with, after erpo's row of each case, a row of each candidate: {key: (7b, 32b)}, each a
    ratio to erpo's fwd+bwd (its row "ok"), a status ("wrong", "error", "not reached") or None (no row there)."""
    lines = []
    for line in (MEASURED / "bench.jsonl").read_text().splitlines():
        lines.append(line)
        row = json.loads(line).get("row")
        if not row or row["contender"] != "erpo":
            continue
        for key, by_shape in candidates.items():
            value = by_shape[list(SHAPES).index(row["shape"])]
            if value is None:
                continue
            copy = {**row, "contender": key, "ours": False}
            if isinstance(value, float):
                copy["fwdbwd_ms"] = row["fwdbwd_ms"] * value
            elif value == "wrong":
                copy.update(status="wrong", correct=False, fwdbwd_ms=None, check_failures=["weight: 0.31 > 0.02"])
            else:
                copy.update(status=value, correct=None, fwdbwd_ms=None, detail="CUDA error: an illegal memory access")
            lines.append(json.dumps({"row": copy}))
    return "\n".join(lines) + "\n"


def rounding_report(shape: str, reduction: str, path: str, beyond: int = 0, control: int = 0) -> str:
    """A case's report as test_dhidden_rounding.py formats it (`RoundingCheck`, its `report`)."""
    elements = {"64x896": 64 * 896}.get(shape, int(shape.split("x")[0]) * 3584)
    check = "max {} ulp, {} of {} beyond the bound (worst {:.2f} of it)"
    ours = check.format(3 if beyond else 1, beyond, elements, 1.5 if beyond else 0.5)
    return (f"{shape} rows x D, {reduction}, {path}: d hidden {ours}; "
            f"the fp32 GEMM rounded once {check.format(1, control, elements, 1.2 if control else 0.5)}; "
            "allow_bf16_reduced_precision_reduction=True, split_k=True, blas=Cublas, torch 2.11.0+cu130, NVIDIA H200")


def rounding_lines(failing: dict) -> list:
    """The warnings summary's RoundingReport lines of every passing case and, for each case of `failing` ({(shape,
    reduction, path): (beyond, control beyond)}, or a message: failed without its report), its traceback's message
    and FAILED line."""
    lines = []
    for shape, reduction, path in decide._rounding_case_keys():
        test = f"tests/kernels/test_dhidden_rounding.py::test_dhidden_is_the_fp32_product_rounded_once[{shape}-" \
               f"{reduction}-{path}]"
        outcome = failing.get((shape, reduction, path), (0, 0))
        if isinstance(outcome, str):
            lines.append(f"FAILED {test} - {outcome}")
            continue
        beyond, control = outcome
        report = rounding_report(shape, reduction, path, beyond, control)
        if beyond or control:
            lines += [f"E   AssertionError: {report}", f"E   assert ({beyond}, {control}) == (0, 0)",
                      f"FAILED {test} - AssertionError: {report}"[:300]]  # cut at the log's width: COLUMNS=300
        else:
            lines += [test, f"  /root/tests/kernels/test_dhidden_rounding.py:281: RoundingReport: {report}",
                      "    warnings.warn(RoundingReport(report))", ""]
    return lines


CPU_ONLY_FILES = ("test_bench_smoke.py", "test_compile_hopper.py", "test_host_cost.py")


def todays_tier(seconds: float = 95.0, stopped: bool = False, extra: tuple = ()) -> list:
    """The real kernel-tests.log as today's tier writes it: gpu_check's command (`-m 'not cpu_only'`, its files),
    the real durations but the cpu_only files' (which it leaves out), every collected test run in `seconds` (or
    stopped by the session timeout, 5 left), no failure; `extra` lines before the result."""
    command = ["python3", "-m", "pytest", "-rfE", "--tb=short", "-p", "no:cacheprovider", "--durations=0",
               "--durations-min=1", "-m", gpu_check.KERNEL_MARKS, "-n", "10", "--dist", "loadfile",
               "--no-loadscope-reorder", *gpu_check.kernel_files()]
    kept = [line for line in (MEASURED / "kernel-tests.log").read_text().splitlines()[1:]
            if not line.startswith(("FAILED", "!!!", "=====", "12 workers")) and not any(
                f"tests/kernels/{name}" in line for name in CPU_ONLY_FILES)]
    ran = 1000 - (5 if stopped else 0)
    return [f"$ {shlex.join(command)}", "10 workers [1000 items]", *kept, *extra,
            *(["!!!! xdist.dsession.Interrupted: session-timeout: 100.0 sec exceeded !!!!"] if stopped else []),
            f"===== {ran - 2} passed, 2 skipped, 3 warnings in {seconds:.2f}s (0:01:35) ====="]


@dataclass
class Lease:
    """What a synthetic lease folder holds (`write`)."""

    candidates: dict
    geometry_pick: str | None = None
    epilogue_pick: str | None = None
    rounding: dict | None = None  # failing cases (rounding_lines); None: no report at all
    tier: list | None = None      # the kernel log's lines; None: the real e17ad62 log

    def write(self, folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "bench.jsonl").write_text(bench_rows(self.candidates))
        summary = (MEASURED / "summary.md").read_text().splitlines()
        summary += [f"- {label}: {pick}" for label, pick in ((GEOMETRY_LABEL, self.geometry_pick),
                                                              (EPILOGUE_LABEL, self.epilogue_pick)) if pick]
        (folder / "summary.md").write_text("\n".join(summary) + "\n")
        log = self.tier if self.tier is not None else (MEASURED / "kernel-tests.log").read_text().splitlines()
        if self.rounding is not None:  # in the warnings summary, before the durations and the result
            log = log[:-3] + rounding_lines(self.rounding) + log[-3:]
        (folder / "kernel-tests.log").write_text("\n".join(log) + "\n")
        return folder


def decisions(folder) -> dict:
    """{title: (verdict, the decision's lines)} of decide's output on `folder`."""
    found, title = {}, None
    for line in decide.decide([folder]):
        if line.startswith("### "):
            named, _, verdict = line[4:].rpartition(": **")
            title = named or verdict  # "Together" has no verdict
            found[title] = (verdict.strip("*") if named else "", [])
        elif title and line:
            found[title][1].append(line)
    return found


def verdict(folder, rule: str) -> tuple:
    """(verdict, text) of the decision whose title starts with `rule`."""
    ((found, lines),) = [value for title, value in decisions(folder).items() if title.startswith(rule)]
    return found, "\n".join(lines)


# ---- the probe's pick ----------------------------------------------------------------------------------------------

def test_a_geometry_faster_at_both_shapes_changes_the_chunk_rows_and_the_group(tmp_path):
    folder = Lease({GEOMETRY: WINS}, geometry_pick=f"{GEOMETRY}: faster than the library default").write(tmp_path)
    found, text = verdict(folder, "Chunk geometry")
    assert found == "change"
    assert ("qwen2.5-7b N=16384 (bench run 1): erpo-geom-256-2304 93.08 ms fwd+bwd, erpo 95.96 ms, ours faster by "
            "0.970") in text
    assert "- edit: `erpo_kernels/fused_linear_loss.py`: `LOGITS_ROWS = 512` -> `LOGITS_ROWS = 256`" in text
    assert "- edit: `erpo_kernels/fused_linear_loss.py`: `GROUP_ROWS = None` -> `GROUP_ROWS = 2304`" in text


@pytest.mark.parametrize("by_shape, expected, why", [
    (LOSES, "keep", "qwen2.5-32b N=16384 (bench run 1): erpo-geom-256-2304 132.86 ms"),
    ((0.97, "wrong"), "keep", "qwen2.5-32b N=16384: erpo-geom-256-2304 failed its full-size check"),
    ((0.97, None), "cannot decide", "qwen2.5-32b N=16384: no erpo-geom-256-2304 row in bench.jsonl"),
    ((0.97, "not reached"), "cannot decide", "qwen2.5-32b N=16384: erpo-geom-256-2304 not reached"),
    (("error", 1.01), "keep", "erpo-geom-256-2304 131.55 ms"),  # measured slower at 32b: no 7b row can make it win
])
def test_a_geometry_that_loses_fails_or_is_missing_at_one_shape_never_changes(tmp_path, by_shape, expected, why):
    folder = Lease({GEOMETRY: by_shape}).write(tmp_path)
    found, text = verdict(folder, "Chunk geometry")
    assert found == expected and "- edit:" not in text
    assert why in text.split("- verdict:")[1]


@pytest.mark.parametrize("pick, expected", [(MEASURED_NONE, "keep"), ("none: the probe failed", "cannot decide"),
                                            (None, "cannot decide")])
def test_without_a_geometry_row_only_a_measured_none_keeps(tmp_path, pick, expected):
    assert verdict(Lease({}, geometry_pick=pick).write(tmp_path), "Chunk geometry")[0] == expected


# ---- d hidden's dtype ----------------------------------------------------------------------------------------------

def test_a_rounding_failure_with_fp32_passing_forces_fp32_whatever_it_costs(tmp_path):
    case = ("2048x3584", "default", decide.AS_HIDDEN)
    folder = Lease({"erpo-dh32": (1.05, 1.06)}, rounding={case: (17, 0)}).write(tmp_path)
    found, text = verdict(folder, "d hidden")
    assert found == "change" and "accuracy first" in text
    assert "2048x3584 default: dhidden-as-hidden FAILED, dhidden-fp32 passed" in text
    assert "17 of 7340032 beyond the bound" in text  # the assertion's message, read from the traceback
    assert "`erpo_kernels/fused_linear_loss.py`: `GRAD_HIDDEN_FP32 = False` -> `GRAD_HIDDEN_FP32 = True`" in text


@pytest.mark.parametrize("ratios, rounding, expected", [
    ((1.005, 1.01), {}, "change"),      # at most 1 % slower at both shapes
    ((1.005, 1.02), {}, "keep"),        # 2 % slower at 32b, and no case needs fp32
    ((0.99, None), {}, "cannot decide"),  # one shape only
    ((1.005, 1.02), None, "cannot decide"),  # slower, but the rounding cases are not in the log
    # the control failed: the bound is wrong for this GPU, so the failing d hidden says nothing
    ((1.005, 1.02), {("512x3584", "default", decide.AS_HIDDEN): (4, 3)}, "cannot decide"),
    # the fp32 path fails too: fp32 does not fix that case
    ((1.005, 1.02), {("512x3584", "default", decide.AS_HIDDEN): (4, 0), ("512x3584", "default", decide.FP32): (2, 0)},
     "keep"),
])
def test_fp32_d_hidden_by_its_cost_when_no_case_needs_it(tmp_path, ratios, rounding, expected):
    found, text = verdict(Lease({"erpo-dh32": ratios}, rounding=rounding).write(tmp_path), "d hidden")
    assert found == expected
    assert ("- edit:" in text) == (expected == "change")


def test_a_case_failed_without_its_report_is_not_a_rounding_failure(tmp_path):
    """A timeout leaves only its FAILED line: the case is named, and says nothing about d hidden."""
    timeout = {("64x896", "default", decide.AS_HIDDEN): "Failed: Timeout (>40.0s) from pytest-timeout."}
    folder = Lease({"erpo-dh32": LOSES}, rounding=timeout).write(tmp_path)
    found, text = verdict(folder, "d hidden")
    assert found == "cannot decide"
    assert "64x896 default: dhidden-as-hidden failed without its report, dhidden-fp32 passed" in text


# ---- the epilogue row pass and the epilogue probe's pick ----------------------------------------------------------

def test_erpo_epi_faster_at_both_shapes_turns_the_option_on_and_a_measured_none_keeps_the_config(tmp_path):
    pick = MEASURED_NONE.replace("library default", "library's")
    folder = Lease({"erpo-epi": WINS}, epilogue_pick=pick).write(tmp_path)
    found, text = verdict(folder, "The epilogue row pass")
    assert found == "change"
    assert "`EPILOGUE_ROW_PASS = False` -> `EPILOGUE_ROW_PASS = True`" in text
    assert verdict(folder, "The epilogue GEMM")[0] == "keep"


def names_defined_before(file: str, name: str) -> set:
    """The module-level names that `file` (a path from the repository's root) binds before its assignment of
    `name`: imports, classes, functions and constants, as pasted code there could use them."""
    defined = set()
    for statement in ast.parse((REPO / file).read_text()).body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in statement.names}
        elif isinstance(statement, (ast.ClassDef, ast.FunctionDef)):
            defined.add(statement.name)
        else:
            targets = getattr(statement, "targets", [getattr(statement, "target", None)])
            bound = {target.id for target in targets if isinstance(target, ast.Name)}
            if name in bound:
                return defined
            defined |= bound
    raise AssertionError(f"{file} assigns no {name}")


def test_the_pick_s_rows_decide_the_option_and_the_config_and_launch_together(tmp_path):
    folder = Lease({EPILOGUE: WINS}, epilogue_pick=f"{EPILOGUE}: faster than the library's").write(tmp_path)
    assert verdict(folder, "The epilogue row pass")[0] == "change"
    found, text = verdict(folder, "The epilogue GEMM")
    assert found == "change"
    assert ("`LOSS_CONFIGS[(2, False)] = GemmConfig(128, 256, 64, 8, 3)` -> `LOSS_CONFIGS[(2, False)] = "
            "GemmConfig(128, 128, 64, 4, 4)`") in text
    assert ("`LOSS_LAUNCH = Launch()` -> `LOSS_LAUNCH = Launch(DEVICE_SMS, True)` (DEVICE_SMS: one program per SM "
            "of the device each call runs on; the lease's 132; test it with --fused-options "
            "erpo-epi-128x128x64-w4-s4-persistentsm-tma)") in text
    # pasteable as it is: the new value names only what the module binds before LOSS_LAUNCH
    new = text.split("`LOSS_LAUNCH = ")[-1].split("`")[0]
    used = {node.id for node in ast.walk(ast.parse(new, mode="eval")) if isinstance(node, ast.Name)}
    assert used == {"Launch", "DEVICE_SMS"} and used <= names_defined_before(decide.LOGITS_GEMM, "LOSS_LAUNCH")
    folder = Lease({EPILOGUE: LOSES}, epilogue_pick=f"{EPILOGUE}: faster").write(tmp_path / "loses")
    assert verdict(folder, "The epilogue row pass")[0] == verdict(folder, "The epilogue GEMM")[0] == "keep"
    assert "- edit:" not in verdict(folder, "The epilogue GEMM")[1]


@pytest.mark.parametrize("by_shape", [("error", 0.9), (0.9, None)])
def test_erpo_epi_errored_or_missing_at_one_shape_cannot_decide(tmp_path, by_shape):
    found, text = verdict(Lease({"erpo-epi": by_shape}).write(tmp_path), "The epilogue row pass")
    assert found == "cannot decide" and "qwen2.5-" in text.split("- verdict:")[1]


def test_the_epilogue_probe_s_answers_are_read_where_its_json_is(tmp_path):
    folder = Lease({"erpo-epi": LOSES}).write(tmp_path / "out")
    probe = tmp_path / "work" / "epilogue-probe"
    probe.mkdir(parents=True)
    pair = {"config": "128x256x64 w8 s3", "launch": "grouped", "ms": 1.30, "base_ms": 1.20, "ratio": 1.30 / 1.20}
    (probe / "gemm_epilogue_probe.json").write_text(json.dumps({"chunks": [
        {"shape": "qwen2.5-7b", "rows": 512, "answer": {"d": None, "c": pair}}]}))
    text = "\n".join(decide.decide([folder, tmp_path / "work"]))
    assert ("gemm_epilogue_probe.json, qwen2.5-7b 512 rows: best (c) 128x256x64 w8 s3, grouped 1.300 ms against (a) "
            "1.200 ms (1.083x)") in text
    assert "gemm_epilogue_probe.json, qwen2.5-7b 512 rows: no passing (d) or (b)" in text


# ---- the rules together --------------------------------------------------------------------------------------------

def test_two_options_that_each_won_alone_are_open_together(tmp_path):
    folder = Lease({GEOMETRY: WINS, "erpo-epi": WINS, "erpo-dh32": LOSES}, rounding={}).write(tmp_path)
    together = decisions(folder)["Together"][1]
    assert together[0].startswith("- **open**: Chunk geometry (the probe's pick), The epilogue row pass "
                                  "(EPILOGUE_ROW_PASS) each won alone")
    assert "the geometry changes the rows its GEMMs run at" in together[1]
    forced = {("2048x3584", "default", decide.AS_HIDDEN): (17, 0)}
    folder = Lease({GEOMETRY: WINS, "erpo-dh32": LOSES}, rounding=forced).write(tmp_path / "forced")
    assert decisions(folder)["d hidden's dtype (GRAD_HIDDEN_FP32)"][0] == "change"
    together = decisions(folder)["Together"][1]
    assert together[0].startswith("- d hidden's fp32 comes from the accuracy branch") and together[1].startswith(
        "- no two")
    folder = Lease({GEOMETRY: WINS, "erpo-epi": LOSES}).write(tmp_path / "one")
    assert decisions(folder)["Together"][1][0].startswith("- no two")


# ---- the kernel tier -----------------------------------------------------------------------------------------------

def test_the_tier_s_durations_set_its_file_order_and_limits(tmp_path):
    folder = Lease({}, tier=todays_tier(95.0)).write(tmp_path)
    found, text = verdict(folder, "Kernel tier: file order")
    assert found == "change"  # from the real durations less the cpu_only files
    first = ("test_objective_kernels.py", "test_logits_loss_node.py", "test_fused_linear_loss.py", "test_compile.py",
             "test_padded.py", "test_triton_logits.py", "test_input_errors.py", "test_pipelined_chunks.py",
             "test_logit_transforms.py")
    assert f"`KERNEL_FILES_FIRST = {first!r}`" in text
    assert "test_objective_kernels.py 67.8 s" in text
    found, text = verdict(folder, "Kernel tier: session")
    assert found == "change"
    assert "- edit: `bench/gpu_check.py`: `KERNEL_SESSION_S = 100` -> `KERNEL_SESSION_S = 115`" in text
    assert "KERNEL_TEST_TIMEOUT_S" not in text.split("- verdict:")[1].split("- edit:", 1)[-1]  # 16.5 s: 40 s stays
    assert "KERNEL_LIMIT_S follows: 115 + 40 + 20 = 175 s" in text
    slow = ["45.00s call     tests/kernels/test_padded.py::test_slow"]
    found, text = verdict(Lease({}, tier=todays_tier(79.0, extra=slow)).write(tmp_path / "slow"), "Kernel tier: s")
    assert "`KERNEL_SESSION_S = 100` -> `KERNEL_SESSION_S = 95`" in text
    assert "`KERNEL_TEST_TIMEOUT_S = 40` -> `KERNEL_TEST_TIMEOUT_S = 55`" in text


@pytest.mark.parametrize("tier, why", [
    (todays_tier(stopped=True), "5 collected tests did not run"),
    (todays_tier(extra=["FAILED tests/kernels/test_padded.py::test_x - Failed: Timeout (>40.0s) from pytest-timeout."]),
     "1 tests stopped at the test's limit"),
])
def test_a_tier_that_did_not_finish_or_hit_a_test_s_limit_sets_no_limit(tmp_path, tier, why):
    found, text = verdict(Lease({}, tier=tier).write(tmp_path), "Kernel tier: session")
    assert found == "cannot decide" and why in text


# ---- the real lease, and the module's ties to what it reads --------------------------------------------------------

def test_the_e17ad62_lease_predates_the_new_contenders_and_its_tier_is_not_today_s():
    found = decisions(MEASURED)
    assert {title: value[0] for title, value in found.items()} == {
        "Chunk geometry (the probe's pick)": "cannot decide", "d hidden's dtype (GRAD_HIDDEN_FP32)": "cannot decide",
        "The epilogue row pass (EPILOGUE_ROW_PASS)": "cannot decide",
        "The epilogue GEMM's config and launch (the epilogue probe's pick)": "cannot decide",
        "Kernel tier: file order (KERNEL_FILES_FIRST)": "cannot decide",
        "Kernel tier: session and limits (KERNEL_SESSION_S, KERNEL_TEST_TIMEOUT_S)": "cannot decide",
        "Together": ""}
    order = "\n".join(found["Kernel tier: file order (KERNEL_FILES_FIRST)"][1])
    assert "test_bench_smoke.py 132.0 s, test_compile_hopper.py 121.9 s" in order
    assert "no `-m 'not cpu_only'`" in order


def test_gpu_check_s_summary_gets_the_decisions_even_when_deciding_fails(tmp_path, monkeypatch):
    def broken(folders):
        raise KeyError("LOGITS_ROWS")
    monkeypatch.setattr(decide, "decide", broken)
    assert decide.decision_lines([tmp_path]) == [
        "## Decisions", "", "- bench.decide failed (KeyError: 'LOGITS_ROWS'); run `python -m bench.decide DIR` on the "
        "lease's folder", ""]


def test_the_command_line_prints_the_decisions_and_refuses_a_missing_folder(tmp_path, capsys):
    assert decide.main([str(MEASURED)]) == 0
    assert capsys.readouterr().out.startswith("## Decisions")
    with pytest.raises(SystemExit) as stop:
        decide.main([str(tmp_path / "nowhere")])
    assert stop.value.code == 2
    assert "nowhere: no such folder; give the folder of a lease's files" in capsys.readouterr().err


def test_the_shapes_and_the_rounding_report_are_those_the_code_writes():
    """decide's "both shapes" are bench 1's and the probes'; the report it parses is the one test_dhidden_rounding
    formats (its RoundingCheck run from its source: the tiers import no test module of another)."""
    assert decide.RULE_SHAPES == tuple(SHAPES) == tuple(gpu_check.PROBE_SHAPES.split(","))
    source = (REPO / decide.ROUNDING_TEST).read_text()
    assert ('report = (f"{shape} rows x D, {reduction}, {path}: d hidden {ours}; the fp32 GEMM rounded once {control}; '
            '"') in source
    (check_class,) = [node for node in ast.parse(source).body if getattr(node, "name", "") == "RoundingCheck"]
    namespace = {"dataclass": dataclass}
    exec(compile(ast.Module([check_class], []), "RoundingCheck", "exec"), namespace)
    check = str(namespace["RoundingCheck"](3.0, 17, 7340032, 1.5))
    found = decide.ROUNDING_REPORT.fullmatch(f"2048x3584 rows x D, default, dhidden-as-hidden: d hidden {check}; the "
                                             f"fp32 GEMM rounded once {check}")
    assert found and (found[5], found[9]) == ("17", "17")
