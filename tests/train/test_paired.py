"""bench/paired.py: the sign-flip and paired t p-values agree with answers worked out by hand and with Student's t
table, and bad input is refused."""
import math

import pytest

from bench.paired import paired_summary, sign_flip_p, student_t_two_sided_p


def test_sign_flip_p_counts_the_sign_assignments_reaching_the_observed_sum():
    assert sign_flip_p([1.0, 2.0, 3.0, 4.0, 5.0]) == 2 / 32     # only all + and all -: the floor with 5 seeds
    assert sign_flip_p([3.0, 1.0, 1.0]) == 2 / 8                 # sums +-5, +-3 (x2), +-1 (x2)... only +-5 reach 5
    # +-4 +-1 +-1 +-1: |sum| >= 5 in 7, 5, 5, 5 and their negatives: 8 of 16
    assert sign_flip_p([4.0, 1.0, 1.0, -1.0]) == 8 / 16
    assert sign_flip_p([0.1, -0.1]) == 1.0                        # observed sum 0: every assignment reaches it
    assert sign_flip_p([0.1, 0.2, -0.3]) == 1.0                   # a sum of 0 in exact arithmetic, 5.6e-17 in floats


def test_student_t_two_sided_p_matches_the_table():
    # two-sided 5% critical values of Student's t (any table), and closed forms for 1 and 2 degrees of freedom
    for t, dof in ((12.7062047, 1), (4.3026527, 2), (2.7764451, 4), (2.5705818, 5), (2.2281389, 10)):
        assert student_t_two_sided_p(t, dof) == pytest.approx(0.05, abs=2e-8)
    assert student_t_two_sided_p(1.0, 1) == pytest.approx(0.5)                      # Cauchy: P(|T| > 1) = 1/2
    assert student_t_two_sided_p(-1.0, 2) == pytest.approx(1 - 1 / math.sqrt(3))    # v = 2: A = t / sqrt(2 + t^2)
    assert student_t_two_sided_p(0.0, 3) == 1.0
    with pytest.raises(ValueError, match="positive integer"):
        student_t_two_sided_p(1.0, 0)


def test_paired_summary_of_known_differences():
    s = paired_summary([0.05, 0.10, 0.15, 0.20, 0.25])
    # mean 0.15, sd sqrt(0.00625) = 0.0791, se 0.0354, t = 3 sqrt(2) on 4 dof: p = 1 - sin(th) (1 + cos^2(th) / 2)
    theta = math.atan(3 * math.sqrt(2) / 2)
    assert (s.n, s.positive, s.sign_flip_p) == (5, 5, 2 / 32)
    assert (s.mean, s.standard_error, s.t) == pytest.approx((0.15, math.sqrt(0.00625 / 5), 3 * math.sqrt(2)))
    assert s.t_p == pytest.approx(1 - math.sin(theta) * (1 + math.cos(theta) ** 2 / 2)) and 0.013 < s.t_p < 0.014
    one = paired_summary([-0.2])
    assert (one.mean, one.standard_error, one.t, one.t_p, one.positive, one.sign_flip_p) == (-0.2, None, None, None,
                                                                                             0, 1.0)
    same = paired_summary([0.1, 0.1, 0.1])   # no spread: no t, the sign-flip test still answers
    assert (same.t, same.t_p, same.sign_flip_p) == (None, None, 0.25)
    with pytest.raises(ValueError, match="give 1 to 20"):
        paired_summary([])
    with pytest.raises(ValueError, match="give 1 to 20"):
        sign_flip_p([0.1] * 21)
