"""The order in which pytest-xdist's workers take the suite's files (tests/conftest.py; --dist loadfile: a file to a
worker at a time): the slowest files first, so that no long file starts last and ends the run alone."""
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# The files that start first, slowest first (by the slowest tests of the serial suite at 47c4860, 2026-11-28,
# `--durations=80`: test_gpu_check's dry run 207 s, test_multirank's ZeRO-3 fixture 138 s and its other 2-rank
# runs, then files of several 10-70 s tests); the other files follow in pytest's order.
FILES_FIRST = (
    "distributed/test_multirank.py",
    "repo/test_gpu_check.py",
    "distributed/test_distributed.py",
    "kernels/test_epilogue_row_pass.py",
    "kernels/test_fused_linear_loss.py",
    "kernels/test_bench_geometry.py",
    "integrations/test_verl_platform.py",
    "kernels/test_bench_smoke.py",
    "train/test_pilot.py",
    "train/test_interrupt.py",
    "distributed/test_zero3.py",
    "distributed/test_openrlhf_zero3.py",
    "train/test_trainer.py",
)


def files_first_order(items: list) -> None:
    """Sort pytest's collected `items` in place: FILES_FIRST's files first, in its order, then the others as collected
    (a stable sort: a file's tests keep their order)."""
    rank = {TESTS / name: index for index, name in enumerate(FILES_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path), len(FILES_FIRST)))
