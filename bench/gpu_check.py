"""`bash bench/gpu_check.sh [--dry-run] [--commit HASH] [--stages LIST] [--deadline S] [OUT_DIR]`: what one short
GPU lease measures, in one command that ends within 570 s (bench/README.md, "One command for a GPU lease").

Stages, most wanted first, each a subprocess in its own process group under its own time limit (the group is killed
at the limit, so a slow stage cannot take the next one's time), each writing its results as it goes:

1. kernels: the kernel test tier (`tests/kernels`) on CUDA with pytest-xdist workers, its slowest files first and its
   cpu_only tests (on the CPU whatever the machine: the interpreter's runs and the sm_90 compile checks; CI runs
   them) left out, every test's duration and the failures' one-line messages; pytest-timeout (in the GPU image)
   stops a hung test, and its session timeout starts no test late, so that the tier ends with its result line inside
   the stage's limit.
2. probe: `python -m bench.fused_probe` at N=16384 on the Qwen2.5-7B and 32B lm_heads: ours on the fused path under
   each variant (chunk rows, group rows, workspace, host layout), one group's d hidden and d weight GEMMs at each
   group size; its rows say which group geometry is fastest in the 1 GiB default. Its report is copied into
   summary.md (its rows, as it prints them, go to bench.log).
3. epilogue: `python -m bench.gemm_epilogue_probe` on the same two lm_heads at chunks of 512 and 2048 rows: cuBLAS's
   logits GEMM, it followed by the forward row kernel, a Triton GEMM and the same with the forward row statistics
   in its epilogue, each checked on the device, then timed; whether the epilogue beats cuBLAS + the row kernel (the
   fused path's next step, issue 32). Its report is copied into summary.md (its chunks as they end: bench.log).
4. bench 1: the first of the bench runs (BENCH_RUNS, below): the fused path's targets, ours beside torch.compile and
   Liger, and the probe's pick (bench.probe_pick: the 1 GiB chunk/group geometry faster than the library default on
   both shapes, if any, as the contender erpo-geom-ROWS[-GROUP]; nothing when the probe failed or did not run); erpo-epi
   at the epilogue probe's pick (bench.epilogue_pick: the passing (d) config and launch faster than the library's on
   both shapes at 512 rows, if any, as the contender erpo-epi-BMxBNxBK-wW-sS[-persistentP][-tma] in erpo-epi's place;
   else erpo-epi at the library's).
5. profile: `python -m bench.kernel_profile --path fused` at N=16384 on the Qwen2.5-7B lm_head: the fused path's
   kernels one by one and where the GPU idles between them (waiting for the host, per next kernel, the largest
   gaps, the host's syncs), copied into summary.md (its output goes to bench.log).
6. logits: `bash bench/logits_gpu_check.sh` (the logits bench of ours and Liger, the host's microseconds, the kernel
   tables; the one-node loss's tests run in the kernel tier), its folder packed into one file.
7. train: `erpo train`, the built-in tiny default, for 20 rollout steps on CUDA with the plain-torch updater
   (DeepSpeed, which trainer.updater=auto picks on CUDA, is not in the GPU image).
8. bench 2 and on: the other `python -m bench` runs, most wanted first. Every bench run appends to one --progress
   file and gets what is left before the deadline, up to its own cap; what a run did not reach is in the table as
   `not reached`.

Then the table merged from the progress file and a summary holding it, ending with "Decisions": bench.decide's verdict
per rule of bench/README.md on the lease's files (what the next session changes in the library, or why not). From
before the first stage to after the last, nvidia-smi samples the GPU's clocks, power, temperature and clock-limit
reasons once a second (bench.gpu_clocks); summary.md's stage table gives each stage's share. The files (8, the device
tool's limit) under OUT_DIR: summary.md, gpu_check.log (environment, wheel install, each stage's command, limit, time,
exit, and the training's output), kernel-tests.log, logits.tar.gz (logits_gpu_check.sh's folder, the stage's own log
in it), train-metrics.jsonl, bench.log (the probe's, the epilogue probe's, the profile's and the bench runs' output),
bench.jsonl (`python -m bench --merge` reads it) and clocks.csv (the samples). SIGTERM or SIGINT to gpu_check (the
device tool's timeout, kill, Ctrl+C) stops the running stage as its time limit would, starts no other, and ends with
the sampler stopped and the summary written (stop_on_signals), exit 128 + the signal's number.

`--dry-run` (CI: tests/repo/test_gpu_check.py) runs the same stages on the CPU under the Triton interpreter, shrunk:
the device-fixture guard and one Triton kernel test for the tier, the probe's `--smoke` (its tiny shape, each
variant and case once), the epilogue probe's `--smoke` (its tiny shape, every variant once), the first bench run at
the bench's smoke shape (logits path, torch and Liger only), the fused-path profile's smoke shape (the CPU's
operators, no gaps), logits_gpu_check.sh's own --dry-run, one tiny training step and the other bench runs' own
arguments checked by the bench, their rows listed (`python -m bench ... --plan`); no wheels are installed, so
missing peers are reported and skipped; no clocks are sampled (no clocks.csv, "-" in the stage table's clock
columns). Its stages are not held to the GPU's limits: each gets DRY_RUN_STAGE_LIMIT_S, the whole DRY_RUN_DEADLINE_S
(a loaded CPU's times are no lease's).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import gpu_clocks
from .decide import decision_lines
from .epilogue_pick import PICK_ROWS, pick_epilogue
from .epilogue_pick import PROBE_JSON as EPILOGUE_JSON
from .epilogue_pick import SUMMARY_LABEL as EPILOGUE_PICK_LABEL
from .ours_by_tool import ours_by_tool_lines
from .probe_pick import PROBE_JSON, Pick, pick_geometry
from .probe_pick import SUMMARY_LABEL as GEOMETRY_PICK_LABEL
from .pytest_log import read_pytest_log

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 570            # the whole command: inside the device tool's 600 s per call (the call's timeout_s)
SUMMARY_RESERVE_S = 25      # kept back from the stages for the merge and the summary
MIN_STAGE_S = 15            # a stage with less time left than this is not started
KERNEL_TIER = "tests/kernels"
# The limits come from this command's 2026-11-26 run on an H100 (commit b8b4a78, `--deadline 365`, then
# logits_gpu_check.sh in the same device call; the files are in bench/measured/h100-2026-11-26/: gpu_check.log,
# kernel-tier-n6.log, logits/logits_gpu_check.log): each stage's measured time plus about a fifth, so that the bench's
# peers get what the measured stages leave.
# The kernel tier's schedule comes from its durations on the H200 lease of 2026-11-27 at e17ad62 (bench/measured/
# h200-2026-11-27-e17ad62/kernel-tests.log, --durations; 12 workers, then 90 s a test: 1 failed, 1014 passed,
# 2 skipped of 1036 in 173 s of pytest's clock, 181 s of the stage, 19 tests never started). Its tests of 1 s or more
# took 726 s there, of which 332 s ran on the CPU whatever the machine: the bench smoke's run (a module fixture,
# 132 s), bench.host_cost's runs (64 s) and one interpreter check (15 s), in Triton's interpreter, and the two sm_90
# compile checks (122 s: the logits one stopped at 90 s), a cross-compile with the Triton 3.6 CI installs. A GPU
# adds nothing to them, so they are cpu_only (pytest.ini), which CI runs and this tier leaves out (KERNEL_MARKS): the
# CUDA tests compile every kernel they launch for the device itself, with the image's ptxas (torch's, CUDA 13.0; the
# compile checks passed on the image as in CI, H200 2026-11-26 and H100 at 60b3625, and the base-2 loop's SASS count
# is the same with that ptxas as with Triton's 12.8: CHANGELOG.md). The pipelined chunk loop's 28 s have gone since.
# Left: 366 s in the 158 tests of 1 s or more, the slowest file test_objective_kernels.py's 68 s (all measured
# there, beside the CPU-bound runs now left out), and, not yet timed on a GPU (estimates): about 880 tests under 1 s
# at an assumed 0.1 s each (88 s), test_model_families.py (37 tests, about 40 s), the fp32 d hidden's 16 CUDA cases
# at V = 152064 (about 30 s) and the GEMM epilogue probe's 20 (about 25 compiles, about 25 s): about 550 s of
# workers' time in all, an estimate.
KERNEL_WORKERS = 10         # pytest-xdist processes sharing the GPU and the machine's 16 cores: the estimated 550 s on
#                             10 take about 55 s, under the slowest file's 68 s (loadfile gives a file to one worker),
#                             which then ends the tier; on 8 about 69 s, no margin; more workers end no earlier and
#                             add CPU contention (each compiles and launches on the host). (The H100's runs of
#                             2026-11-26, in xdist's own order: 4 workers passed 150 s at about 95 % of the tier, 6
#                             took 187 s.)
KERNEL_TEST_TIMEOUT_S = 40  # one test (pytest-timeout), so that one hung test does not cost the tier: the slowest CUDA
#                             test took 16.5 s there (test_logits_loss_node's compiled one); some new ones not yet timed
KERNEL_SESSION_S = 100      # pytest-timeout's --session-timeout: no test starts later, and the tier ends with its
#                             result line and failures (the 4-worker run, killed at its limit, printed neither). The
#                             tier should end by about 80 s of its clock (an estimate: the workers' start, about 10 s,
#                             then the slowest file's 68 s, the slowest files starting first); 100 s leaves about a
#                             quarter more for the estimate. A test still running at the session's end makes xdist
#                             report the tier interrupted: the tests not started then are counted in summary.md
KERNEL_REPORT_S = 20        # after the session's end: the report and the workers' exit
# the stage's limit: the session's 100 s, a test started then stopped at its 40 s, and the report's 20 s: 160 s (a
# lease's durations re-set the session and the test's limit, `python -m bench.decide`; this follows). Expected: about
# 90 s (an estimate: pytest's 80 s and the stage's 8 s beyond pytest's clock at e17ad62), 90 s less than e17ad62's 181
KERNEL_LIMIT_S = KERNEL_SESSION_S + KERNEL_TEST_TIMEOUT_S + KERNEL_REPORT_S
KERNEL_MARKS = "not cpu_only"  # pytest -m: the tests that run on the CPU whatever the machine stay CI's (pytest.ini)
KERNEL_FILES_FIRST = (      # the files that start first, slowest first (at e17ad62, their tests of 1 s or more; the
#                             files not yet timed by an estimate); the others follow, sorted
    "test_objective_kernels.py",      # 68 s
    "test_logits_loss_node.py",       # 62 s
    "test_fused_linear_loss.py",      # 44 s, and d hidden in fp32's cases since
    "test_model_families.py",         # not yet timed on a GPU: 37 tests that compile the kernels for four families'
    #                                   options (17 s in the CPU interpreter): about 40 s, an estimate
    "test_compile.py",                # 38 s
    "test_dhidden_rounding.py",       # not yet timed on a GPU: 16 cases at V = 152064, an fp32 weight of up to 2.2 GB
    #                                   drawn and a float64 product each: about 30 s, an estimate
    "test_padded.py",                 # 27 s
    "test_gemm_epilogue_probe.py",    # not yet timed on a GPU: about 25 small GEMM compiles: about 25 s, an estimate
    "test_triton_logits.py",          # 25 s
    "test_logit_transforms.py",       # 15 s: the last of them, so that no file of 15 s or more is left to end the tier
)
PROBE_LIMIT_S = 55          # bench.fused_probe, both shapes: measured 42 s (the H200 at e17ad62, 15 variants and a
#                             third part; bench/measured/h200-2026-11-27-e17ad62/), plus about a fifth; its 11
#                             variants and two-GEMM part 2 since should take less (an estimate, not measured)
PROBE_SHAPES = "qwen2.5-7b,qwen2.5-32b"  # the two lm_heads of the fused path's targets (bench 1)
PROBE_N = 16384                          # the targets' size
EPILOGUE_LIMIT_S = 40       # bench.gemm_epilogue_probe, both shapes at 512 and 2048 rows: not yet run on a GPU, so an
#                             estimate, about 30 s: the process's imports (about 5 s); 26 Triton compiles (12 GEMMs,
#                             3 configs x row statistics or not x pointer or TMA loads, at each shape's D, a constexpr,
#                             and the combine at 2 tile counts), about 0.5 s each for sm_90 on this project's 2-core
#                             CPU (tests/workers/gemm_epilogue_compile_check.py), 13 s; 4 chunks of 26 variants, 8
#                             calls each (a check, 2 warm-up, 5 timed) of at most about 8 ms (2048 rows at 32b: 3.2
#                             TFLOP at 400 TFLOP/s), 7 s; plus about a third, for an estimate. It writes its report
#                             after each chunk: one stopped at its limit keeps the chunks done
EPILOGUE_ROWS = "512,2048"  # chunk rows: the 1 GiB default's 512 (7b) and a chunk 4 times as tall (the Triton GEMM's
#                             tiles fill more waves there)
PICKED_CAP_S = 20           # bench 1's cap grows by this when the probe picks a geometry (bench.probe_pick) and bench 1
#                             times it as one more contender at both N: like erpo-ws2g (ours, another geometry), whose
#                             four rows took 16.3 s of the H200's bench 1 at e17ad62 (bench/measured/h200-2026-11-27-
#                             e17ad62/bench.jsonl, wall_s: 5.6 + 6.6 at N=16384, 1.8 + 2.3 at 4096; the run 158 s of its
#                             175), so 16 s plus about a fifth. Without it the run's last case (N=4096, 32b) would be
#                             the first lost at the plain cap (whole: a case's contenders are timed in turns and its
#                             rows written when it ends). The deadline stays 570 s; what the pick takes comes from the
#                             stages after bench 1 (the schedule's comment below)
LOGITS_LIMIT_S = 80         # logits_gpu_check.sh measured 84 s (the H200 at e17ad62), about 85 s (b8b4a78: the call's
#                             435 s less gpu_check's 350 s) and 70 s (60b3625), each with the one-node loss's tests,
#                             which the kernel tier runs whole now (16 s by pytest's clock at e17ad62): about 68 s, an
#                             estimate, plus about a fifth
TRAIN_LIMIT_S = 70          # measured 57 s (b8b4a78) and 45 s (60b3625)
TRAIN_STEPS = 20
PROFILE_LIMIT_S = 25        # measured 12 s for ours twice (the H200 at e17ad62), 16 s (b8b4a78) and 12 s (60b3625)
#                             for ours alone: the largest plus about a half (cold compiles)
DRY_RUN_CONTENDERS = "torch,liger"
# The dry run checks each stage's command and results, not the lease's timing: the GPU's limits above say nothing of
# a CPU's times (unloaded on the 2-core CPU, 2026-11-27, its logits stage took 28 s of its 80 s, its profile 6 s of
# 25: a CPU shared by 3-4 test suites can take them past; the dry run's test failed once under such load), so on the
# CPU every stage gets one ceiling, for a hung stage only, and the whole dry run a deadline of its own, also for a
# hung run only: its verdict (every stage ok) must not depend on the machine's load. Unloaded 93 s; on the 2-core CPU
# shared with two other helpers' tests, 2026-11-28 at 63b460d, 468 s (load about 3; its logits stage 186 s) and 655
# s (load about 7, in test_gpu_check at e438ee6); 2026-11-28 at 986c15c (the bench's smoke at 64 rows, one
# kernel_globals process in host_cost), 349 s (load about 5.5; 242 CPU-s for all of test_gpu_check.py). 1500 s is
# over 2 times the 655 s and 4 times the 349 s, and a hung run holds a test worker 15 minutes less than the 2400 s did
DRY_RUN_STAGE_LIMIT_S = 600
DRY_RUN_DEADLINE_S = 1500
# the tier's device guard and one Triton kernel test (a single row: seconds in the interpreter)
DRY_RUN_KERNEL_TESTS = (f"{KERNEL_TIER}/test_device_guard.py",
                        f"{KERNEL_TIER}/test_triton_logits.py::test_target_gradient_exact_in_bf16")
# --stages picks some. They run in this order, except the bench's first TARGET_RUNS runs (the fused path's targets),
# which run right after the epilogue probe, its others last.
STAGES = ("kernels", "probe", "epilogue", "profile", "logits", "train", "bench")
TARGET_RUNS = 1
# The schedule's arithmetic, from the H200 lease's measured stage times at e17ad62 (bench/measured/h200-2026-11-27-
# e17ad62/gpu_check.log: setup 1, kernels 181 with 12 workers, probe 42, bench 1 158, logits 84, train 56, profile 12
# s; bench 2 to 7 never started): the stages share DEADLINE_S less SUMMARY_RESERVE_S = 545 s, and that run's stages
# took 534 s. This one adds the epilogue probe (about 30 s, an estimate: EPILOGUE_LIMIT_S) and two contenders to
# bench 1, erpo-dh32 and erpo-epi (about 20 s each, an estimate: BENCH_RUNS' comment), 70 s that the lease did not
# have. The fused path's open questions come first (its targets, its geometry, the epilogue, where its time goes); of
# the rest, the least informative go last: the logits path met its targets on two leases (bench/RESULTS.md) and the
# training stage passed on three, so the profile now runs right after bench 1, the logits check after it and the
# training last. The kernel tier now leaves its CPU-bound tests and the sm_90 compile checks to CI (KERNEL_WORKERS'
# comment): about 90 s instead of 181 (an estimate), and the logits check no longer runs the one-node loss's tests,
# which the tier runs whole: about 68 s instead of 84 (84 less their 16 s by pytest's clock, an estimate). At those
# times: setup 1 + kernels 90 + probe 42 + epilogue 30 + bench 1 198 + profile 12 = 373 s, then the logits check (68
# s: 441 s) and the training whole (56 s: 497 s), and 48 s left for bench 2 on (torch.compile on the logits path: 19 s
# at 60b3625), 32 s with the probe's pick (16 s more in bench 1). Where the kernel tier, the probes and bench 1 run to
# their limits instead (1 + 160 + 55 + 40 + 230 = 486 s, 506 with the pick), the profile fits (at its limit, 25 s:
# 511 s) and the logits check gets 34 s of its 80 (14 s with the pick: not started), the training none: the most
# wanted work first. The limits are each stage's measured time plus about a fifth, no more (an estimate's more), so
# that a hung stage costs the later ones as little as it can.
WHEELS = REPO / ".whl"       # liger-kernel, cut-cross-entropy, math-verify and its two needs (bench/README.md)
# pytest's one-line failure messages are cut to the terminal's width (80 columns in a pipe): wide enough for a message
WIDE_COLUMNS = "300"


@dataclass
class BenchRun:
    """One `python -m bench` run of the bench stage: rows N, paths, contenders kept / left out, why some are left
    out, the contender the fused probe picked for it and the epilogue probe's pick, timed in erpo-epi's place (bench
    1 only: `GpuCheck.bench`)."""

    name: str
    n: str
    cap_s: float
    contenders: str | None = None
    skip: tuple = ()
    paths: str | None = None
    left_out: str = ""
    picked: str | None = None
    epilogue: str | None = None

    def arguments(self, smoke: bool) -> list:
        skip = ["--skip", ",".join(self.skip)] if self.skip else []
        if smoke:  # the smoke shape on the CPU, logits path, the quick contenders (the interpreter and Inductor's
            # C++ builds take minutes there; tests/kernels/test_bench_smoke.py runs them); a picked fused-path
            # contender is in the command, checked by the bench and, off its path, not run
            picked = [key for key in (self.picked, self.epilogue) if key]
            return ["--smoke", "--paths", "logits", "--contenders", ",".join([DRY_RUN_CONTENDERS, *picked]), *skip]
        listed = [self.epilogue if self.epilogue and key == "erpo-epi" else key
                  for key in (self.contenders.split(",") if self.contenders else [])]
        contenders = ",".join(listed + ([self.picked] if self.picked else []))
        return (["--n", self.n, "--budget", "2"] + (["--paths", self.paths] if self.paths else [])
                + (["--contenders", contenders] if contenders else []) + skip)


# Most wanted first; the logits stage has already measured ours and Liger on the logits path at every N. On the
# 2026-11-26 H100 run, ours at every N (now bench 3) took 77 s; torch.compile of the logits loss at N=16384 took 30 s
# (its first row: compiling), and the peers' run then stopped at its 39 s. So the fused path's targets come first:
# ours, torch.compile and Liger side by side in one run at the target size N=16384, then 4096 (its cap is for an
# estimate of about 100 s, not measured as one run: on the H200, 2026-11-26, ours and torch.compile there took 55 s of
# rows, and Liger's fused fwd+bwd took 0.3-1.4 s a call, 2026-11-25); then torch.compile on the logits path; then
# the rest (N=65536, the other peers and kernel variants, any new contender) with whatever is left.
# Bench 1 also times ours with a 2 GiB workspace (erpo-ws2g: what a user with the memory gets, issue 32), right after
# ours at each case: at 60b3625 (bench/measured/h100-2026-11-26-60b3625/, H100) the run took 125 s of its 150 s cap
# and ours' four rows 21.6 s of it (bench.jsonl's wall_s, the first compiling the kernels), so about 145 s with
# erpo-ws2g (an estimate: its four rows should cost about ours' less the compiles); the cap was that plus about a
# fifth, 175 s. The H200 at e17ad62 measured the run at 158 s; erpo-dh32 and erpo-epi add two contenders (about 20 s
# each, an estimate: erpo-ws2g's four rows took 16.3 s there; erpo-epi's first call also compiles its Triton GEMM),
# so about 198 s and a cap of 230 s (a fifth more would come out of the logits check's time: the schedule's comment
# above). Its rows at N=65536 come last, with whatever is left.
BENCH_RUNS = (
    # erpo-dh32: ours with d hidden held in fp32; erpo-epi: ours with the forward row pass in the logits GEMM's
    # epilogue (issue 32; bench/README.md, "Deciding d hidden's dtype", "Deciding the epilogue row pass")
    BenchRun("ours and the targets' peers on the fused path at N=16384 and 4096", "16384,4096", cap_s=230,
             paths="fused", contenders="erpo,erpo-ws2g,erpo-dh32,erpo-epi,compile,liger"),
    # measured 19 s at 60b3625; its first row at N=16384 (compiling) took 30 s at b8b4a78: that plus about a fifth
    BenchRun("torch.compile on the logits path at N=16384 and 4096", "16384,4096", cap_s=40, paths="logits",
             contenders="compile"),
    # ours with each forward-kernel variant side by side (bench/contenders.py), so one lease picks the variant:
    # measured 77 s (b8b4a78) and 70 s (60b3625)
    BenchRun("ours at every N", "4096,16384,65536", cap_s=95, contenders="erpo,erpo-warp-1024,erpo-log2-2048"),
    BenchRun("peers at N=65536", "65536", cap_s=150, skip=("erpo", "torch"),
             left_out="torch eager (backend='torch', the readable reference) at N=65536: the slowest contender by "
                      "far (bench/RESULTS.md, N=16384); at four times the rows its check and at least 3 timed runs "
                      "each of fwd and fwd+bwd would take most of the bench stage"),
    BenchRun("the other peers at N=16384 and 4096", "16384,4096", cap_s=DEADLINE_S, skip=("erpo", "compile", "liger")),
    # the logits kernels' variants not in bench 3 ("log2-1024" is erpo's default): whatever time is left
    BenchRun("the other kernel variants at every N", "4096,16384,65536", cap_s=DEADLINE_S,
             contenders="erpo-warp,erpo-block,erpo-log2"),
    # measured at 55b63b0 by bench.fused_probe (bench/measured/h100-2026-11-26-55b63b0/): here beside ours in one run
    BenchRun("ours with a 2 GiB workspace at N=65536", "65536", cap_s=DEADLINE_S, paths="fused",
             contenders="erpo,erpo-ws2g"),
)


@dataclass
class Stage:
    """A finished (or stopped) stage: what ran, under which limit, how long, how it ended."""

    name: str
    command: list
    limit_s: float
    seconds: float = 0.0
    exit_code: int | None = None
    status: str = "not run"   # ok | failed | time limit | stopped (SIGTERM or SIGINT) | not run (no time left, or after
    #                           the signal)
    notes: list = field(default_factory=list)
    began: datetime.datetime | None = None  # local time, as nvidia-smi stamps its samples (bench.gpu_clocks)
    ended: datetime.datetime | None = None


class GpuCheck:
    """One run of the check: its stages so far, the environment they run in, the files under `out`; temporary
    files (the training run, the bench's own outputs, the wheels' site folder) go to `work`."""

    def __init__(self, out_dir: Path, dry_run: bool, commit: str | None, deadline_s: float = DEADLINE_S,
                 stage_limit_s: float | None = None):
        self.out = out_dir
        self.deadline_s = deadline_s
        self.stage_limit_s = stage_limit_s  # every stage's limit in place of its own (main(): the dry run's ceiling)
        self.dry_run = dry_run
        self.commit = commit
        self.start = time.monotonic()
        self.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.work = Path(tempfile.mkdtemp(prefix="erpo-gpu-check-"))
        self.stages: list = []
        self.device = "CPU (dry run)" if dry_run else "no nvidia-smi"
        self.wheels = "none"
        self.pick = Pick(None, "none: the probe did not run")  # the probe's geometry for bench 1 (bench.probe_pick)
        # the epilogue probe's config and launch for bench 1's erpo-epi (bench.epilogue_pick)
        self.epilogue_pick = Pick(None, "none: the epilogue probe did not run")
        self.stopped_by: signal.Signals | None = None  # the SIGTERM or SIGINT gpu_check got (stop_on_signals)
        self.clocks = gpu_clocks.ClockSampler(out_dir / "clocks.csv")  # started by setup(), stopped by main()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH")) if p)
        # pytest's failure lines uncut; logits_gpu_check.sh runs this interpreter and records this commit
        self.env.update(COLUMNS=WIDE_COLUMNS, PYTHON=sys.executable, **({"COMMIT": commit} if commit else {}))
        if dry_run:  # the CPU even on a GPU machine
            self.env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
            self.clocks.note = "not sampled: dry run on the CPU"

    # ---- bookkeeping ------------------------------------------------------------------------------------------

    def log(self, text: str) -> None:
        stamp = f"[{time.monotonic() - self.start:6.1f} s] "
        with open(self.out / "gpu_check.log", "a", encoding="utf-8") as handle:
            handle.write("".join(stamp + line + "\n" for line in text.splitlines() or [""]))
        print(stamp + text, flush=True)

    def time_left(self, reserve_s: float = SUMMARY_RESERVE_S) -> float:
        return self.deadline_s - reserve_s - (time.monotonic() - self.start)

    def run(self, name: str, command: list, log_file: Path, limit_s: float, mirror: tuple | None = None,
            reserve_s: float = SUMMARY_RESERVE_S) -> Stage:
        """Run `command` (output appended to `log_file`) for at most `limit_s` seconds and at most what is left before
        the deadline less `reserve_s`; `mirror` = (src, dst): copy src to dst every few seconds while it runs and at
        its end."""
        limit = min(limit_s if self.stage_limit_s is None else self.stage_limit_s, self.time_left(reserve_s))
        stage = Stage(name, command, round(limit, 1))
        self.stages.append(stage)
        if self.stopped_by:
            stage.notes.append(f"not started: gpu_check got {self.stopped_by.name}")
            self.log(f"{name}: not started ({self.stopped_by.name})")
            return stage
        if limit < MIN_STAGE_S:
            stage.notes.append(f"not started: {max(limit, 0):.0f} s left before the deadline")
            self.log(f"{name}: not started ({max(limit, 0):.0f} s left)")
            return stage
        self.log(f"{name}: limit {limit:.0f} s: {shlex.join(command)}")  # as a shell takes it: -m 'not cpu_only'
        begin = time.monotonic()
        stage.began = datetime.datetime.now()
        with open(log_file, "a", encoding="utf-8") as handle:
            handle.write(f"$ {shlex.join(command)}\n")
            handle.flush()
            process = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=handle, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            while process.poll() is None and time.monotonic() - begin < limit and not self.stopped_by:
                try:  # returns as the stage ends (a short stage costs no more than its own time)
                    process.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
                if mirror and int(time.monotonic() - begin) % 5 == 0:
                    _copy(*mirror)
            if process.poll() is None:
                _stop_group(process)
                if self.stopped_by:
                    handle.write(f"\n[gpu_check] stopped: gpu_check got {self.stopped_by.name}\n")
                    stage.status = f"stopped ({self.stopped_by.name})"
                else:
                    handle.write(f"\n[gpu_check] stopped at the stage's time limit ({limit:.0f} s)\n")
                    stage.status = "time limit"
            else:
                stage.status = "ok" if process.returncode == 0 else "failed"
            stage.exit_code = process.returncode
        stage.ended = datetime.datetime.now()
        if mirror:
            _copy(*mirror)
        stage.seconds = round(time.monotonic() - begin, 1)
        self.log(f"{name}: {stage.status} (exit {stage.exit_code}) after {stage.seconds:.0f} s")
        self.write_summary()
        return stage

    # ---- the stages -------------------------------------------------------------------------------------------

    def setup(self) -> None:
        self.log(f"gpu_check {'dry run ' if self.dry_run else ''}in {REPO}, results in {self.out}, work in {self.work}")
        wheels = sorted(WHEELS.glob("*.whl"))
        if self.dry_run or not wheels:
            self.log("wheels: none installed" + (" (dry run)" if self.dry_run else f" (no {WHEELS}/*.whl)"))
        else:
            site = self.work / "site"
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                   "--no-compile", "--disable-pip-version-check", "--target", str(site),
                                   *map(str, wheels)], capture_output=True, text=True, timeout=120)
            self.wheels = ", ".join(w.name for w in wheels) + ("" if done.returncode == 0 else " (pip failed)")
            self.log(f"wheels: {self.wheels}: pip exit {done.returncode}"
                     + (f"\n{done.stdout}{done.stderr}" if done.returncode else ""))
            self.env["PYTHONPATH"] = os.pathsep.join([str(site), self.env["PYTHONPATH"]])
        versions = []
        for name in ("torch", "triton", "transformers", "pytest", "pytest-timeout", "pytest-xdist"):
            try:
                versions.append(f"{name} {importlib.metadata.version(name)}")
            except importlib.metadata.PackageNotFoundError:
                versions.append(f"{name} missing")
        self.log("python " + sys.version.split()[0] + "; " + ", ".join(versions))
        if shutil.which("nvidia-smi") and not self.dry_run:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            self.device = smi.stdout.strip() or smi.stderr.strip()
        self.log(f"device: {self.device}")
        if not self.dry_run:  # from here to main()'s end, whatever the stages do
            self.clocks.start(errors=self.out / "gpu_check.log")
        self.log(f"clocks: {self.clocks.note}")

    def kernels(self) -> None:
        python = sys.executable
        if self.dry_run:
            command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DRY_RUN_KERNEL_TESTS]
        else:
            # not -q: the header names the plugins, the limits and the number of tests collected
            command = [python, "-m", "pytest", "-rfE", "--tb=short", "-p", "no:cacheprovider", "--durations=0",
                       "--durations-min=1"]
            command += ["-m", KERNEL_MARKS]
            if importlib.util.find_spec("xdist"):  # a file per worker: a module fixture runs once
                command += ["-n", str(KERNEL_WORKERS), "--dist", "loadfile"]
                if _version("pytest-xdist") >= (3, 8):  # the files in the command line's order (the GPU image: 3.8.0)
                    command.append("--no-loadscope-reorder")
            if _version("pytest-timeout") >= (2, 3):  # --session-timeout since 2.3 (the GPU image: 2.5.0)
                command += ["--timeout", str(KERNEL_TEST_TIMEOUT_S), "--session-timeout", str(KERNEL_SESSION_S)]
            command += kernel_files()
        self.run("kernels", command, self.out / "kernel-tests.log", KERNEL_LIMIT_S)

    def probe(self) -> None:
        """bench.fused_probe into the work folder (its report goes into summary.md, its rows as they come to
        bench.log); the dry run runs its --smoke under the interpreter."""
        command = [sys.executable, "-m", "bench.fused_probe", "--out", str(self.work / "fused-probe")]
        command += ["--smoke"] if self.dry_run else ["--shapes", PROBE_SHAPES, "--n", str(PROBE_N)]
        if self.commit:
            command += ["--commit", self.commit]
        stage = self.run("probe", command, self.out / "bench.log", PROBE_LIMIT_S)
        self.pick = (pick_geometry(self.work / "fused-probe" / PROBE_JSON) if stage.status == "ok"
                     else Pick(None, f"none: the probe {stage.status}"))
        self.log(f"bench 1's geometry pick: {self.pick.why}")

    def epilogue(self) -> None:
        """bench.gemm_epilogue_probe into the work folder (its report goes into summary.md, its chunks as they end to
        bench.log), then its pick for bench 1's erpo-epi (bench.epilogue_pick; the dry run's from the smoke run's
        rows against its first config); the dry run runs its --smoke under the interpreter."""
        command = [sys.executable, "-m", "bench.gemm_epilogue_probe", "--out", str(self.work / "epilogue-probe")]
        command += ["--smoke"] if self.dry_run else ["--shapes", PROBE_SHAPES, "--rows", EPILOGUE_ROWS]
        if self.commit:
            command += ["--commit", self.commit]
        stage = self.run("epilogue", command, self.out / "bench.log", EPILOGUE_LIMIT_S)
        if stage.status in ("ok", "time limit"):  # stopped at its limit, it leaves the chunks it finished
            if self.dry_run:
                from erpo_kernels.triton_logits_gemm import Launch

                from .gemm_epilogue_probe import SMOKE
                target = ([SMOKE["shape"]], int(SMOKE["rows"]), (str(SMOKE["configs"][0]), str(Launch())))
            else:
                target = (PROBE_SHAPES.split(","), PICK_ROWS, None)
            self.epilogue_pick = pick_epilogue(self.work / "epilogue-probe" / EPILOGUE_JSON, *target)
        else:
            self.epilogue_pick = Pick(None, f"none: the epilogue probe {stage.status}")
        self.log(f"bench 1's epilogue pick: {self.epilogue_pick.why}")

    def logits(self) -> None:
        """bench/logits_gpu_check.sh into the work folder (it keeps its own log there), packed into logits.tar.gz with
        the stage's log beside it (LOGITS_STAGE_LOG)."""
        folder = self.work / "logits"
        folder.mkdir()
        command = ["bash", "bench/logits_gpu_check.sh", *(["--dry-run"] if self.dry_run else []), str(folder)]
        stage = self.run("logits", command, folder / LOGITS_STAGE_LOG, LOGITS_LIMIT_S)
        if stage.status != "not run":
            with tarfile.open(self.out / "logits.tar.gz", "w:gz") as tar:
                tar.add(folder, arcname="logits")

    def train(self) -> None:
        run_dir = self.work / "train"
        command = [sys.executable, "-m", "erpo", "train", "--output-dir", str(run_dir), "--max-steps",
                   "1" if self.dry_run else str(TRAIN_STEPS), "--set", "trainer.updater=torch",
                   f"model.cache_dir={self.work / 'model-cache'}"]
        if self.dry_run:  # one tiny step: a few SFT steps, 8 prompts, 2 rollouts of 4 tokens
            command += ["tiny.sft_steps=2", "tiny.sft_examples=16", "tiny.sft_batch_size=8", "data.num_examples=8",
                        "rollout.n=2", "rollout.max_new_tokens=4", "trainer.rollout_batch_size=2",
                        "trainer.update_batch_size=2", "trainer.micro_batch_size=4"]
        # its output (a few lines) in gpu_check.log: the clock samples took train.log's place among the 8 files
        self.run("train", command, self.out / "gpu_check.log", TRAIN_LIMIT_S,
                 mirror=(run_dir / "metrics.jsonl", self.out / "train-metrics.jsonl"))

    def profile(self) -> None:
        command = [sys.executable, "-m", "bench.kernel_profile", "--path", "fused", "--contenders", "erpo",
                   "--host-layout", "--out", str(self.work / "fused-profile")]  # and erpo@host-layout: the trainer's
        command += ["--smoke"] if self.dry_run else ["--n", "16384"]
        if self.commit:
            command += ["--commit", self.commit]
        self.run("profile", command, self.out / "bench.log", PROFILE_LIMIT_S)

    def bench(self, numbers: range) -> None:
        """The bench runs `numbers` (1 is BENCH_RUNS' first) in turn. The dry run runs the first at smoke size (the
        bench's rows, progress file and merge) and gives the others their own arguments with `--plan`: the bench
        checks them and lists the rows they would measure, running none (a smoke run each would only repeat the
        first's)."""
        for index in numbers:
            plan = BENCH_RUNS[index - 1]
            if index == 1 and self.pick.key:  # the probe's geometry beside ours and torch.compile (PICKED_CAP_S)
                plan = replace(plan, picked=self.pick.key, cap_s=plan.cap_s + PICKED_CAP_S)
            if index == 1 and self.epilogue_pick.key:  # erpo-epi at the epilogue probe's pick: no other contender
                plan = replace(plan, epilogue=self.epilogue_pick.key)
            smoke = self.dry_run and index == 1
            command = [sys.executable, "-m", "bench", *plan.arguments(smoke), "--progress",
                       str(self.out / "bench.jsonl"), "--out", str(self.work / f"bench-{index}")]
            if self.commit:
                command += ["--commit", self.commit]
            if self.dry_run and not smoke:
                command.append("--plan")
            stage = self.run(f"bench {index}: {plan.name}", command, self.out / "bench.log", plan.cap_s)
            if plan.left_out:
                stage.notes.append("left out: " + plan.left_out)
            if plan.picked:
                stage.notes.append(f"with the probe's pick {plan.picked} (its rows last in each case)")
            if plan.epilogue:
                stage.notes.append(f"erpo-epi at the epilogue probe's pick: {plan.epilogue} in its place (its rows "
                                   "last in each case)")
            if "--plan" in command:
                stage.notes.append("dry run: its arguments checked and its rows listed in bench.log (--plan), none run")

    def merge_bench(self) -> None:
        """The bench stage's runs as one table (its markdown goes into summary.md): a stage like the others (its output
        in bench.log, its time limit one line and a row of the table), run within the summary's reserve (the dry run:
        its stages' ceiling: on a loaded CPU the merge's imports alone took the reserve)."""
        progress = self.out / "bench.jsonl"
        if progress.exists():
            self.run("bench merge", [sys.executable, "-m", "bench", "--merge", str(progress), "--out",
                                     str(self.work / "bench-merged")], self.out / "bench.log", SUMMARY_RESERVE_S,
                     reserve_s=0)

    # ---- the summary ------------------------------------------------------------------------------------------

    def write_summary(self) -> None:
        lines = [f"# GPU check{' (dry run on the CPU: no measurement)' if self.dry_run else ''}", "",
                 f"- device: {self.device}; wheels: {self.wheels}",
                 f"- started: {self.started_at}; {time.monotonic() - self.start:.0f} s so far",
                 f"- commit: {self.commit or 'not given (--commit)'}",
                 f"- command: `bash bench/gpu_check.sh {' '.join(sys.argv[1:])}`",
                 f"- clocks: {self.clocks.note}",
                 *([f"- stopped: gpu_check got {self.stopped_by.name}; the stage then running was stopped with its "
                    "process group, no later stage started"] if self.stopped_by else []),
                 "", gpu_clocks.LEGEND, "",
                 "| stage | status | seconds | limit s | exit | " + " | ".join(gpu_clocks.COLUMNS) + " | command |",
                 "|---" * (6 + len(gpu_clocks.COLUMNS)) + "|"]
        samples = gpu_clocks.read_samples(self.clocks.csv)
        for stage in self.stages:
            command = shlex.join(stage.command).replace(str(self.work), "$WORK").replace(str(self.out), "$OUT")
            clocks = " | ".join(gpu_clocks.stage_cells(samples, stage.began, stage.ended))
            lines.append(f"| {stage.name} | {stage.status} | {stage.seconds:.0f} | {stage.limit_s:.0f} | "
                         f"{stage.exit_code} | {clocks} | `{command}` |")
        lines += [f"- {stage.name}: {note}" for stage in self.stages for note in stage.notes]
        lines += ["", "## Kernel tier", "", *kernel_summary(self.out / "kernel-tests.log"),
                  "", "## Fused probe", "", f"- {GEOMETRY_PICK_LABEL}: {self.pick.why}",
                  *report_summary(self.work / "fused-probe" / "fused_probe.md"),
                  "", "## GEMM epilogue probe", "",
                  f"- {EPILOGUE_PICK_LABEL}: {self.epilogue_pick.why}",
                  *report_summary(self.work / "epilogue-probe" / "gemm_epilogue_probe.md"),
                  "", "## Logits check (logits.tar.gz)", "", *logits_summary(self.work / "logits"),
                  "", "## Training", "", *train_summary(self.out / "train-metrics.jsonl"),
                  "", "## Fused-path profile", "", *report_summary(self.work / "fused-profile" / "profile.md"),
                  "", "## Ours' default call, by tool", "",
                  *ours_by_tool_lines(self.work / "fused-probe" / PROBE_JSON, self.out / "bench.jsonl",
                                      self.work / "fused-profile" / "profile.json", PROBE_N),
                  "", "## Bench", "", *bench_summary(self.out / "bench.jsonl", self.work / "bench-merged/results.md")]
        (self.out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


    def write_decisions(self) -> None:
        """summary.md's last section, once the summary is whole: bench.decide's verdict per rule of bench/README.md on
        this lease's files, the probes' JSON files in the work folder too (`decision_lines` never raises: a lease's
        summary never fails on it)."""
        with open(self.out / "summary.md", "a", encoding="utf-8") as handle:
            handle.write("\n".join(["", *decision_lines([self.out, self.work])]) + "\n")


def _copy(source: Path, target: Path) -> None:
    if source.exists():
        shutil.copyfile(source, target)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group, SIGKILL 10 s later if it is still there."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def kernel_files() -> list:
    """The kernel tier's test files (paths from the repository's root): KERNEL_FILES_FIRST in their order, then the
    others sorted, as pytest collects a folder. A name there that no longer exists is left out (CI's
    tests/repo/test_gpu_check.py fails on it first)."""
    first = [f"{KERNEL_TIER}/{name}" for name in KERNEL_FILES_FIRST if (REPO / KERNEL_TIER / name).is_file()]
    every = sorted(path.relative_to(REPO).as_posix() for path in (REPO / KERNEL_TIER).rglob("test_*.py"))
    return first + [path for path in every if path not in first]


def _version(distribution: str) -> tuple:
    """An installed distribution's (major, minor), (0, 0) when it is missing."""
    try:
        return tuple(int(part) for part in importlib.metadata.version(distribution).split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _demoted(markdown: str) -> list:
    """A results.md under one of the summary's sections: its title and its columns' legend (bench/README.md has it)
    left out, its headings one level down."""
    lines = markdown.splitlines()[1:]
    lines = lines[:lines.index("## Columns")] if "## Columns" in lines else lines
    return [("#" + line if line.startswith("#") else line) for line in lines]


def report_summary(report: Path) -> list:
    """A stage's markdown report (the probe's fused_probe.md, the epilogue probe's gemm_epilogue_probe.md, the
    profile's profile.md), its title left out. The probe and the profile write it at their end: one stopped at its
    limit has none, its rows so far are in bench.log (the epilogue probe's holds the chunks it finished)."""
    if not report.exists():
        return ["(no report: not run, failed or stopped; what it printed is in bench.log)"]
    return _demoted(report.read_text(encoding="utf-8"))


def pytest_summary(lines: list) -> list:
    """pytest's result line (its last), why it stopped early (pytest-timeout's session timeout) and how many tests
    did not run then, its failures and errors (one line each, with the message where the log is wide enough) and its
    five slowest tests (bench.pytest_log reads them)."""
    run = read_pytest_log(lines)
    unrun = ("the tests not yet started did not run" + (f": {run.not_run} of them" if run.not_run else "")
             if run.not_run is None or run.not_run > 0 else "after every collected test had run")
    return ([f"- result: {run.result or 'no result line (stopped?)'}"
             + (f" (of {run.collected} collected)" if run.collected is not None else "")]
            + ([f"- stopped early: {run.stopped} ({unrun})"] if run.stopped else [])
            + [f"- {line}" for line in run.failures] + [f"- slow: `{slow.line}`" for slow in run.durations[:5]])


def kernel_summary(log: Path) -> list:
    """The kernel stage's pytest summary (pytest_summary)."""
    if not log.exists():
        return ["(no log)"]
    return pytest_summary(log.read_text(encoding="utf-8", errors="replace").splitlines())


# the logits stage's own output, packed with the script's folder (the device tool brings back 8 files: no ninth): the
# script's log (logits_gpu_check.log, which it tees) and what it printed before that began or after it ended (a bash
# error, gpu_check's note of a stop)
LOGITS_STAGE_LOG = "logits-stage.log"


def logits_summary(folder: Path) -> list:
    """logits_gpu_check.sh's results: each step's exit, the bench rows (fwd and fwd+bwd ms), the host's microseconds
    table and the profile's wall and idle time per contender."""
    log = folder / "logits_gpu_check.log"
    if not log.exists():
        return [f"(no logits_gpu_check.log: what the stage printed is {LOGITS_STAGE_LOG} in logits.tar.gz)"
                if (folder / LOGITS_STAGE_LOG).exists() else "(not run)"]
    from .progress import read_runs

    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    summary = [f"- {line}" for line in lines if re.match(r"[\w ]+: exit \d+$", line)]
    summary += [f"- profile: {line}" for line in lines if re.match(r"[\w.-]+: wall \d+ us", line)]
    progress = folder / "logits.jsonl"
    if progress.exists():
        summary += ["", "| path | shape | N | contender | status | fwd ms | fwd+bwd ms |", "|---" * 7 + "|"]
        summary += [f"| {row['path']} | {row['shape']} | {row['N']} | {row['contender']} | {row['status']} | "
                    f"{_ms(row.get('fwd_ms'))} | {_ms(row.get('fwdbwd_ms'))} |"
                    for run in read_runs(progress) for row in run["rows"]]
    host_cost = folder / "host_cost.md"
    if host_cost.exists():
        summary += ["", *host_cost.read_text(encoding="utf-8").splitlines()]
    return summary


def train_summary(metrics: Path) -> list:
    """The last logged step of the training run."""
    if not metrics.exists():
        return ["(no metrics.jsonl: see the training's output in gpu_check.log)"]
    steps = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not steps:
        return ["(metrics.jsonl is empty)"]
    last = steps[-1]
    keys = ("rollout_step", "reward", "accuracy", "loss", "qkl", "entropy", "grad_norm", "step_seconds")
    return [f"- {len(steps)} steps logged; the last: " + ", ".join(f"{k}={last.get(k)}" for k in keys)]


def bench_summary(progress: Path, table: Path) -> list:
    """Rows per status and the rows not reached, from the bench stage's --progress file, then the merged table."""
    if not progress.exists():
        return ["(no bench.jsonl)"]
    from .progress import NOT_REACHED, read_runs

    rows = [row for run in read_runs(progress) for row in run["rows"]]
    counts = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    lines = ["- rows: " + ", ".join(f"{count} {status}" for status, count in counts.items()),
             "- the table below is merged from bench.jsonl (`python -m bench --merge bench.jsonl --out DIR` rebuilds "
             "it, with its plot)"]
    lines += [f"- {row['status']}: {row['path']} {row['shape']} N={row['N']} {row['contender']}"
              + (f" ({row['detail']})" if row.get("detail") and row["status"] != NOT_REACHED else "")
              for row in rows if row["status"] not in ("ok",)]
    return lines + (["", *_demoted(table.read_text(encoding="utf-8"))] if table.exists() else [])


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_on_signals(check: GpuCheck) -> dict:
    """From here on, SIGTERM (the device tool's timeout for the call, `kill`) and SIGINT (Ctrl+C) only record the
    signal in `check.stopped_by`, and main() ends the check through its normal path: Python's default for SIGTERM ends
    the process without running `finally` blocks, leaving the running stage (a session of its own) on the GPU and the
    clock sampler running, and without the summary. The running stage's wait loop sees the signal within a second and
    stops its process group as at its time limit, no later stage starts (GpuCheck.run), then the sampler is stopped
    and the summary written. A second signal changes nothing: the stop takes at most _stop_group's 20 s. Returns the
    handlers it replaced, which main() puts back once the summary is written (main() also runs inside pytest)."""
    def record(signum, frame):
        check.stopped_by = check.stopped_by or signal.Signals(signum)
    return {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bash bench/gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=os.environ.get("OUT"),
                        help="where the 8 result files go (default: $OUT, as on the device machine)")
    parser.add_argument("--dry-run", action="store_true", help="the same stages on the CPU, shrunk (CI)")
    parser.add_argument("--commit", default=None, help="the commit the working tree is (recorded by the bench)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma list of {', '.join(STAGES)} (default: all; the bench's first run right after "
                             f"the epilogue probe, its others last); e.g. --stages kernels,probe, the kernel tier and "
                             f"the fused probe alone (at most {KERNEL_LIMIT_S + PROBE_LIMIT_S} s), for a lease too "
                             "short for the rest")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help=f"the whole command's time (default {DEADLINE_S}, the dry run's {DRY_RUN_DEADLINE_S}); "
                             "less leaves room for a second check in the same device call")
    args = parser.parse_args(argv)
    if args.deadline is None:
        args.deadline = DRY_RUN_DEADLINE_S if args.dry_run else DEADLINE_S
    if not args.out_dir:
        parser.error("give OUT_DIR (or set $OUT)")
    stages = [name for name in args.stages.split(",") if name]
    if not stages or set(stages) - set(STAGES):
        parser.error(f"--stages: expected a comma list of {', '.join(STAGES)}, got {args.stages!r}")
    if args.deadline < SUMMARY_RESERVE_S + MIN_STAGE_S:
        parser.error(f"--deadline: at least {SUMMARY_RESERVE_S + MIN_STAGE_S} s (the summary's reserve and one stage)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check = GpuCheck(out, args.dry_run, args.commit, args.deadline,
                     stage_limit_s=DRY_RUN_STAGE_LIMIT_S if args.dry_run else None)
    replaced = stop_on_signals(check)
    try:
        check.setup()
        if "kernels" in stages:
            check.kernels()
        if "probe" in stages:
            check.probe()
        if "epilogue" in stages:
            check.epilogue()
        if "bench" in stages:
            check.bench(range(1, TARGET_RUNS + 1))
        if "profile" in stages:
            check.profile()
        if "logits" in stages:
            check.logits()
        if "train" in stages:
            check.train()
        if "bench" in stages:
            check.bench(range(TARGET_RUNS + 1, len(BENCH_RUNS) + 1))
            if not check.stopped_by:  # a stopped check ends without this process: bench.jsonl's rows are listed
                check.merge_bench()
    finally:  # no sampler outlives the check, whatever its stages did, and the summary says what they did
        check.clocks.stop()
        check.log(f"clocks: {check.clocks.note}")
        check.write_summary()
        check.write_decisions()
        for sig, handler in replaced.items():  # from here on a signal ends gpu_check as Python's default does
            signal.signal(sig, handler)
    shutil.rmtree(check.work, ignore_errors=True)
    stopped = f" (stopped: gpu_check got {check.stopped_by.name})" if check.stopped_by else ""
    check.log(f"done in {time.monotonic() - check.start:.0f} s{stopped}: {out / 'summary.md'}")
    if check.stopped_by:
        return 128 + check.stopped_by  # as a shell reports a command that a signal ended: 143 for SIGTERM
    return 0 if all(stage.status == "ok" for stage in check.stages) else 1


if __name__ == "__main__":
    sys.exit(main())
