"""pytest plugin that runs TRL's tests/test_grpo_trainer.py offline, against GRPOTrainer or erpo's ERPOTrainer.

Load it with `-p peer.trl.plugin` (peer/trl/run.py does, with the environment below). It

- checks that the Hugging Face libraries run offline on the stand-in cache (`HF_HOME=<cache>/hf`, `HF_HUB_OFFLINE=1`,
  set before they are imported), so a model id resolves to its stand-in (peer/trl/standins.py) and nothing else;
- maps `load_dataset("trl-internal-testing/zen", ...)` to the local stand-in folder;
- with `--peer-trainer erpo`, swaps the test modules' `GRPOTrainer` / `GRPOConfig` for erpo.integrations.trl's
  `ERPOTrainer` / `ERPOConfig` (their defaults: qkl_coef=0.01, static w(q), fused_linear=True), exactly the two names
  a user changes;
- answers `False` for an `is_*_available` check that the test file's testing_utils imports from trl.import_utils and
  the installed TRL lacks (a test revision other than the installed TRL's; the check's package is then absent);
- without a GPU, makes `use_cpu=True` the config's default (GRPOConfig's default bf16=True is refused by
  transformers on a machine without a bf16 GPU unless use_cpu is set; training then runs under CPU bf16 autocast);
- leaves out (deselects) the GPU, vLLM, Liger and vision tests, which need what this check does not cover;
- appends one JSON line per test to `--peer-report FILE`: node id, outcome, first line of the failure.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

TRAINERS = ("grpo", "erpo")
LEFT_OUT_CLASSES = {"TestGRPOTrainerSlow": "gpu", "TestGRPOTrainerVLM": "vision"}
# Lower-case fragments of test names, and of skip reasons, that mark a test as one of the left-out kinds.
LEFT_OUT_WORDS = (("vllm", "vllm"), ("liger", "liger"), ("vlm", "vision"), ("multimodal", "vision"),
                  ("accelerator", "gpu"), ("requires vision", "vision"))


def pytest_addoption(parser):
    group = parser.getgroup("erpo-trl-peer", "TRL's GRPO tests against ERPOTrainer (peer/trl)")
    group.addoption("--peer-trainer", choices=TRAINERS, default="grpo",
                    help="grpo: TRL's GRPOTrainer as is; erpo: GRPOTrainer/GRPOConfig swapped for "
                    "ERPOTrainer/ERPOConfig")
    group.addoption("--peer-cache", required=True, help="the stand-in cache written by peer.trl.standins.build_cache")
    group.addoption("--peer-report", default=None, help="append one JSON line per test outcome to this file")


def pytest_configure(config):
    from huggingface_hub import constants

    from peer.trl.standins import build_cache, hub_home

    for marker in ("slow", "low_priority", "invariant"):
        config.addinivalue_line("markers", f"{marker}: TRL's marker")
    cache = Path(config.getoption("--peer-cache")).resolve()
    home = hub_home(cache)
    if not constants.HF_HUB_OFFLINE or Path(constants.HF_HUB_CACHE).resolve() != home / "hub":
        raise pytest.UsageError(f"run with HF_HOME={home} HF_HUB_OFFLINE=1 in the environment (set before the Hugging "
                                f"Face libraries load), so the Hub ids resolve to the stand-ins; got HF_HUB_CACHE="
                                f"{constants.HF_HUB_CACHE}, offline={constants.HF_HUB_OFFLINE}")
    build_cache(cache)
    config._peer_cache = cache
    answer_missing_availability_checks()


def answer_missing_availability_checks() -> None:
    """Let `from trl.import_utils import is_X_available` succeed for a check this TRL does not define, as False."""
    import importlib

    import_utils = importlib.import_module("trl.import_utils")

    def missing(name: str):
        if name.startswith("is_") and name.endswith("_available"):
            return lambda *args, **kwargs: False
        raise AttributeError(f"module 'trl.import_utils' has no attribute {name!r}")

    import_utils.__getattr__ = missing


def left_out(item) -> str | None:
    """Why `item` is outside this check (gpu, vllm, liger, vision), or None to run it."""
    if item.cls is not None and item.cls.__name__ in LEFT_OUT_CLASSES:
        return LEFT_OUT_CLASSES[item.cls.__name__]
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("use_liger_kernel"):
        return "liger"
    reasons = [str(mark.kwargs.get("reason", "")) for mark in item.iter_markers() if mark.name in ("skip", "skipif")]
    text = " ".join([item.name] + reasons).lower()
    return next((kind for word, kind in LEFT_OUT_WORDS if word in text), None)


def local_load_dataset(cache: Path, load_dataset):
    """`load_dataset` with the stand-in data sets' Hub ids replaced by their local folders."""
    from peer.trl.standins import HUB_DATASETS, dataset_dir

    def load(path, *args, **kwargs):
        if path in HUB_DATASETS:
            path = str(dataset_dir(cache, path))
        return load_dataset(path, *args, **kwargs)

    return load


def pytest_collection_modifyitems(session, config, items):
    import datasets

    kept, dropped = [], []
    for item in items:
        (dropped if left_out(item) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        config._peer_left_out = {item.nodeid: left_out(item) for item in dropped}
    items[:] = kept

    load = local_load_dataset(config._peer_cache, datasets.load_dataset)
    datasets.load_dataset = load
    from trl import GRPOConfig, GRPOTrainer

    if config.getoption("--peer-trainer") == "erpo":
        from erpo.integrations.trl import ERPOConfig as GRPOConfig  # noqa: N814 (the swap a user makes)
        from erpo.integrations.trl import ERPOTrainer as GRPOTrainer  # noqa: N814
    swap = {"GRPOTrainer": GRPOTrainer, "GRPOConfig": GRPOConfig if torch.cuda.is_available() else on_cpu(GRPOConfig)}
    for module in {item.module for item in kept if item.module is not None}:
        if hasattr(module, "load_dataset"):
            module.load_dataset = load
        for name, value in swap.items():
            if hasattr(module, name):
                setattr(module, name, value)


def on_cpu(config_class):
    """A subclass of `config_class` whose `use_cpu` defaults to True (all else unchanged), importable from this module
    under `CPU<name>` so that the Trainer can pickle the arguments it saves."""
    name = f"CPU{config_class.__name__}"
    cpu_class = dataclasses.make_dataclass(name, [("use_cpu", bool, dataclasses.field(default=True))],
                                           bases=(config_class,))
    cpu_class.__module__ = __name__
    globals()[name] = cpu_class
    return cpu_class


def outcome(report) -> str | None:
    """passed / failed / error / skipped / xfailed / xpassed for the report that decides the test, else None."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            return "xpassed" if xfail else "passed"
        if report.skipped:
            return "xfailed" if xfail else "skipped"
        return "failed"
    if report.failed:
        return "error"
    if report.when == "setup" and report.skipped:
        return "xfailed" if xfail else "skipped"
    return None


def first_line(report) -> str:
    """The failure's first line (`ExcType: message`), the skip/xfail reason, or ''."""
    if hasattr(report, "wasxfail") and report.skipped:
        return f"xfail: {report.wasxfail}"
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.strip().splitlines()[0] if crash.message.strip() else ""
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        return str(report.longrepr[2])
    return str(report.longrepr or "").strip().splitlines()[0] if report.longrepr else ""


def pytest_runtest_logreport(report):
    path = getattr(pytest_runtest_logreport, "report_path", None)
    result = outcome(report)
    if path is None or result is None:
        return
    line = {"nodeid": report.nodeid, "outcome": result, "when": report.when, "duration": round(report.duration, 2),
            "message": first_line(report) if result not in ("passed", "xpassed") else ""}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    pytest_runtest_logreport.report_path = session.config.getoption("--peer-report")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left = getattr(config, "_peer_left_out", {})
    if left:
        kinds = {}
        for kind in left.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        terminalreporter.write_line(f"peer/trl: left out {len(left)} tests ({kinds}); trainer: "
                                    f"{config.getoption('--peer-trainer')}")
