"""`python -m bench.decide DIR [DIR ...]`: what a GPU lease's files say to change in the library, rule by rule
(issue 32). The rules are bench/README.md's, written before the lease: "The probe's pick", "Deciding d hidden's
dtype", "Deciding the epilogue row pass", "The epilogue probe's pick", and the kernel tier's time (its file order,
session and limits from its `--durations`: bench/gpu_check.py's KERNEL_* constants). For each rule it prints the
inputs it read, with their numbers, the verdict and, for a change, the exact edit (file, constant, value now and new).

The verdicts: **change** only where every input the rule's condition rests on is there and its condition holds
(at both lm_heads where the rule says both shapes); **keep** where a measured input fails the condition (a
contender slower than erpo, or its full-size check failed: the rules keep the library then); **cannot decide**
where an input is missing, not reached, errored or says nothing (the library stays as it is; the line says which
input and why). Each rule compares its option against erpo alone in bench 1; where two changes come out of one lease,
never timed together, "Together" says what the rules allow and leaves the combination open.

The inputs, each looked for by name in the folders given and one level down: bench.jsonl (bench 1's rows: each
candidate against erpo in the same run, at N = 16384), kernel-tests.log (the tier's command, result, failures,
durations, and test_dhidden_rounding.py's reports), summary.md (the stage table and both probes' picks), and, where
they are (gpu_check's work folder, which the device tool does not bring back), gemm_epilogue_probe.json and
fused_probe.json for the probes' own numbers. The constants' values now are read from the source (`ast`), nothing
imported: pure Python on files, cheap enough for gpu_check to run at its end ("Decisions" in summary.md).
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from . import epilogue_pick, probe_pick
from .geometry import DEVICE_SMS, epilogue_key, is_epilogue_key, is_geometry_key, parse_epilogue_key, parse_geometry_key
from .progress import read_runs
from .pytest_log import read_pytest_log
from .report import TARGET_ROWS

REPO = Path(__file__).resolve().parents[1]
FUSED_LOSS = "erpo_kernels/fused_linear_loss.py"
LOGITS_GEMM = "erpo_kernels/triton_logits_gemm.py"
GPU_CHECK = "bench/gpu_check.py"
ROUNDING_TEST = "tests/kernels/test_dhidden_rounding.py"
KERNEL_TIER = "tests/kernels/"
# "at both shapes": the rules' two lm_heads, bench 1's (bench.problem.SHAPES) and the probes' (gpu_check.PROBE_SHAPES)
RULE_SHAPES = ("qwen2.5-7b", "qwen2.5-32b")
DH32_MAX_RATIO = 1.01   # "Deciding d hidden's dtype": erpo-dh32 at most 1 % slower than erpo ("ours faster by" <= 1.01)
LIMIT_MARGIN = 1.2      # the stages' limits: the measured time "plus about a fifth" (bench/gpu_check.py)
LIMIT_STEP_S = 5        # a limit is rounded up to whole 5 s
FIRST_FILE_MIN_S = 15   # KERNEL_FILES_FIRST: the files of 15 s or more, so that none of them is left to end the tier
#                         (gpu_check's comment on test_logit_transforms.py)
CHANGE, KEEP, UNDECIDED = "change", "keep", "cannot decide"
# test_dhidden_rounding.py's report of one case (`RoundingCheck.__str__`, the `report` of
# test_dhidden_is_the_fp32_product_rounded_once): passing, a RoundingReport warning; failing, its assertion's message
_CHECK = r"max ([\w.]+) ulp, (\d+) of (\d+) beyond the bound \(worst ([\w.]+) of it\)"
ROUNDING_REPORT = re.compile(rf"(\S+) rows x D, ([\w-]+), (dhidden-[\w-]+): d hidden {_CHECK}; "
                             rf"the fp32 GEMM rounded once {_CHECK}")
ROUNDING_TEST_ID = re.compile(r"test_dhidden_is_the_fp32_product_rounded_once\[([^\]]+)\]")
AS_HIDDEN, FP32 = "dhidden-as-hidden", "dhidden-fp32"
ACCURACY_FIRST = "accuracy first"  # the why of d hidden's change where a rounding case forces fp32


@dataclass
class Edit:
    """One edit a change asks for: in `file`, `name` from `now` to `new` (source text), with a note where the edit
    needs more than the value."""

    file: str
    name: str
    now: str
    new: str
    note: str = ""

    def __str__(self) -> str:
        return f"`{self.file}`: `{self.name} = {self.now}` -> `{self.name} = {self.new}`" + (
            f" ({self.note})" if self.note else "")


@dataclass
class Decision:
    """One rule's outcome: its title and bench/README.md section, the inputs read (one line each), the verdict (CHANGE,
    KEEP or UNDECIDED), why, and the edits of a change."""

    title: str
    section: str
    inputs: list
    verdict: str
    why: str
    edits: list = field(default_factory=list)

    def lines(self) -> list:
        return ([f"### {self.title}: **{self.verdict}**", "", f"The rule: {self.section}.", ""]
                + [f"- read: {line}" for line in self.inputs] + [f"- verdict: {self.verdict}: {self.why}"]
                + [f"- edit: {edit}" for edit in self.edits] + [""])


class Outcome(NamedTuple):
    """A condition's outcome at one shape (or one case): state "met", "unmet" or "missing", and what was read."""

    state: str
    text: str


def combined(outcomes: list) -> str:
    """A condition that must hold on every one of `outcomes`: met if it holds on all, unmet if it fails on one that
    was measured (the rest cannot make it hold), missing otherwise."""
    states = {outcome.state for outcome in outcomes}
    return "met" if states == {"met"} else "unmet" if "unmet" in states else "missing"


# ---- the constants as the source has them now ---------------------------------------------------------------------

def _assigned(file: str, name: str) -> ast.expr:
    tree = ast.parse((REPO / file).read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return node.value
    raise KeyError(f"{name} is not assigned at the top of {file}")


def source_value(file: str, name: str):
    """The literal value of the module constant `name` in `file` (a path from the repository's root)."""
    return ast.literal_eval(_assigned(file, name))


def source_text(file: str, name: str, key=None) -> str:
    """The source text of the module constant `name` in `file`, or of its dict's entry at `key`."""
    value = _assigned(file, name)
    if key is not None:
        value = next(entry for entry_key, entry in zip(value.keys, value.values) if ast.literal_eval(entry_key) == key)
    return ast.unparse(value)


# ---- the lease's files ---------------------------------------------------------------------------------------------

class Lease:
    """A lease's files, each found by name in `folders` (in their order) or one level down."""

    def __init__(self, folders: list):
        self.folders = [Path(folder) for folder in folders]
        progress = self.find("bench.jsonl")
        self.runs, self.runs_note = [], "bench.jsonl: not found"
        if progress is not None:
            try:
                self.runs = read_runs(progress)
                self.runs_note = f"bench.jsonl: bench runs {len(self.runs)}"
            except (ValueError, KeyError) as error:
                self.runs_note = f"bench.jsonl: unreadable ({error})"
        summary = self.find("summary.md")
        self.summary = [] if summary is None else summary.read_text(encoding="utf-8", errors="replace").splitlines()
        log = self.find("kernel-tests.log")
        self.kernel_log = None if log is None else log.read_text(encoding="utf-8", errors="replace").splitlines()

    def find(self, name: str) -> Optional[Path]:
        for folder in self.folders:
            for path in (folder / name, *sorted(folder.glob(f"*/{name}"))):
                if path.is_file():
                    return path
        return None

    def summary_value(self, label: str) -> Optional[str]:
        """What summary.md's line `- LABEL: ...` says, None without one."""
        prefix = f"- {label}: "
        return next((line[len(prefix):] for line in self.summary if line.startswith(prefix)), None)

    def stages(self) -> str:
        """summary.md's stage table, the stages the rules read: name, status and seconds."""
        cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in self.summary
                 if line.startswith("| ") and not line.startswith("| stage |")]
        kept = [f"{row[0].split(':')[0]} {row[1]} ({row[2]} s)" for row in cells if len(row) > 2
                and row[0].split(":")[0] in ("kernels", "probe", "epilogue", "bench 1")]
        return "summary.md's stages: " + (", ".join(kept) if kept else "none (no summary.md or no stage table)")

    def target_rows(self, shape: str) -> list:
        """[(run index, {contender: row})] of every bench run with fused rows at `shape`, N = TARGET_ROWS."""
        found = []
        for index, run in enumerate(self.runs, 1):
            rows = {row["contender"]: row for row in run["rows"]
                    if (row["path"], row["shape"], row["N"]) == ("fused", shape, TARGET_ROWS)}
            if rows:
                found.append((index, rows))
        return found

    def contenders(self, matches: Callable[[str], bool]) -> list:
        """The contenders at the targets' rows, either shape, that `matches` names, sorted."""
        return sorted({key for shape in RULE_SHAPES for _, rows in self.target_rows(shape) for key in rows
                       if matches(key)})


def against_ours(lease: Lease, candidate: str, shape: str, wins: Callable[[float], bool], condition: str) -> Outcome:
    """`candidate`'s bench row at `shape`, N = TARGET_ROWS, against erpo's in the same run: met if both passed their
    full-size check and wins("ours faster by", its fwd+bwd over erpo's) holds, unmet if it does not or the candidate's
    check failed, missing if either row is absent or did not run to a result."""
    where = f"{shape} N={TARGET_ROWS}"
    found = [(index, rows) for index, rows in lease.target_rows(shape) if candidate in rows]
    if not found:
        return Outcome("missing", f"{where}: no {candidate} row in bench.jsonl")
    index, rows = found[0]
    mine, ours = rows[candidate], rows.get("erpo")
    if mine["status"] == "wrong":
        errors = mine.get("check_failures") or mine.get("grad_err")
        return Outcome("unmet", f"{where}: {candidate} failed its full-size check ({errors})")
    if mine["status"] != "ok" or mine.get("correct") is not True or mine.get("fwdbwd_ms") is None:
        return Outcome("missing", f"{where}: {candidate} {mine['status']}" + (
            f" ({mine['detail']})" if mine.get("detail") else ""))
    if ours is None or ours["status"] != "ok" or ours.get("correct") is not True or ours.get("fwdbwd_ms") is None:
        return Outcome("missing", f"{where}: erpo's row in bench run {index} "
                       + ("absent" if ours is None else ours["status"]))
    ratio = mine["fwdbwd_ms"] / ours["fwdbwd_ms"]
    text = (f"{where} (bench run {index}): {candidate} {mine['fwdbwd_ms']:.2f} ms fwd+bwd, erpo {ours['fwdbwd_ms']:.2f}"
            f" ms, ours faster by {ratio:.3f} ({condition}: {'yes' if wins(ratio) else 'no'}); both passed their check")
    return Outcome("met" if wins(ratio) else "unmet", text)


def _at_both_shapes(lease: Lease, candidate: str, wins, condition: str) -> tuple:
    outcomes = [against_ours(lease, candidate, shape, wins, condition) for shape in RULE_SHAPES]
    return combined(outcomes), outcomes


def _why(state: str, outcomes: list) -> str:
    if state == "missing":
        return "; ".join(outcome.text for outcome in outcomes if outcome.state == "missing")
    return "; ".join(outcome.text for outcome in outcomes if outcome.state == "unmet")


# ---- the rules -----------------------------------------------------------------------------------------------------

def _pick_without_rows(lease: Lease, label: str, kind: str, rows_named: str) -> tuple:
    """(verdict, why) of a pick rule whose bench 1 rows are absent: keep where summary.md's pick line says the probe
    measured every shape and no variant won, cannot decide otherwise."""
    pick = lease.summary_value(label)
    if pick is None:
        return UNDECIDED, (f"no {rows_named} row in bench.jsonl and summary.md has no \"{label}\" line (the probe did "
                           "not run, or the lease predates its pick)")
    if pick.startswith("none:") and f", {probe_pick.NOT_FASTER} " in pick:
        return KEEP, f"the probe measured every shape and no {kind} beat the library's on both: {pick}"
    if pick.startswith("none:"):
        return UNDECIDED, f"the probe's pick rests on no measurement: {pick}"
    return UNDECIDED, f"the probe picked {pick.split(':')[0]}, but bench.jsonl has no row of it at N={TARGET_ROWS}"


def geometry_decision(lease: Lease) -> Decision:
    """"The probe's pick": the picked erpo-geom-ROWS[-GROUP] becomes LOGITS_ROWS / GROUP_ROWS if its bench 1 rows
    pass their check and are faster than erpo's at both shapes at N = 16384."""
    title, section = "Chunk geometry (the probe's pick)", "bench/README.md, \"The probe's pick\""
    pick = lease.summary_value(probe_pick.SUMMARY_LABEL)
    inputs = [lease.runs_note, f"summary.md, {probe_pick.SUMMARY_LABEL}: {pick or 'no such line'}"]
    keys = lease.contenders(is_geometry_key)
    if len(keys) != 1:
        if keys:
            return Decision(title, section, inputs, UNDECIDED, f"bench.jsonl holds {len(keys)} geometries: "
                            f"{', '.join(keys)}; the rule judges the one bench 1 timed")
        verdict, why = _pick_without_rows(lease, probe_pick.SUMMARY_LABEL, "geometry variant", "erpo-geom-*")
        return Decision(title, section, inputs, verdict, why)
    (key,) = keys
    state, outcomes = _at_both_shapes(lease, key, lambda ratio: ratio < 1, "faster than erpo")
    inputs += [outcome.text for outcome in outcomes]
    if state != "met":
        return Decision(title, section, inputs, KEEP if state == "unmet" else UNDECIDED, _why(state, outcomes))
    geometry = parse_geometry_key(key)
    edits = [Edit(FUSED_LOSS, name, source_text(FUSED_LOSS, name), repr(value))
             for name, value in (("LOGITS_ROWS", geometry.rows), ("GROUP_ROWS", geometry.group))
             if source_value(FUSED_LOSS, name) != value]
    return Decision(title, section, inputs, CHANGE, f"{key} passed its check and beat erpo at both shapes", edits)


class RoundingCase(NamedTuple):
    """One test_dhidden_rounding case as the log has it: the elements beyond the bound of d hidden and of the
    control (cuBLAS's fp32 product rounded once), None where the case failed without its report; the text read."""

    beyond: Optional[int]
    control_beyond: Optional[int]
    text: str


def rounding_cases(lines: list) -> dict:
    """{(shape, reduction, path): RoundingCase} of test_dhidden_is_the_fp32_product_rounded_once in the kernel tier's
    log: each report (a RoundingReport warning where it passed, the assertion's message where it failed; the numbers
    say which), and each FAILED / ERROR line of a case with no report (a timeout, an error)."""
    cases = {}
    for line in lines:
        for found in ROUNDING_REPORT.finditer(line):
            cases[found[1], found[2], found[3]] = RoundingCase(int(found[5]), int(found[9]), found[0])
    ids = {"-".join(case): case for case in _rounding_case_keys()}
    for line in read_pytest_log(lines).failures:
        found = ROUNDING_TEST_ID.search(line)
        if found and ids.get(found[1]) and ids[found[1]] not in cases:
            cases[ids[found[1]]] = RoundingCase(None, None, line)
    return cases


def _rounding_case_keys() -> list:
    """Every (shape, reduction, path) of the test (its SHAPES, REDUCTIONS and PATHS, read from its source)."""
    return [(shape, reduction, path) for shape in source_value(ROUNDING_TEST, "SHAPES")
            for reduction in source_value(ROUNDING_TEST, "REDUCTIONS") for path in source_value(ROUNDING_TEST, "PATHS")]


def _case_state(case: Optional[RoundingCase]) -> str:
    if case is None:
        return "not in the log"
    if case.beyond is None:
        return "failed without its report"
    if case.control_beyond:
        return "the control failed (the bound, not d hidden, is wrong for this GPU)"
    return "passed" if case.beyond == 0 else "FAILED"


def accuracy_outcomes(cases: dict) -> list:
    """Per (shape, reduction): met where d hidden held in hidden's dtype fails while the fp32 case passes (both with
    their control passing), unmet where the former passes or the fp32 case fails too, missing otherwise."""
    outcomes = []
    for shape, reduction in dict.fromkeys(key[:2] for key in _rounding_case_keys()):
        as_hidden, fp32 = (_case_state(cases.get((shape, reduction, path))) for path in (AS_HIDDEN, FP32))
        text = f"{shape} {reduction}: {AS_HIDDEN} {as_hidden}, {FP32} {fp32}"
        state = ("met" if (as_hidden, fp32) == ("FAILED", "passed") else
                 "unmet" if as_hidden == "passed" or fp32 == "FAILED" else "missing")
        outcomes.append(Outcome(state, text))
    return outcomes


def dhidden_decision(lease: Lease) -> Decision:
    """"Deciding d hidden's dtype": fp32 (GRAD_HIDDEN_FP32 = True) if a dhidden-as-hidden case fails on the GPU while
    its dhidden-fp32 case passes (accuracy first), or if erpo-dh32 passes its check and is at most 1 % slower than
    erpo at both shapes at N = 16384; else bf16 stays."""
    title, section = "d hidden's dtype (GRAD_HIDDEN_FP32)", "bench/README.md, \"Deciding d hidden's dtype\""
    cases = rounding_cases(lease.kernel_log or [])
    accuracy = accuracy_outcomes(cases)
    states = {outcome.state for outcome in accuracy}  # any pair may force fp32: met on one, unmet only on all
    accuracy_state = "met" if "met" in states else "unmet" if states == {"unmet"} else "missing"
    speed_state, speed = _at_both_shapes(lease, "erpo-dh32", lambda ratio: ratio <= DH32_MAX_RATIO,
                                         f"at most {DH32_MAX_RATIO}")
    inputs = [("kernel-tests.log: not found" if lease.kernel_log is None else
               f"kernel-tests.log, {ROUNDING_TEST}: {len(cases)} of {len(_rounding_case_keys())} cases reported")]
    inputs += [f"rounding, {outcome.text}" for outcome in accuracy]
    inputs += [f"rounding report: {case.text}" for case in cases.values() if case.beyond]
    inputs += [lease.runs_note, *(outcome.text for outcome in speed)]
    edit = [Edit(FUSED_LOSS, "GRAD_HIDDEN_FP32", source_text(FUSED_LOSS, "GRAD_HIDDEN_FP32"), "True")]
    if accuracy_state == "met":
        failing = "; ".join(o.text for o in accuracy if o.state == "met")
        return Decision(title, section, inputs, CHANGE, f"{ACCURACY_FIRST}, whatever it costs: {failing}", edit)
    if speed_state == "met":
        return Decision(title, section, inputs, CHANGE, f"erpo-dh32 at most 1 % slower than erpo at both shapes "
                        f"(accuracy: {accuracy_state})", edit)
    if accuracy_state == speed_state == "unmet":
        return Decision(title, section, inputs, KEEP, "no case needs fp32 and it costs more than 1 %: "
                        + _why("unmet", speed) + " (write why: against a double rounding one bf16 ulp off the single "
                        "one in 226 of the CPU test's 1560 elements at factor 0.37)")
    undecided = sum(outcome.state == "missing" for outcome in accuracy)
    missing = ([f"the rounding cases: {undecided} of {len(accuracy)} shape and reduction pairs say nothing (above)"]
               if accuracy_state == "missing" else [])
    missing += [o.text for o in speed if o.state == "missing"] if speed_state == "missing" else []
    return Decision(title, section, inputs, UNDECIDED, "; ".join(missing))


def _epilogue_probe_lines(lease: Lease) -> list:
    """The epilogue probe's answers per chunk ((d) against (b), (c) against (a)) from gemm_epilogue_probe.json."""
    probe = lease.find(epilogue_pick.PROBE_JSON)
    if probe is None:
        return [f"{epilogue_pick.PROBE_JSON}: not in these folders (gpu_check keeps it in its work folder; "
                "summary.md's \"GEMM epilogue probe\" has its tables)"]
    try:
        chunks = json.loads(probe.read_text(encoding="utf-8"))["chunks"]
        lines = []
        for chunk in chunks:
            for ours, theirs in (("d", "b"), ("c", "a")):
                pair = (chunk.get("answer") or {}).get(ours)
                lines.append(f"{epilogue_pick.PROBE_JSON}, {chunk['shape']} {chunk['rows']} rows: " + (
                    f"no passing ({ours}) or ({theirs})" if pair is None else
                    f"best ({ours}) {pair['config']}, {pair['launch']} {pair['ms']:.3f} ms against ({theirs}) "
                    f"{pair['base_ms']:.3f} ms ({pair['ratio']:.3f}x)"))
        return lines
    except (ValueError, KeyError, TypeError) as error:
        return [f"{epilogue_pick.PROBE_JSON}: unreadable ({type(error).__name__}: {error})"]


def epilogue_decision(lease: Lease) -> Decision:
    """"Deciding the epilogue row pass": EPILOGUE_ROW_PASS = True if bench 1's erpo-epi rows (or those of the
    epilogue probe's pick, erpo-epi-...) pass their check and are faster than erpo's at both shapes at N = 16384."""
    title, section = "The epilogue row pass (EPILOGUE_ROW_PASS)", "bench/README.md, \"Deciding the epilogue row pass\""
    inputs = [lease.runs_note]
    keys = lease.contenders(lambda key: key == "erpo-epi" or is_epilogue_key(key))
    if len(keys) != 1:
        why = (f"bench.jsonl holds {len(keys)} erpo-epi contenders ({', '.join(keys)}); bench 1 times one" if keys
               else f"no erpo-epi row at N={TARGET_ROWS} in bench.jsonl (bench 1 did not time it)")
        return Decision(title, section, inputs + _epilogue_probe_lines(lease), UNDECIDED, why)
    (key,) = keys
    state, outcomes = _at_both_shapes(lease, key, lambda ratio: ratio < 1, "faster than erpo")
    inputs += [outcome.text for outcome in outcomes] + _epilogue_probe_lines(lease)
    if state != "met":
        return Decision(title, section, inputs, KEEP if state == "unmet" else UNDECIDED, _why(state, outcomes)
                        + (" (write why: the times above, and the probe's (c) against (a))" if state == "unmet"
                           else ""))
    return Decision(title, section, inputs, CHANGE, f"{key} passed its check and beat erpo at both shapes",
                    [Edit(FUSED_LOSS, "EPILOGUE_ROW_PASS", source_text(FUSED_LOSS, "EPILOGUE_ROW_PASS"), "True")])


def epilogue_pick_decision(lease: Lease, row_pass: Decision) -> Decision:
    """"The epilogue probe's pick": the picked config and launch become LOSS_CONFIGS' bf16 entry and LOSS_LAUNCH if
    bench 1's rows of its key won (the row pass's decision, `row_pass`); no config or launch from the probe alone."""
    title, section = "The epilogue GEMM's config and launch (the epilogue probe's pick)", \
        "bench/README.md, \"The epilogue probe's pick\" and \"Deciding the epilogue row pass\""
    pick = lease.summary_value(epilogue_pick.SUMMARY_LABEL)
    inputs = [f"summary.md, {epilogue_pick.SUMMARY_LABEL}: {pick or 'no such line'}"]
    keys = lease.contenders(is_epilogue_key)
    if len(keys) != 1:
        verdict, why = _pick_without_rows(lease, epilogue_pick.SUMMARY_LABEL, "(d) config and launch", "erpo-epi-*")
        if keys:
            verdict, why = UNDECIDED, f"bench.jsonl holds {len(keys)} picks ({', '.join(keys)}); bench 1 times one"
        return Decision(title, section, inputs, verdict, why)
    (key,) = keys
    if row_pass.verdict != CHANGE:
        return Decision(title, section, inputs + [f"{key}: the row pass's verdict above, {row_pass.verdict}"],
                        row_pass.verdict, f"{key}'s bench 1 rows decide both: {row_pass.why}")
    launch = parse_epilogue_key(key)
    config = f"GemmConfig({', '.join(map(str, launch.config))})"
    # a persistent pick ran one program per SM of the lease's GPU (the probe's count, its key's P): the library's
    # launch says so for whatever GPU a call runs on (DEVICE_SMS, a constant of the module the edit is made in)
    programs = "None" if launch.programs is None else "DEVICE_SMS"
    edits = [Edit(LOGITS_GEMM, "LOSS_CONFIGS[(2, False)]", source_text(LOGITS_GEMM, "LOSS_CONFIGS", (2, False)),
                  config, "and its compile check for sm_90 without a spill in tests/workers/"
                          "gemm_epilogue_compile_check.py"),
             Edit(LOGITS_GEMM, "LOSS_LAUNCH", source_text(LOGITS_GEMM, "LOSS_LAUNCH"), f"Launch({programs}, "
                  f"{launch.tma})", f"DEVICE_SMS: one program per SM of the device each call runs on; the lease's "
                                    f"{launch.programs}; test it with --fused-options "
                                    f"{epilogue_key(launch._replace(programs=DEVICE_SMS))}"
                  if launch.programs else "")]
    edits = [edit for edit in edits if edit.now.replace(" ", "") != edit.new.replace(" ", "")]
    return Decision(title, section, inputs + [f"{key}: the row pass's verdict above, {CHANGE}"], CHANGE,
                    f"{key}'s bench 1 rows won: the option on at the pick", edits)


class TierFiles(NamedTuple):
    """The kernel tier's files by their tests of 1 s or more (`--durations-min=1`): [(name under tests/kernels,
    seconds)], slowest first; the slowest test (Duration) or None."""

    files: list
    slowest: object


def tier_files(durations: list) -> TierFiles:
    seconds = {}
    for duration in durations:
        name = duration.file[len(KERNEL_TIER):] if duration.file.startswith(KERNEL_TIER) else duration.file
        seconds[name] = seconds.get(name, 0.0) + duration.seconds
    slowest = max(durations, key=lambda duration: duration.seconds, default=None)
    return TierFiles(sorted(seconds.items(), key=lambda item: -item[1]), slowest)


def _limit(seconds: float) -> int:
    """A limit for a measured time: plus about a fifth, up to whole LIMIT_STEP_S."""
    return LIMIT_STEP_S * math.ceil(seconds * LIMIT_MARGIN / LIMIT_STEP_S)


def kernel_decisions(lease: Lease) -> list:
    """The kernel tier's time from its log: KERNEL_FILES_FIRST (the files of FIRST_FILE_MIN_S or more, slowest
    first), KERNEL_SESSION_S (pytest's time plus about a fifth) and KERNEL_TEST_TIMEOUT_S (raised to the slowest test
    plus about a fifth where that is more); KERNEL_LIMIT_S follows from them. Only from a log of today's tier
    (`-m KERNEL_MARKS`) that ran every test it collected, none stopped at its time limit."""
    order_title, time_title = "Kernel tier: file order (KERNEL_FILES_FIRST)", \
        "Kernel tier: session and limits (KERNEL_SESSION_S, KERNEL_TEST_TIMEOUT_S)"
    section = ("bench/RESULTS.md's next-lease bullet (re-set the file order and limits from the lease's `--durations`) "
               f"and {GPU_CHECK}'s KERNEL_* comments: a limit is the measured time plus about a fifth")
    if lease.kernel_log is None:
        return [Decision(title, section, ["kernel-tests.log: not found"], UNDECIDED, "no kernel-tests.log")
                for title in (order_title, time_title)]
    run = read_pytest_log(lease.kernel_log)
    files = tier_files(run.durations)
    marks = source_value(GPU_CHECK, "KERNEL_MARKS")
    inputs = [f"kernel-tests.log: `{shlex.join(run.command) if run.command else 'no command line'}`",
              f"result: {run.result or 'none'} (collected {run.collected}, not run {run.not_run}"
              + (f"; stopped early: {run.stopped}" if run.stopped else "") + ")",
              *(f"failure: {line}" for line in run.failures),
              "slowest test: " + (f"{files.slowest.seconds:.2f} s {files.slowest.phase} {files.slowest.test}"
                                  if files.slowest else "none"),
              "files by their tests of 1 s or more: " + (", ".join(f"{name} {seconds:.1f} s" for name, seconds in
                                                                  files.files) or "none")]
    command = run.command or []
    if not any(command[index:index + 2] == ["-m", marks] for index in range(len(command))):
        why = (f"the log's command has no `-m '{marks}'`: it also ran the tests only CI runs now ("
               f"{marks.split()[-1]}), so its durations cannot set today's tier")
        return [Decision(order_title, section, inputs, UNDECIDED, why), Decision(time_title, section, [], UNDECIDED,
                                                                                 why + " (inputs above)")]
    if run.result is None or run.not_run != 0:
        why = ("no result line: the tier was stopped" if run.result is None else
               "the log does not say how many tests were collected" if run.not_run is None else
               f"{run.not_run} collected tests did not run: the tier's time and the files not started are not known")
        return [Decision(order_title, section, inputs, UNDECIDED, why), Decision(time_title, section, [], UNDECIDED,
                                                                                 why + " (inputs above)")]
    first = tuple(name for name, seconds in files.files if seconds >= FIRST_FILE_MIN_S)
    now_first = source_value(GPU_CHECK, "KERNEL_FILES_FIRST")
    order = (Decision(order_title, section, inputs, KEEP, "the files of 15 s or more, slowest first, are the order now")
             if first == now_first else
             Decision(order_title, section, inputs, CHANGE, f"the files of {FIRST_FILE_MIN_S} s or more, slowest first",
                      [Edit(GPU_CHECK, "KERNEL_FILES_FIRST", repr(now_first), repr(first),
                            "each file's comment: its seconds above")]))
    timeouts = [line for line in run.failures if "Timeout (>" in line]
    if timeouts:
        return [order, Decision(time_title, section, [], UNDECIDED, f"{len(timeouts)} tests stopped at the test's "
                                "limit: their time, and so the tier's, is not known")]
    session, test_limit = (source_value(GPU_CHECK, name) for name in ("KERNEL_SESSION_S", "KERNEL_TEST_TIMEOUT_S"))
    new_session = _limit(run.seconds)
    new_test_limit = max(test_limit, _limit(files.slowest.seconds)) if files.slowest else test_limit
    edits = [Edit(GPU_CHECK, name, str(now), str(new)) for name, now, new in
             (("KERNEL_SESSION_S", session, new_session), ("KERNEL_TEST_TIMEOUT_S", test_limit, new_test_limit))
             if now != new]
    report = source_value(GPU_CHECK, "KERNEL_REPORT_S")
    why = (f"pytest's {run.seconds:.0f} s plus about a fifth is {new_session} s; the slowest test's "
           f"{files.slowest.seconds if files.slowest else 0:.1f} s plus about a fifth is "
           f"{_limit(files.slowest.seconds) if files.slowest else 0} s (the test's limit only rises: it stops a hung "
           f"test); KERNEL_LIMIT_S follows: {new_session} + {new_test_limit} + {report} = "
           f"{new_session + new_test_limit + report} s (bench/README.md's stage table quotes it)")
    return [order, Decision(time_title, section, [f"pytest's time: {run.seconds} s"], CHANGE if edits else KEEP, why,
                            edits)]


# the fused call's options that bench 1 times each alone against erpo, and what was not timed when two change
PAIR_NOTES = {
    frozenset(("geometry", "epilogue")): "erpo-epi (and the epilogue probe's pick, made at 512-row chunks) ran at the "
                                         "library's LOGITS_ROWS; the geometry changes the rows its GEMMs run at",
    frozenset(("geometry", "dhidden")): "erpo-dh32 ran at the library's geometry; the geometry changes the groups "
                                        "whose d hidden GEMM writes fp32",
    frozenset(("epilogue", "dhidden")): "the forward's epilogue and the backward's fp32 d hidden are different passes "
                                        "of one call, timed in it one at a time",
}


def together_lines(changes: dict) -> list:
    """What the rules say where two of the fused call's options change at once ({name: Decision}): each rule's edit is
    allowed, its condition met against erpo alone; the combination was not timed, so whether it beats erpo is open."""
    forced = changes["dhidden"].verdict == CHANGE and changes["dhidden"].why.startswith(ACCURACY_FIRST)
    names = [name for name, decision in changes.items() if decision.verdict == CHANGE
             and not (name == "dhidden" and forced)]
    lines = (["- d hidden's fp32 comes from the accuracy branch, whatever it costs: it goes in with any other change "
              "(whose rows bench 1 timed with bf16 d hidden)"] if forced else [])
    if len(names) < 2:
        return lines + ["- no two of the fused call's options won on their times together: nothing open between the "
                        "rules", ""]
    lines += [f"- **open**: {', '.join(changes[name].title for name in names)} each won alone against erpo in bench 1 "
              "and were never timed together. What the rules allow: each edit above, each rule's condition being met; "
              "none of them says the combination beats erpo, so that stays open until one lease times it (no bench "
              "contender sets two options yet)."]
    lines += [f"- {changes[a].title} with {changes[b].title}: {PAIR_NOTES[frozenset((a, b))]}"
              for index, a in enumerate(names) for b in names[index + 1:]]
    return lines + [""]


def decide(folders: list) -> list:
    """The lines of every rule's decision on the lease in `folders` (markdown, summary.md's "Decisions")."""
    lease = Lease(folders)
    geometry, dhidden, epilogue = geometry_decision(lease), dhidden_decision(lease), epilogue_decision(lease)
    decisions = [geometry, dhidden, epilogue, epilogue_pick_decision(lease, epilogue), *kernel_decisions(lease)]
    lines = ["## Decisions", "",
             f"`python -m bench.decide` on {', '.join(str(folder) for folder in lease.folders)}: bench/README.md's "
             "rules applied to this lease's files (bench/decide.py). change: every input there and the condition met "
             "at both shapes; keep: a measured input fails it; cannot decide: an input missing or failed (the "
             "library stays).", "", f"- {lease.stages()}", ""]
    for decision in decisions:
        lines += decision.lines()
    return lines + ["### Together", "", *together_lines(
        {"geometry": geometry, "dhidden": dhidden, "epilogue": epilogue})]


def decision_lines(folders: list) -> list:
    """decide(folders), or, should it raise, one line saying so: gpu_check's summary must not fail the lease."""
    try:
        return decide(folders)
    except Exception as error:  # noqa: BLE001 - whatever the files hold, the lease's summary is written
        return ["## Decisions", "", f"- bench.decide failed ({type(error).__name__}: {error}); run `python -m "
                "bench.decide DIR` on the lease's folder", ""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decide", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", metavar="DIR",
                        help="a lease's folder (gpu_check's OUT_DIR, bench/measured/<device>-<date>-<commit>/), and "
                             "any other holding its files")
    args = parser.parse_args(argv)
    for folder in args.folders:
        if not Path(folder).is_dir():
            parser.error(f"{folder}: no such folder; give the folder of a lease's files (summary.md, bench.jsonl, "
                         "kernel-tests.log)")
    print("\n".join(decide(args.folders)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
