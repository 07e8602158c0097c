"""Timing and peak memory of callables: one (`time_callable`), or several in turns (`time_in_turns`: the bench's
contenders of one case, round-robin).

On CUDA each repetition is bracketed by CUDA events (one synchronize at the end); on CPU by
`time.perf_counter`. Warm-up runs first (`warm_up`: compilation, autotuning and allocator growth stay out of the
numbers); the median of the repetitions is the reported time, with the 20th and 80th percentiles as spread, and
every repetition's time in call order.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

MIN_REPS = 3


@dataclass
class Timing:
    """Milliseconds: median, 20th and 80th percentile over `reps` repetitions (all kept in `samples_ms`)."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    samples_ms: list


def _percentile(sorted_values: list, q: float) -> float:
    index = q * (len(sorted_values) - 1)
    low = int(index)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (index - low)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(fn, *, device: torch.device, warmup: int, reps: int, budget_s: float | None = None) -> int:
    """Run `fn()`'s `warmup` untimed calls and return how many repetitions to time.

    With `budget_s`, the first warm-up call is clocked and warm-up and repetitions are cut so that each takes
    about `budget_s` seconds at most (never fewer than MIN_REPS repetitions): slow peers cannot eat the lease.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    if budget_s is not None and warmup > 0:
        _sync(device)
        begin = time.perf_counter()
        fn()
        _sync(device)
        per_call = max(time.perf_counter() - begin, 1e-6)
        fits = int(budget_s / per_call)
        warmup = min(warmup - 1, fits)
        reps = max(min(reps, fits), min(reps, MIN_REPS))
    for _ in range(warmup):
        fn()
    return reps


@dataclass
class Turn:
    """A callable's part in `time_in_turns`: `fn()` timed `reps` times, each call inside `around()` (the contender's
    knobs: entered before the call's start is marked, left after its end). The turns of one `owner` (a contender's
    fwd and fwd+bwd; None: the turn alone) leave the turns together when one of them raises."""

    fn: Callable[[], object]
    reps: int
    around: Callable[[], ContextManager] = contextlib.nullcontext
    owner: object = None


def time_in_turns(turns: dict, device: torch.device) -> tuple[dict, dict]:
    """Time the repetitions of several warmed-up callables in turns ({key: Turn}): round r calls, in the dict's
    order, each callable that has more than r repetitions, so that a drift of the device over the minutes (clocks
    under sustained GEMMs, heat) falls on every callable alike instead of on whichever ran last. Returns
    ({key: Timing}, {key: the exception its call raised}): a callable that raises leaves the turns with its
    owner's others (their samples dropped: no Timing), the rest go on. On CUDA each call is bracketed by CUDA
    events (one synchronize at the end: each call follows the one before it in flight, as in a training step); on
    CPU by `time.perf_counter`."""
    on_cuda = device.type == "cuda"
    spans, failures, out = {key: [] for key in turns}, {}, set()
    if on_cuda:
        torch.cuda.synchronize(device)
    for round_index in range(max((turn.reps for turn in turns.values()), default=0)):
        for key, turn in turns.items():
            if key in out or round_index >= turn.reps:
                continue
            with turn.around():
                try:
                    spans[key].append(_call_span(turn.fn, on_cuda))
                except Exception as error:  # e.g. out of memory beside the others: that callable's result
                    failures[key] = error
                    out |= {other for other, its in turns.items()
                            if other == key or (turn.owner is not None and its.owner is turn.owner)}
    if on_cuda:
        torch.cuda.synchronize(device)
    timings = {}
    for key, samples in spans.items():
        if key not in out:
            ms = [start.elapsed_time(end) for start, end in samples] if on_cuda else samples
            ordered = sorted(ms)
            timings[key] = Timing(statistics.median(ordered), _percentile(ordered, 0.2), _percentile(ordered, 0.8),
                                  len(ms), ms)
    return timings, failures


def _call_span(fn, on_cuda: bool):
    """One call of fn: its (start, end) CUDA events, or its milliseconds by the host's clock."""
    if on_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        return start, end
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e3


def time_callable(fn, *, device: torch.device, warmup: int, reps: int, budget_s: float | None = None) -> Timing:
    """Time `fn()` (its result is dropped after each call) `reps` times after `warmup` untimed calls (`warm_up`,
    whose `budget_s` may cut both): `time_in_turns` of fn alone."""
    reps = warm_up(fn, device=device, warmup=warmup, reps=reps, budget_s=budget_s)
    timings, failures = time_in_turns({fn: Turn(fn, reps)}, device)
    if failures:
        raise failures[fn]
    return timings[fn]


def tensor_bytes(value) -> int:
    """Bytes held by a tensor or a (nested) tuple/list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def peak_memory(fn, device: torch.device):
    """(peak bytes allocated above what was allocated before, bytes of fn's result) for one call; (None, None) off CUDA.

    The allocator's peak statistic is reset right before the call, so the number covers this call alone.
    """
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    output = tensor_bytes(result)
    del result
    return peak, output
