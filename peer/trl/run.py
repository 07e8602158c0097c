"""TRL's own GRPO tests as a peer check: run tests/test_grpo_trainer.py with GRPOTrainer, then with ERPOTrainer.

    python -m peer.trl.run --trl-tests PATH [--cache DIR] [--out DIR] [--jobs 2] [--timeout 4800] [-k EXPR]
    python -m peer.trl.run --trl-tests PATH --out DIR --tabulate-only     # the table of runs already in DIR

PATH is a TRL checkout, its tests/ folder or the test file itself. TRL's source distribution ships no tests; get them
with `git clone https://github.com/huggingface/trl -b v1.16.0` (the release installed here; another revision works
too, see the notes in docs/integrations.md). The file is run twice by pytest in TRL's folder, offline, on tiny local
stand-ins for the Hub models and data sets it loads (peer/trl/standins.py, written to --cache on first use), through
the plugin peer/trl/plugin.py: once as is (GRPOTrainer), once with GRPOTrainer / GRPOConfig swapped for
erpo.integrations.trl's ERPOTrainer / ERPOConfig. GPU, vLLM, Liger and vision tests are left out.

Writes to --out: `grpo.jsonl` / `erpo.jsonl` (one line per test), `grpo.log` / `erpo.log` (pytest's output) and
`table.md`: per test the outcome with each trainer and the first line of ERPOTrainer's failure; first the tests that
fail only with ERPOTrainer, then those failing with both where ERPOTrainer's first line differs from GRPOTrainer's
(another cause); the table is also printed. The exit status is 1 when some test fails only with ERPOTrainer.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEST_FILE = "test_grpo_trainer.py"
TRAINERS = {"grpo": "GRPOTrainer", "erpo": "ERPOTrainer"}
# When a test has several reports (setup, call, teardown), the worst decides.
SEVERITY = ["passed", "xpassed", "skipped", "xfailed", "failed", "error"]
FAILED = ("failed", "error")


def resolve_test_file(path: str) -> Path:
    """The test file at, or inside, `path` (a TRL checkout, its tests/ folder, or the file)."""
    candidates = [Path(path), Path(path) / TEST_FILE, Path(path) / "tests" / TEST_FILE]
    found = next((c for c in candidates if c.is_file() and c.name == TEST_FILE), None)
    if found is None:
        raise SystemExit(f"peer.trl.run: no {TEST_FILE} at {path} (nor in its tests/ folder); pass a TRL checkout: "
                         "git clone https://github.com/huggingface/trl -b v1.16.0")
    if not (found.parent / "__init__.py").is_file():
        raise SystemExit(f"peer.trl.run: {found.parent} has no __init__.py; pass TRL's whole tests/ folder (the file "
                         "imports its testing_utils)")
    return found.resolve()


def offline_env(cache: Path) -> dict:
    """The environment of a test run: offline, the stand-ins' HF_HOME, this repository importable, one thread."""
    from peer.trl.standins import hub_home

    env = dict(os.environ, HF_HOME=str(hub_home(cache)), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("HF_HUB_CACHE", None)
    return env


def pytest_command(test_file: Path, trainer: str, cache: Path, out: Path, keyword: str | None) -> list[str]:
    """The pytest command line of one run (run in the folder above TRL's tests/)."""
    command = [sys.executable, "-m", "pytest", f"tests/{test_file.name}" if test_file.parent.name == "tests"
               else str(test_file), "-p", "peer.trl.plugin", "-p", "no:cacheprovider", "--peer-cache", str(cache),
               "--peer-trainer", trainer, "--peer-report", str(out / f"{trainer}.jsonl"), "-q", "-rfE"]
    return command + (["-k", keyword] if keyword else [])


def run_both(test_file: Path, cache: Path, out: Path, jobs: int, timeout: float, keyword: str | None) -> None:
    """Run the file with each trainer (`jobs` at a time), each under `timeout` seconds."""
    env = offline_env(cache)
    pending = list(TRAINERS)
    running = []
    while pending or running:
        while pending and len(running) < jobs:
            trainer = pending.pop(0)
            (out / f"{trainer}.jsonl").unlink(missing_ok=True)
            command = pytest_command(test_file, trainer, cache, out, keyword)
            print(f"[{trainer}] cd {test_file.parent.parent} && " + " ".join(command), flush=True)
            log = open(out / f"{trainer}.log", "w")
            process = subprocess.Popen(command, cwd=test_file.parent.parent, env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
            running.append((trainer, process, log, time.monotonic()))
        time.sleep(2)
        for entry in list(running):
            trainer, process, log, start = entry
            if process.poll() is None and time.monotonic() - start > timeout:
                process.kill()  # tests not reported by then show as "not run"
                process.wait()
            if process.poll() is not None:
                log.close()
                running.remove(entry)
                print(f"[{trainer}] exit {process.returncode} after {time.monotonic() - start:.0f} s", flush=True)


def read_outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """node id -> (outcome, first line of the failure) from a plugin report; the worst report of a test wins."""
    outcomes: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return outcomes
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        old = outcomes.get(entry["nodeid"])
        if old is None or SEVERITY.index(entry["outcome"]) > SEVERITY.index(old[0]):
            outcomes[entry["nodeid"]] = (entry["outcome"], entry["message"])
    return outcomes


def counts(outcomes: dict[str, tuple[str, str]]) -> str:
    """'60 passed, 3 failed, 2 skipped' style summary of one run."""
    tally: dict[str, int] = {}
    for outcome, _ in outcomes.values():
        tally[outcome] = tally.get(outcome, 0) + 1
    return ", ".join(f"{tally[o]} {o}" for o in SEVERITY if o in tally) or "no results"


def table(out: Path, header: list[str]) -> tuple[str, int]:
    """The markdown table of both runs in `out`, and the number of tests failing only with ERPOTrainer."""
    grpo, erpo = read_outcomes(out / "grpo.jsonl"), read_outcomes(out / "erpo.jsonl")
    nodes = list(dict.fromkeys(list(grpo) + list(erpo)))

    def erpo_only(node):
        return erpo.get(node, ("not run", ""))[0] in FAILED and grpo.get(node, ("not run", ""))[0] not in FAILED

    order = {node: i for i, node in enumerate(nodes)}
    def other_cause(node):  # fails with both trainers, but ERPOTrainer for another reason than GRPOTrainer
        g, e = grpo.get(node, ("not run", "")), erpo.get(node, ("not run", ""))
        return g[0] in FAILED and e[0] in FAILED and g[1].replace("GRPO", "ERPO") != e[1]

    nodes.sort(key=lambda node: (not erpo_only(node), not other_cause(node), order[node]))
    lines = header + ["", f"- GRPOTrainer: {counts(grpo)}", f"- ERPOTrainer: {counts(erpo)}",
                      f"- failing only with ERPOTrainer: {sum(map(erpo_only, nodes))}",
                      f"- failing with both, ERPOTrainer for another reason: {sum(map(other_cause, nodes))}", "",
                      "| test | GRPOTrainer | ERPOTrainer | ERPOTrainer's failure (first line) |", "|---|---|---|---|"]
    for node in nodes:
        g, e = grpo.get(node, ("not run", "")), erpo.get(node, ("not run", ""))
        mark = " **(ERPO only)**" if erpo_only(node) else " **(other cause)**" if other_cause(node) else ""
        message = e[1] if e[0] in FAILED else ""
        message = (message[:200] + "...") if len(message) > 200 else message
        test_id = node.split("::", 1)[-1]
        lines.append(f"| `{test_id}` | {g[0]} | {e[0]}{mark} | {message.replace('|', '/')} |")
    return "\n".join(lines) + "\n", sum(map(erpo_only, nodes))


def describe(test_file: Path) -> list[str]:
    """Header lines: date, erpo commit, library versions, the test file's hash."""
    import torch
    import transformers
    import trl

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "erpo", "erpo_kernels", "peer"],
                           capture_output=True, text=True).stdout.strip()
    digest = hashlib.sha256(test_file.read_bytes()).hexdigest()[:12]
    return [f"# TRL's GRPO tests: GRPOTrainer vs ERPOTrainer ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
            f"- erpo commit {commit.stdout.strip() or 'unknown'}{' (with uncommitted changes)' if dirty else ''}; "
            f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}",
            f"- test file {test_file} (sha256 {digest}...)"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peer.trl.run", description=__doc__.split("\n")[0])
    parser.add_argument("--trl-tests", required=True, help="a TRL checkout, its tests/ folder, or test_grpo_trainer.py")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/erpo-trl-peer"),
                        help="where the stand-ins are written (default ~/.cache/erpo-trl-peer)")
    parser.add_argument("--out", default="trl-peer-results",
                        help="reports, logs and table.md (default ./trl-peer-results)")
    parser.add_argument("--jobs", type=int, choices=(1, 2), default=1, help="run the two trainers' runs at once")
    parser.add_argument("--timeout", type=float, default=4800, help="seconds per run; unfinished tests show 'not run'")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset of the tests)")
    parser.add_argument("--tabulate-only", action="store_true", help="only build the table from the reports in --out")
    args = parser.parse_args(argv)

    test_file = resolve_test_file(args.trl_tests)
    out, cache = Path(args.out).resolve(), Path(args.cache).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.tabulate_only:
        from peer.trl.standins import build_cache
        build_cache(cache)
        run_both(test_file, cache, out, args.jobs, args.timeout, args.keyword)
    text, erpo_only = table(out, describe(test_file))
    (out / "table.md").write_text(text)
    print(text)
    return 1 if erpo_only else 0


if __name__ == "__main__":
    sys.exit(main())
