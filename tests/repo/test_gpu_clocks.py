"""bench.gpu_clocks: the GPU lease's clock samples (nvidia-smi's loop into clocks.csv), read back and summed per stage,
with a fake nvidia-smi on PATH that answers canned values: the per-stage cells, the fields a driver lacks left out (or
the sampling skipped, saying why), and the loop stopped, even one that ignores SIGINT."""
import datetime
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_clocks

# what the fake answers per field; the time for "timestamp"
CANNED = {"timestamp": "now", "clocks.sm": "1755", "clocks.mem": "2619", "power.draw": "612.35",
          "temperature.gpu": "58", "clocks_throttle_reasons.active": "0x0000000000000004",
          "clocks_event_reasons.active": "0x0000000000000004", "name": "NVIDIA H200", "memory.total": "143771",
          "driver_version": "580.159.04"}

FAKE_SMI = """#!{python}
# a fake nvidia-smi (tests/repo/test_gpu_clocks.py): --query-gpu=FIELDS [-lms MS]
import datetime, os, signal, sys, time
FOLDER = {folder!r}
values = {values!r}
if {fail!r}:
    print({fail!r})
    sys.exit(6)
args = sys.argv[1:]
fields = next(a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")).split(",")
if "hang" in values:
    time.sleep(60)
for name in fields:
    if name not in values:
        print(f'Field "{{name}}" is not a valid field to query.', file=sys.stderr)
        sys.exit(2)
loop_ms = int(args[args.index("-lms") + 1]) if "-lms" in args else None
if loop_ms:
    with open(os.path.join(FOLDER, "smi.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    signal.signal(signal.SIGINT, signal.SIG_IGN if {ignores_sigint!r} else lambda *_: sys.exit(0))
while True:
    now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(", ".join(now if name == "timestamp" else values[name] for name in fields), flush=True)
    if not loop_ms:
        break
    time.sleep(loop_ms / 1000)
"""


def fake_smi(folder: Path, monkeypatch, lacking=(), fail="", ignores_sigint=False, hang=False) -> Path:
    """An nvidia-smi in `folder`, first on PATH, answering CANNED less `lacking` (a field it lacks: nvidia-smi's error,
    exit 2); `fail`: printed instead, exit 6 (a driver with no GPU); `hang`: no answer for a minute. Its loop (-lms)
    writes its pid to folder/smi.pid and ends at SIGINT unless `ignores_sigint`."""
    folder.mkdir(parents=True, exist_ok=True)
    values = {name: value for name, value in CANNED.items() if name not in lacking} | ({"hang": ""} if hang else {})
    script = folder / "nvidia-smi"
    script.write_text(FAKE_SMI.format(python=sys.executable, folder=str(folder), values=values, fail=fail,
                                      ignores_sigint=ignores_sigint))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gpu_clocks, "INTERVAL_MS", 100)  # ten samples a second: a short test sees several
    return folder


def wait_for_samples(csv: Path, count: int) -> list:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        samples = gpu_clocks.read_samples(csv) or []
        if len(samples) >= count:
            return samples
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} samples in {csv}: {csv.read_text() if csv.exists() else 'no file'}")


def at(seconds: float) -> datetime.datetime:
    return datetime.datetime(2026, 11, 27, 3, 0, 0) + datetime.timedelta(seconds=seconds)


def test_a_stage_gets_the_samples_taken_during_it(tmp_path):
    csv = tmp_path / "clocks.csv"
    csv.write_text("\n".join([
        ", ".join(gpu_clocks.FIELDS),
        "2026/11/27 03:00:00.100, 1980, 2619, 120.50, 35, 0x0000000000000001",   # before the stage: idle
        "2026/11/27 03:00:01.100, 1980, 2619, 650.25, 52, 0x0000000000000000",
        "2026/11/27 03:00:02.100, 1755, 2619, 699.80, 61, 0x0000000000000004",   # sw power cap
        "Xid (PCI:0000:4e:00): 31, pid=1234, name=python3",                      # not a sample: skipped
        "2026/11/27 03:00:03.100, 1410, 2619, [N/A], 66, 0x0000000000000028",   # hw slowdown and sw thermal
        "2026/11/27 03:00:04.100, 1980, 2619, 200.00, 40, 0x0000000000000001",   # after it
    ]) + "\n")
    samples = gpu_clocks.read_samples(csv)
    assert len(samples) == 5 and samples[3].power_w is None and samples[3].reasons == 0x28
    assert gpu_clocks.stage_cells(samples, at(1), at(3.5)) == [
        "1755", "1410", "66", "700", "sw power cap (1 of 3), hw slowdown (1 of 3), sw thermal (1 of 3)"]
    assert gpu_clocks.stage_cells(samples, at(3.9), at(5)) == ["1980", "1980", "40", "200", "none"]  # idle is no news
    assert gpu_clocks.stage_cells(samples, at(10), at(20)) == ["-"] * 5   # no sample inside
    assert gpu_clocks.stage_cells(samples, None, None) == ["-"] * 5       # a stage not run
    assert gpu_clocks.stage_cells(None, at(1), at(3.5)) == ["-"] * 5      # nothing sampled (no clocks.csv)
    assert gpu_clocks.read_samples(tmp_path / "absent.csv") is None
    assert gpu_clocks.reason_names(0x1085) == ["sw power cap", "hw power brake", "0x1000"]  # an unknown bit as hex


def test_the_sampler_writes_every_field_until_stopped(tmp_path, monkeypatch):
    folder = fake_smi(tmp_path / "bin", monkeypatch)
    sampler = gpu_clocks.ClockSampler(tmp_path / "clocks.csv")
    begin = datetime.datetime.now()
    sampler.start(errors=tmp_path / "errors.log")
    try:
        samples = wait_for_samples(sampler.csv, 3)
    finally:
        sampler.stop()
    pid = int((folder / "smi.pid").read_text())
    assert gone(pid) and sampler.process is None
    assert sampler.csv.read_text().splitlines()[0] == ", ".join(gpu_clocks.FIELDS)
    assert sampler.note.startswith(f"sampled every 100 ms into clocks.csv ({', '.join(gpu_clocks.FIELDS)}); ")
    assert sampler.note.endswith(", the loop's exit 0") and "lacks" not in sampler.note
    assert samples[0] == gpu_clocks.Sample(samples[0].time, 1755, 2619, 612.35, 58, 0x4)
    cells = gpu_clocks.stage_cells(gpu_clocks.read_samples(sampler.csv), begin, datetime.datetime.now())
    assert cells[:4] == ["1755", "1755", "58", "612"] and cells[4].startswith("sw power cap (")
    sampler.stop()  # again: nothing to do


def test_a_field_the_driver_lacks_is_left_out_and_the_reasons_go_by_their_newer_name(tmp_path, monkeypatch):
    fake_smi(tmp_path / "bin", monkeypatch, lacking=("power.draw", "clocks_throttle_reasons.active"))
    sampler = gpu_clocks.ClockSampler(tmp_path / "clocks.csv")
    sampler.start(errors=tmp_path / "errors.log")
    try:
        samples = wait_for_samples(sampler.csv, 2)
    finally:
        sampler.stop()
    fields = ["timestamp", "clocks.sm", "clocks.mem", "temperature.gpu", "clocks_event_reasons.active"]
    assert sampler.csv.read_text().splitlines()[0] == ", ".join(fields)
    assert f"({', '.join(fields)}); this driver lacks power.draw; " in sampler.note  # the reasons: by their new name
    assert {(sample.power_w, sample.reasons) for sample in samples} == {(None, 0x4)}
    cells = gpu_clocks.stage_cells(samples, samples[0].time, samples[-1].time)
    assert cells[2:4] == ["58", "-"] and cells[4] == f"sw power cap ({len(samples)} of {len(samples)})"


@pytest.mark.parametrize("lacking, fail, hang, note", [
    (set(CANNED) - {"timestamp"}, "", False, "not sampled: nvidia-smi answers none of clocks.sm, clocks.mem, "
                                             "power.draw, temperature.gpu, clocks_throttle_reasons.active"),
    ({"timestamp"}, "", False, "not sampled: nvidia-smi answers no timestamp (a sample would belong to no stage)"),
    ((), "No devices were found", False, "not sampled: nvidia-smi answers no field (No devices were found)"),
    ((), "", True, "not sampled: nvidia-smi answers no field (no answer in 1 s)"),
])
def test_no_sampling_when_nvidia_smi_answers_nothing_useful(tmp_path, monkeypatch, lacking, fail, hang, note):
    folder = fake_smi(tmp_path / "bin", monkeypatch, lacking=lacking, fail=fail, hang=hang)
    monkeypatch.setattr(gpu_clocks, "QUERY_TIMEOUT_S", 1)
    sampler = gpu_clocks.ClockSampler(tmp_path / "clocks.csv")
    sampler.start(errors=tmp_path / "errors.log")
    sampler.stop()
    assert sampler.note == note and not sampler.csv.exists() and not (folder / "smi.pid").exists()


def test_no_nvidia_smi_no_sampling(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    sampler = gpu_clocks.ClockSampler(tmp_path / "clocks.csv")
    sampler.start(errors=tmp_path / "errors.log")
    assert sampler.note == "not sampled: no nvidia-smi on PATH" and sampler.process is None


def test_a_loop_that_ignores_sigint_is_killed(tmp_path, monkeypatch):
    folder = fake_smi(tmp_path / "bin", monkeypatch, ignores_sigint=True)
    monkeypatch.setattr(gpu_clocks, "STOP_GRACE_S", 0.5)
    sampler = gpu_clocks.ClockSampler(tmp_path / "clocks.csv")
    sampler.start(errors=tmp_path / "errors.log")
    wait_for_samples(sampler.csv, 1)
    sampler.stop()
    assert gone(int((folder / "smi.pid").read_text())) and sampler.note.endswith(", the loop's exit -9")


def gone(pid: int) -> bool:
    """Whether process `pid` has ended and been reaped (the sampler waits for its loop)."""
    return not Path(f"/proc/{pid}").exists()
