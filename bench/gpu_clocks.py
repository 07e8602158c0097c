"""The GPU's clocks, power, temperature and clock-limit reasons through a whole GPU lease (bench/gpu_check.py), and
each stage's share of them for summary.md (issue 32: the H200 of 2026-11-27 timed one call of ours 93.2 to 96.0 ms
minutes apart, and nothing recorded whether the clocks drifted).

`nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits -lms 1000` writes one line a second into clocks.csv
under a header line naming the fields, from before the first stage to after the last. A field this driver does not
know is left out (its column then says "-"); the reasons' bitmask goes by its newer name where the older one is gone.
The bitmask's bits are nvml.h's `nvmlClocksEventReasons` (named `nvmlClocksThrottleReasons` before R535).
"""
from __future__ import annotations

import datetime
import shutil
import signal
import statistics
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("timestamp", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")
# R535 renamed clocks_throttle_reasons.* to clocks_event_reasons.* (the old names kept as deprecated aliases): a driver
# that has dropped the old name answers the new one
NEWER_NAME = {"clocks_throttle_reasons.active": "clocks_event_reasons.active"}
INTERVAL_MS = 1000
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's, in local time (datetime.now()'s, on the same machine)
QUERY_TIMEOUT_S = 30       # one query: NVML's start can take seconds where persistence mode is off
STOP_GRACE_S = 5           # after SIGINT, before SIGKILL
IDLE = 0x1                 # nvmlClocksEventReasonGpuIdle: nothing running, not news
REASONS = {0x2: "applications clocks setting", 0x4: "sw power cap", 0x8: "hw slowdown", 0x10: "sync boost",
           0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake", 0x100: "display clock setting"}
# summary.md's stage table: the columns stage_cells fills
COLUMNS = ("SM MHz median", "SM MHz min", "max temp C", "max power W", "clocks held by (not idle)")
LEGEND = ("Per stage, from the samples in clocks.csv (nvidia-smi, once a second) taken between its start and end: the "
          "SM clock's median and minimum (MHz), the highest GPU temperature (C) and power draw (W), and each reason "
          "other than idle that nvidia-smi gave for holding the clocks down, in how many of the stage's samples "
          "(\"-\": no sample).")


@dataclass(frozen=True)
class Sample:
    """One line of clocks.csv; None where the driver lacks the field or answered "[N/A]"."""

    time: datetime.datetime
    sm_mhz: float | None = None
    mem_mhz: float | None = None
    power_w: float | None = None
    temp_c: float | None = None
    reasons: int | None = None   # the clock-limit reasons' bitmask (REASONS, IDLE)


SAMPLE_FIELD = {"clocks.sm": "sm_mhz", "clocks.mem": "mem_mhz", "power.draw": "power_w", "temperature.gpu": "temp_c",
                "clocks_throttle_reasons.active": "reasons", "clocks_event_reasons.active": "reasons"}


def _query(smi: str, fields: list) -> list:
    """nvidia-smi's error lines for one query of `fields` (none: it answered); subprocess.TimeoutExpired when it
    hangs."""
    done = subprocess.run([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    return [] if done.returncode == 0 else (done.stderr or done.stdout or f"exit {done.returncode}").splitlines()


def answered_fields(smi: str) -> tuple:
    """(the fields of FIELDS this nvidia-smi answers, in order, a reason's newer name where only it is known; the
    fields it lacks; its first error line when it answered none). One query when it knows them all, else one per
    field; none more after a query that hangs."""
    try:
        if not _query(smi, list(FIELDS)):
            return list(FIELDS), [], ""
        fields, lacking, errors = [], [], []
        for field in FIELDS:
            for name in filter(None, (field, NEWER_NAME.get(field))):
                error = _query(smi, [name])
                if not error:
                    fields.append(name)
                    break
                errors += error[:1]
            else:
                lacking.append(field)
    except subprocess.TimeoutExpired:
        return [], list(FIELDS), f"no answer in {QUERY_TIMEOUT_S} s"
    return fields, lacking, (errors[0].strip() if errors and not fields else "")


class ClockSampler:
    """nvidia-smi's sampling loop writing `csv` from start() to stop(); `note` says what it samples, or why nothing."""

    def __init__(self, csv: Path):
        self.csv = csv
        self.note = "not sampled: not started"
        self.process: subprocess.Popen | None = None

    def start(self, errors: Path) -> None:
        """Start the loop (its error lines appended to `errors`), or say in `note` why not: no nvidia-smi on PATH, or
        no timestamp (a sample then belongs to no stage) or no other field answered."""
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self.note = "not sampled: no nvidia-smi on PATH"
            return
        fields, lacking, error = answered_fields(smi)
        if not fields:
            self.note = "not sampled: nvidia-smi answers no field" + (f" ({error})" if error else "")
            return
        if "timestamp" not in fields:
            self.note = "not sampled: nvidia-smi answers no timestamp (a sample would belong to no stage)"
            return
        if len(fields) < 2:
            self.note = f"not sampled: nvidia-smi answers none of {', '.join(FIELDS[1:])}"
            return
        self.csv.write_text(", ".join(fields) + "\n", encoding="utf-8")
        with open(self.csv, "a", encoding="utf-8") as out, open(errors, "a", encoding="utf-8") as err:
            # in this process's group, not a session of its own: whatever ends the lease's command ends it too
            self.process = subprocess.Popen([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                                             "-lms", str(INTERVAL_MS)], stdout=out, stderr=err,
                                            stdin=subprocess.DEVNULL)
        self.note = (f"sampled every {INTERVAL_MS} ms into clocks.csv ({', '.join(fields)})"
                     + (f"; this driver lacks {', '.join(lacking)}" if lacking else ""))

    def stop(self) -> None:
        """End the loop and wait for it: SIGINT first (Ctrl+C, which nvidia-smi's loop takes as its end, writing
        what it holds), SIGKILL after STOP_GRACE_S. Safe to call again."""
        if self.process is None:
            return
        process, self.process = self.process, None
        process.send_signal(signal.SIGINT)  # a no-op on a process already ended
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        samples = len(read_samples(self.csv))
        self.note += f"; {samples} samples, the loop's exit {process.returncode}"


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def read_samples(csv: Path) -> list | None:
    """clocks.csv's samples (Sample), in its order; a line that is not one (nvidia-smi prints XID events between
    samples) is skipped. None where nothing was sampled."""
    if not csv.exists():
        return None
    header, *lines = csv.read_text(encoding="utf-8", errors="replace").splitlines() or [""]
    fields = [name.strip() for name in header.split(",")]
    samples = []
    for line in lines:
        values = dict(zip(fields, (value.strip() for value in line.split(","))))
        try:
            time = datetime.datetime.strptime(values.get("timestamp", ""), TIMESTAMP)
        except ValueError:
            continue
        known = {SAMPLE_FIELD[name]: value for name, value in values.items() if name in SAMPLE_FIELD}
        reasons = known.pop("reasons", None)
        samples.append(Sample(time, **{key: _number(value) for key, value in known.items()},
                              reasons=int(reasons, 16) if reasons and reasons.startswith("0x") else None))
    return samples


def reason_names(mask: int) -> list:
    """The reasons other than idle in one bitmask, by name (REASONS; an unknown bit as its hex value)."""
    return [REASONS.get(1 << bit, hex(1 << bit)) for bit in range(mask.bit_length()) if mask >> bit & 1
            and 1 << bit != IDLE]


def stage_cells(samples: list | None, begin: datetime.datetime | None, end: datetime.datetime | None) -> list:
    """A stage's COLUMNS from the samples taken in [begin, end] (local time): SM clock median and minimum (MHz), max
    temperature (C) and power (W), the reasons other than idle with how many samples had each ("none" when no sample
    had one); "-" for each where no sample (or no value) falls inside, or there are no samples or no times."""
    if samples is None or begin is None or end is None:
        return ["-"] * len(COLUMNS)
    inside = [sample for sample in samples if begin <= sample.time <= end]

    def values(key: str) -> list:
        return [getattr(sample, key) for sample in inside if getattr(sample, key) is not None]

    def shown(values: list, pick) -> str:
        return f"{pick(values):.0f}" if values else "-"

    masks = values("reasons")
    counts = Counter(name for mask in masks for name in reason_names(mask))
    held = ", ".join(f"{name} ({count} of {len(masks)})" for name, count in counts.items()) or "none"
    return [shown(values("sm_mhz"), statistics.median), shown(values("sm_mhz"), min), shown(values("temp_c"), max),
            shown(values("power_w"), max), held if masks else "-"]
