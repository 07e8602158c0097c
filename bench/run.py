"""The benchmark loop: for each N, path and lm_head shape, build the inputs once, measure the floors, then check and
time every selected contender on those same inputs. Returns plain dicts (one row per contender and case) that
`bench.report` turns into markdown, JSON and a plot.
"""
from __future__ import annotations

import gc
import time
import traceback
from dataclasses import asdict, dataclass

import torch

from . import floors
from .check import OURS, PEERS, check_contender
from .contenders import ERPO_OPTIONS
from .problem import Shape, build_problem
from .timing import peak_memory, time_callable


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
        for contender in contenders:
            row = {"path": path, "shape": shape.name, "N": num_rows, "D": shape.hidden or None, "V": shape.vocab,
                   "S": problem.num_samples, "contender": contender.key, "label": contender.label,
                   "ours": contender.ours, "computes": contender.computes, "version": contender.version(),
                   "logits_bytes": problem.logits_bytes(element_bytes), "floor_fwd_ms": floor_fwd,
                   "floor_fwdbwd_ms": floor_fwdbwd}
            rows_out.append(row)
            started = time.perf_counter()
            with contender.knobs():  # its every call (prepare, check, timing, peak memory), put back after: erpo-geom-*
                _measure(contender, problem, row, config, log)
            row["wall_s"] = time.perf_counter() - started  # the row's whole cost (prepare, compile, check, timing)
            record("row", row)
            _free(config.device)
        del problem
        _free(config.device)
    return {"floors": floor_rows, "rows": rows_out}


def _measure(contender, problem, row: dict, config: BenchConfig, log) -> None:
    """Fill `row` with status, check results, times and memory of one contender on one problem."""
    tag = f"[{row['path']} {row['shape']} N={row['N']}] {contender.key}"
    missing = contender.requirement(config.device)
    if missing is not None:
        row.update(status=missing[0], detail=missing[1])
        log(f"{tag}: {missing[0]}: {missing[1]}")
        return
    prepared = None
    try:
        prepared = contender.prepare(problem)
        tolerance = OURS if contender.held_to_ours else PEERS
        check = check_contender(problem, prepared, contender.computes, config.check_rows, tolerance)
        row.update(tolerance=asdict(tolerance), correct=check.ok, loss=check.loss, ref_loss=check.ref_loss,
                   loss_err=check.loss_err, grad_err=check.grad_err, check_failures=check.failures)
        log(f"{tag}: check {'ok' if check.ok else 'WRONG'} loss_err={check.loss_err:.2e} "
            + " ".join(f"{k}={v:.2e}" for k, v in check.grad_err.items()))
        if not check.ok and not config.time_wrong:
            row.update(status="wrong", detail="; ".join(check.failures))
            return
        _free(config.device)
        timing = {"device": config.device, "warmup": config.warmup, "reps": config.reps,
                  "budget_s": config.budget_s}
        forward = time_callable(prepared.run, **timing)
        both = time_callable(prepared.step, **timing)
        _free(config.device)
        peak_fwd, _ = peak_memory(prepared.run, config.device)
        peak_both, grad_bytes = peak_memory(prepared.step, config.device)
        row.update(status="ok" if check.ok else "wrong",
                   detail="" if check.ok else "timed with --time-wrong: " + "; ".join(check.failures),
                   fwd_ms=forward.median_ms, fwd_p20_ms=forward.p20_ms, fwd_p80_ms=forward.p80_ms,
                   fwdbwd_ms=both.median_ms, fwdbwd_p20_ms=both.p20_ms, fwdbwd_p80_ms=both.p80_ms,
                   fwd_reps=forward.reps, fwdbwd_reps=both.reps, peak_fwd_bytes=peak_fwd,
                   peak_fwdbwd_bytes=peak_both, grad_bytes=grad_bytes,
                   workspace_bytes=None if peak_both is None else peak_both - grad_bytes)
        log(f"{tag}: fwd {forward.median_ms:.3f} ms, fwd+bwd {both.median_ms:.3f} ms"
            + ("" if peak_both is None else f", peak {peak_both / 2**30:.2f} GiB"))
    except torch.OutOfMemoryError as error:
        row.update(status="OOM", detail=_short_error(error))
        log(f"{tag}: OOM")
    except Exception as error:  # a peer's crash is a result to report, not a reason to stop the run
        row.update(status="error", detail=_short_error(error))
        log(f"{tag}: ERROR {_short_error(error)}")
        log(traceback.format_exc(limit=-3))
    finally:
        prepared = None  # drop the case's tensors (the closures above share this variable) before the next one
