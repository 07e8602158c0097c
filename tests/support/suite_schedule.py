"""The order in which pytest-xdist's workers take the suite's files (tests/conftest.py; --dist loadfile: a file to a
worker at a time): the slowest files first, so that no long file starts last and ends the run alone."""
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# The files that start first, slowest first, by the sum of each file's tests in the --durations lists of the three
# fresh-clone suite runs of 2026-11-28 (`.ci/run`: serial, top 80, at 47c4860; parallel, top 60, at 94d0d14; parallel,
# top 30, at fac3d38; a test's latest listed time wins): a lower bound of each file's
# time (its tests under those lists' cut are not counted), in seconds, beside each file. The files of 30 s or more;
# the others follow in pytest's order, the short tail that evens out the two workers' ends. Moved since, by each file
# alone in one process (`/usr/bin/time` user+sys, `pytest -p no:xdist`, session of 2026-11-28 13:42): fused_linear_loss
# up (375 CPU-s after its trim; multirank 404, gpu_check 243, epilogue_row_pass 150 beside it); the rest as measured.
FILES_FIRST = (
    "distributed/test_multirank.py",           # 762 then (with a DeepSpeed op build since gone); 404 CPU-s alone
    "kernels/test_fused_linear_loss.py",       # 110 (375 CPU-s alone, above)
    "repo/test_gpu_check.py",                  # 275: the dry run 237
    "kernels/test_epilogue_row_pass.py",       # 163
    "distributed/test_distributed.py",         # 158
    "kernels/test_bench_geometry.py",          # 113
    "train/test_interrupt.py",                 # 106
    "integrations/test_verl_platform.py",      # 85
    "kernels/test_bench_smoke.py",             # 80
    "train/test_pilot.py",                     # 71
    "train/test_storage_faults.py",            # 53
    "distributed/test_openrlhf_zero3.py",      # 52
    "kernels/test_gemm_epilogue_probe.py",     # 43
    "distributed/test_trl_zero3.py",           # 42
    "kernels/test_compile_hopper.py",          # 39
    "train/test_resume.py",                    # 38
    "train/test_progress.py",                  # 38
    "distributed/test_step_split_ranks.py",    # 37
    "train/test_user_errors.py",               # 35
    "kernels/test_logits_loss_node.py",        # 35
    "repo/test_packaging.py",                  # 35
    "distributed/test_zero3.py",               # 33
    "repo/test_parallel_suite.py",             # 33
    "kernels/test_host_cost.py",               # 32
)


def files_first_order(items: list) -> None:
    """Sort pytest's collected `items` in place: FILES_FIRST's files first, in its order, then the others as collected
    (a stable sort: a file's tests keep their order)."""
    rank = {TESTS / name: index for index, name in enumerate(FILES_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path), len(FILES_FIRST)))
