"""Evaluation metrics over k sampled answers per problem: Avg@k, unbiased Pass@k, Pass@1.

Conventions (the paper's section 5 and Chen et al. 2021, "Evaluating LLMs trained on code"):

- ``avg_at_k``: mean correctness over the k samples of one problem (a fraction in [0, 1]).
- ``pass_at_k(n, c, k)``: unbiased estimate of the probability that at least one of k samples is
  correct, given n >= k samples of which c are correct: ``1 - C(n-c, k) / C(n, k)``.
- Pass@1 in our tables is the accuracy of the first sample of each problem (a single-sample run with
  the same seed). The unbiased ``pass_at_k(n, c, 1)`` equals ``c / n``, i.e. Avg@n, so it would add no
  information as a separate column.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k of one problem: ``1 - C(n-c, k) / C(n, k)``.

    n: samples drawn (>= 1), c: correct samples (0 <= c <= n), k: budget (1 <= k <= n).
    Returns a probability in [0, 1]. Raises ValueError when n < k or counts are out of range.
    """
    n, c, k = _check_count("n", n), _check_count("c", c), _check_count("k", k)
    if n < 1:
        raise ValueError(f"n must be >= 1, got n={n}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got k={k}")
    if n < k:
        raise ValueError(f"pass_at_k needs n >= k samples, got n={n} < k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got c={c}")
    if n - c < k:
        return 1.0
    # Exact integer binomials: Python's int / int division rounds the exact ratio correctly.
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def avg_at_k(correct: Sequence[bool]) -> float:
    """Avg@k of one problem: the fraction of its k samples that are correct.

    correct: k booleans (ints 0/1 are accepted). Raises ValueError on an empty list.
    """
    if isinstance(correct, (str, bytes)) or not isinstance(correct, Sequence):
        raise TypeError(f"correct must be a sequence of bools, got {type(correct).__name__}")
    if len(correct) == 0:
        raise ValueError("correct must hold at least one sample")
    for value in correct:
        if value not in (True, False):  # also admits 0 and 1
            raise ValueError(f"correct must hold booleans, got {value!r}")
    return sum(bool(v) for v in correct) / len(correct)


def default_pass_ks(n: int) -> list[int]:
    """Budgets reported for Pass@k with n samples: powers of two below n, then n itself."""
    n = _check_count("n", n)
    if n < 1:
        raise ValueError(f"n must be >= 1, got n={n}")
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    ks.append(n)
    return ks


def summarize_correctness(correct_by_problem: Sequence[Sequence[bool]], pass_ks: Sequence[int]) -> dict:
    """Benchmark-level metrics from per-problem correctness.

    correct_by_problem: one list of n booleans per problem (same n for all, sample order kept).
    pass_ks: budgets k <= n for Pass@k.
    Returns ``{"num_problems", "n", "avg@n", "pass@1", "pass@<k>" for each k}``; every score is the
    mean over problems, in [0, 1]. ``pass@1`` is the first sample's accuracy (module docstring).
    """
    if len(correct_by_problem) == 0:
        raise ValueError("correct_by_problem must hold at least one problem")
    sizes = {len(samples) for samples in correct_by_problem}
    if len(sizes) != 1:
        raise ValueError(f"every problem must have the same number of samples, got sizes {sorted(sizes)}")
    n = sizes.pop()
    for k in pass_ks:
        if _check_count("pass_ks item", k) > n:
            raise ValueError(f"pass_ks holds k={k} > n={n} samples per problem")
    num = len(correct_by_problem)
    summary = {
        "num_problems": num,
        "n": n,
        f"avg@{n}": sum(avg_at_k(samples) for samples in correct_by_problem) / num,
        "pass@1": sum(bool(samples[0]) for samples in correct_by_problem) / num,
    }
    for k in pass_ks:
        if k == 1:
            continue  # pass@1 is the first-sample accuracy above
        summary[f"pass@{k}"] = sum(pass_at_k(n, sum(map(bool, s)), k) for s in correct_by_problem) / num
    return summary
