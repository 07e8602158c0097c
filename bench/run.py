"""The benchmark loop: for each N, path and lm_head shape, build the inputs once, measure the floors, then check and
warm up every selected contender on those same inputs and time their repetitions in turns (round-robin: each
contender's fwd, then its fwd+bwd, then the next contender's; `_measure_case`). Returns plain dicts (one row per
contender and case) that `bench.report` turns into markdown, JSON and a plot.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
import traceback
from dataclasses import asdict, dataclass

import torch

from . import floors
from .check import OURS, PEERS, check_contender
from .contenders import ERPO_OPTIONS
from .problem import Shape, build_problem
from .timing import Turn, peak_memory, time_in_turns, warm_up


@dataclass
class BenchConfig:
    """What to run; see `python -m bench --help` for each field."""

    shapes: list
    ns: list
    paths: list
    contenders: list
    device: torch.device
    dtype: torch.dtype
    reps: int
    warmup: int
    rows_per_sample: int
    query_frac: float
    check_rows: int
    budget_s: float
    time_wrong: bool
    seed: int


def _cases(config: BenchConfig):
    """(path, shape, N) in run order. The logits path depends on V only: one case per distinct V."""
    for rows in config.ns:
        for path in config.paths:
            seen_vocab = set()
            for shape in config.shapes:
                if path == "logits":
                    if shape.vocab in seen_vocab:
                        continue
                    seen_vocab.add(shape.vocab)
                    shape = Shape(f"V={shape.vocab}", 0, shape.vocab)
                yield path, shape, rows


def planned_rows(config: BenchConfig) -> list:
    """The (case, contender) pairs `run_benchmark` will measure, in its order: what a run stopped early (a time
    limit) did not reach is what of this list its rows lack."""
    return [{"path": path, "shape": shape.name, "N": num_rows, "D": shape.hidden or None, "V": shape.vocab,
             "contender": contender.key, "label": contender.label, "ours": contender.ours,
             "computes": contender.computes}
            for path, shape, num_rows in _cases(config) for contender in config.contenders if contender.path == path]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _short_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def run_benchmark(config: BenchConfig, log=print, record=None) -> dict:
    """Run every case; returns {"floors": [...], "rows": [...]} (units: ms, bytes, FLOP/s, bytes/s).

    `record(kind, item)`, if given, receives each floor ("floor") and each finished row ("row") as soon as it is
    measured, so that a run stopped part-way (a time limit) keeps what it did (`--progress`)."""
    record = record or (lambda kind, item: None)
    element_bytes = config.dtype.itemsize
    bandwidth = floors.copy_bandwidth(config.device, warmup=config.warmup, reps=max(config.reps, 5))
    log(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)")
    floor_rows, rows_out = [], []
    matmul_rates = {}
    for path, shape, num_rows in _cases(config):
        contenders = [c for c in config.contenders if c.path == path]
        if not contenders:
            continue
        if path == "logits":
            floor_fwd, floor_fwdbwd = floors.logits_floor_ms(num_rows, shape.vocab, element_bytes, bandwidth)
            floor = {"path": path, "shape": shape.name, "N": num_rows, "V": shape.vocab,
                     "bandwidth_Bps": bandwidth, "floor_fwd_ms": floor_fwd, "floor_fwdbwd_ms": floor_fwdbwd}
        else:
            key = (min(num_rows, floors.MATMUL_MAX_ROWS), shape.hidden, shape.vocab)
            if key not in matmul_rates:
                matmul_rates[key] = floors.matmul_rate(num_rows, shape.hidden, shape.vocab, config.dtype,
                                                       config.device, warmup=config.warmup,
                                                       reps=max(config.reps, 5))
                _free(config.device)
            rate = matmul_rates[key]
            floor_fwd, floor_fwdbwd = floors.fused_floor_ms(num_rows, shape.hidden, shape.vocab, rate)
            floor = {"path": path, "shape": shape.name, "N": num_rows, "D": shape.hidden, "V": shape.vocab,
                     "matmul_rows": key[0], "matmul_flops": rate, "floor_fwd_ms": floor_fwd,
                     "floor_fwdbwd_ms": floor_fwdbwd}
        floor_rows.append(floor)
        record("floor", floor)
        log(f"[{path} {shape.name} N={num_rows}] floor fwd {floor_fwd:.3f} ms, fwd+bwd {floor_fwdbwd:.3f} ms")
        problem = build_problem(path, shape, num_rows, rows_per_sample=config.rows_per_sample,
                                query_frac=config.query_frac, dtype=config.dtype, device=config.device,
                                seed=config.seed + num_rows, chunk_rows=config.check_rows,
                                clip_low=ERPO_OPTIONS["clip_low"], clip_high=ERPO_OPTIONS["clip_high"])
        entries = []
        for contender in contenders:
            row = {"path": path, "shape": shape.name, "N": num_rows, "D": shape.hidden or None, "V": shape.vocab,
                   "S": problem.num_samples, "contender": contender.key, "label": contender.label,
                   "ours": contender.ours, "computes": contender.computes, "version": contender.version(),
                   "logits_bytes": problem.logits_bytes(element_bytes), "floor_fwd_ms": floor_fwd,
                   "floor_fwdbwd_ms": floor_fwdbwd}
            rows_out.append(row)
            entries.append(_Entry(contender, row, f"[{path} {shape.name} N={num_rows}] {contender.key}", log))
        _measure_case(entries, problem, config)
        for entry in entries:
            record("row", entry.row)
        del problem
        _free(config.device)
    return {"floors": floor_rows, "rows": rows_out}


class _Entry:
    """One contender of a case being measured: its row, its prepared call while it is in the running, and the
    seconds spent on it (its row's `wall_s`: prepare, compile, check, warm-up, its timed calls, peak memory)."""

    def __init__(self, contender, row: dict, tag: str, log):
        self.contender, self.row, self.tag, self.log = contender, row, tag, log
        self.prepared, self.reps, self.seconds = None, (0, 0), 0.0

    @contextlib.contextmanager
    def working(self):
        """Its calls under its knobs (erpo-geom-*: put back after), their seconds added to its wall; an exception
        becomes its row's status (OOM, or error with the traceback's tail logged) and takes it out of the running:
        a peer's crash is a result to report, not a reason to stop the run."""
        started = time.perf_counter()
        try:
            with self.contender.knobs():
                yield
        except Exception as error:
            self.failed(error)
        finally:
            self.seconds += time.perf_counter() - started

    def warm_up(self, config: BenchConfig) -> None:
        """Its fwd's and fwd+bwd's untimed calls (`timing.warm_up`, whose budget may cut them), and `reps`, how many
        of each to time."""
        self.reps = tuple(warm_up(call, device=config.device, warmup=config.warmup, reps=config.reps,
                                  budget_s=config.budget_s) for call in (self.prepared.run, self.prepared.step))

    def failed(self, error: Exception) -> None:
        """Its row's status from `error`, and it out of the running."""
        self.prepared = None  # drop the case's tensors its closures hold before the next call
        if isinstance(error, torch.OutOfMemoryError):
            self.row.update(status="OOM", detail=_short_error(error))
            self.log(f"{self.tag}: OOM")
            return
        self.row.update(status="error", detail=_short_error(error))
        self.log(f"{self.tag}: ERROR {_short_error(error)}")
        self.log("".join(traceback.format_exception(error, limit=-3)))


def _measure_case(entries: list, problem, config: BenchConfig) -> None:
    """Fill the rows of one case's contenders (`_Entry`) with status, check results, times and memory: each checked
    and warmed up in turn, then their timed repetitions in turns (`time_in_turns`: round r times each contender's
    r-th fwd and fwd+bwd, so a drift of the GPU over the case's minutes falls on all alike), then each one's peak
    memory. One that runs out of memory in the turns is timed again alone after them, the others' calls dropped."""
    for entry in entries:
        with entry.working():
            _prepare_and_check(entry, problem, config)
        _free(config.device)
    for entry in entries:
        if entry.prepared is not None:
            with entry.working():
                entry.warm_up(config)
    alone = _timed_in_turns([entry for entry in entries if entry.prepared is not None], config)
    for entry in entries:
        entry.prepared = None
    for entry in alone:  # out of memory beside the others: again, alone, as the bench timed every contender before
        entry.log(f"{entry.tag}: out of memory in turns beside the others: timed alone")
        _free(config.device)
        with entry.working():
            _prepare_and_check(entry, problem, config, check=False)
            entry.warm_up(config)
        if entry.prepared is not None:
            _timed_in_turns([entry], config)
        entry.prepared = None
        _free(config.device)
    for entry in entries:
        entry.row["wall_s"] = entry.seconds


def _prepare_and_check(entry: _Entry, problem, config: BenchConfig, check: bool = True) -> None:
    """Prepare the entry's contender on `problem` and check it (bench.check); it stays in the running (its
    `prepared` set) when it passed, or with --time-wrong. Without `check`, prepare it only (its row has the check)."""
    row, contender = entry.row, entry.contender
    missing = contender.requirement(config.device)
    if missing is not None:
        row.update(status=missing[0], detail=missing[1])
        entry.log(f"{entry.tag}: {missing[0]}: {missing[1]}")
        return
    prepared = contender.prepare(problem)
    if row["path"] == "fused" and contender.held_to_ours:
        # the dtype ours holds d hidden in from the forward to the backward, as the contender runs (its knobs: erpo-dh32
        # sets GRAD_HIDDEN_FP32), beside the inputs': bench.report's memory budget target counts the difference
        from erpo_kernels.fused_linear_loss import grad_hidden_dtype
        row.update(dtype=dtype_name(config.dtype), grad_hidden_dtype=dtype_name(grad_hidden_dtype(config.dtype)))
    if check:
        tolerance = OURS if contender.held_to_ours else PEERS
        result = check_contender(problem, prepared, contender.computes, config.check_rows, tolerance)
        row.update(tolerance=asdict(tolerance), correct=result.ok, loss=result.loss, ref_loss=result.ref_loss,
                   loss_err=result.loss_err, grad_err=result.grad_err, check_failures=result.failures)
        entry.log(f"{entry.tag}: check {'ok' if result.ok else 'WRONG'} loss_err={result.loss_err:.2e} "
                  + " ".join(f"{k}={v:.2e}" for k, v in result.grad_err.items()))
        if not result.ok and not config.time_wrong:
            row.update(status="wrong", detail="; ".join(result.failures))
            return
    entry.prepared = prepared


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as a record spells it: "bfloat16", "float32", ..."""
    return str(dtype).removeprefix("torch.")


def _timed_in_turns(entries: list, config: BenchConfig) -> list:
    """Time the entries' fwd (`run`) and fwd+bwd (`Prepared.step`) repetitions in turns, then measure each one's
    peak memory and fill its row; returns the entries that ran out of memory in the turns (their rows untouched),
    the others' rows done (a call that raised otherwise: its status). Alone, one out of memory is a result too."""
    turns = {}
    for entry in entries:
        for name, call, reps in (("fwd", entry.prepared.run, entry.reps[0]),
                                 ("fwdbwd", entry.prepared.step, entry.reps[1])):
            turns[entry, name] = Turn(call, reps, entry.contender.knobs, owner=entry)
    timings, failures = time_in_turns(turns, config.device)
    alone = []
    for entry in entries:
        failure = failures.get((entry, "fwd")) or failures.get((entry, "fwdbwd"))
        if isinstance(failure, torch.OutOfMemoryError) and len(entries) > 1:
            alone.append(entry)
            continue
        forward, both = timings.get((entry, "fwd")), timings.get((entry, "fwdbwd"))
        entry.seconds += sum(sum(t.samples_ms) for t in (forward, both) if t) / 1e3  # its share of the turns
        if failure is not None:
            entry.failed(failure)
            continue
        with entry.working():
            _free(config.device)
            peak_fwd, _ = peak_memory(entry.prepared.run, config.device)
            peak_both, grad_bytes = peak_memory(entry.prepared.step, config.device)
            _fill_times(entry, forward, both, peak_fwd, peak_both, grad_bytes,
                        [other.contender.key for other in entries])
    return alone


def _fill_times(entry: _Entry, forward, both, peak_fwd, peak_both, grad_bytes, timed_with: list) -> None:
    """The row's status, times (medians, spread, every repetition in call order, the paired backward step) and
    memory."""
    row = entry.row
    row.update(status="ok" if row["correct"] else "wrong",
               detail="" if row["correct"] else "timed with --time-wrong: " + "; ".join(row["check_failures"]),
               fwd_ms=forward.median_ms, fwd_p20_ms=forward.p20_ms, fwd_p80_ms=forward.p80_ms,
               fwdbwd_ms=both.median_ms, fwdbwd_p20_ms=both.p20_ms, fwdbwd_p80_ms=both.p80_ms,
               fwd_reps=forward.reps, fwdbwd_reps=both.reps, fwd_samples_ms=forward.samples_ms,
               fwdbwd_samples_ms=both.samples_ms, bwd_step_ms=paired_step_ms(forward, both), timed_with=timed_with,
               peak_fwd_bytes=peak_fwd, peak_fwdbwd_bytes=peak_both, grad_bytes=grad_bytes,
               workspace_bytes=None if peak_both is None else peak_both - grad_bytes)
    entry.log(f"{entry.tag}: fwd {forward.median_ms:.3f} ms, fwd+bwd {both.median_ms:.3f} ms, "
              f"fwd+bwd - fwd {row['bwd_step_ms']:.3f} ms (median of the turns' pairs)"
              + ("" if peak_both is None else f", peak {peak_both / 2**30:.2f} GiB"))


def paired_step_ms(forward, both) -> float:
    """The median over the turns of fwd+bwd minus fwd of the same turn (ms; `Timing`s of one contender timed in
    turns, their samples in call order): what the backward adds, each pair timed a call apart, so that a drift of
    the device between the fwd and the fwd+bwd measurements cancels."""
    return statistics.median(b - f for f, b in zip(forward.samples_ms, both.samples_ms))
