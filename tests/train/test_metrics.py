"""erpo.eval.metrics: Avg@k, unbiased Pass@k and benchmark summaries on hand-computed cases."""

import itertools
import math

import pytest

from erpo.eval.metrics import avg_at_k, default_pass_ks, pass_at_k, summarize_correctness


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (5, 2, 2, 1 - 3 / 10),  # C(3,2)=3, C(5,2)=10
        (10, 3, 4, 1 - 35 / 210),  # C(7,4)=35, C(10,4)=210
        (4, 1, 1, 0.25),
        (8, 3, 1, 3 / 8),
        (32, 1, 32, 1.0),
        (6, 2, 5, 1.0),  # n - c = 4 < k: every 5-subset holds a correct sample
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_edge_counts():
    assert pass_at_k(16, 0, 1) == 0.0
    assert pass_at_k(16, 0, 16) == 0.0
    assert pass_at_k(16, 16, 1) == 1.0
    assert pass_at_k(16, 16, 16) == 1.0
    assert pass_at_k(1, 1, 1) == 1.0
    assert pass_at_k(1, 0, 1) == 0.0


def test_pass_at_k_matches_subset_enumeration():
    """Pass@k is the chance that a uniformly drawn k-subset of the n samples holds a correct one."""
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                expected = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_exact_and_monotone():
    # Product form of Chen et al. as an independent check at a size where factorials are huge.
    n, c = 1024, 37
    for k in (1, 8, 64, 512):
        product = 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
        assert pass_at_k(n, c, k) == pytest.approx(product, rel=1e-9)
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert all(a <= b for a, b in zip(values, values[1:]))


def test_pass_at_k_rejects_n_below_k():
    with pytest.raises(ValueError, match="n >= k"):
        pass_at_k(4, 2, 5)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (0, 0, 1), (4, 1, 0), (4, 1, -2)])
def test_pass_at_k_rejects_out_of_range(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


@pytest.mark.parametrize("n,c,k", [(4.0, 1, 1), (4, 1.5, 1), (4, 1, True), ("4", 1, 1)])
def test_pass_at_k_rejects_non_int(n, c, k):
    with pytest.raises(TypeError):
        pass_at_k(n, c, k)


def test_avg_at_k():
    assert avg_at_k([True, False, True, True]) == 0.75
    assert avg_at_k([False] * 5) == 0.0
    assert avg_at_k([True] * 3) == 1.0
    assert avg_at_k([1, 0]) == 0.5
    with pytest.raises(ValueError, match="at least one"):
        avg_at_k([])
    with pytest.raises(ValueError, match="booleans"):
        avg_at_k([True, 0.5])
    with pytest.raises(TypeError):
        avg_at_k("TF")


def test_default_pass_ks():
    assert default_pass_ks(32) == [1, 2, 4, 8, 16, 32]
    assert default_pass_ks(5) == [1, 2, 4, 5]
    assert default_pass_ks(1) == [1]
    with pytest.raises(ValueError):
        default_pass_ks(0)


def test_summarize_correctness_hand_computed():
    correct = [
        [True, False, False, False],  # c=1
        [False, True, True, False],  # c=2
        [False, False, False, False],  # c=0
    ]
    summary = summarize_correctness(correct, [1, 2, 4])
    assert summary["num_problems"] == 3 and summary["n"] == 4
    assert summary["avg@4"] == pytest.approx((0.25 + 0.5 + 0.0) / 3)
    assert summary["pass@1"] == pytest.approx(1 / 3)  # first samples: T, F, F
    # pass@2: 1 - C(3,2)/C(4,2) = 0.5 ; 1 - C(2,2)/C(4,2) = 5/6 ; 0
    assert summary["pass@2"] == pytest.approx((0.5 + 5 / 6 + 0.0) / 3)
    assert summary["pass@4"] == pytest.approx(2 / 3)


def test_summarize_correctness_rejects_bad_input():
    with pytest.raises(ValueError, match="same number"):
        summarize_correctness([[True, False], [True]], [1])
    with pytest.raises(ValueError, match="k=4"):
        summarize_correctness([[True, False]], [1, 4])
    with pytest.raises(ValueError, match="at least one problem"):
        summarize_correctness([], [1])
