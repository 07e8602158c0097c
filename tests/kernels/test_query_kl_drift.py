"""The sequence-level Query-KL far from theta0: a prompt whose log-likelihood drifted by r = ell_theta0(q) -
ell_theta(q) nats keeps a bounded, non-zero restoring gradient and a finite logged value for any drift.

Before, r was clamped to +-log_ratio_clamp (20) like a per-token log-ratio: at |r| > 20 the Query-KL's gradient was
exactly 0 and its value stuck at e^20 - 21. Now the estimator is exact for |r| <= qkl_linear_beyond (5) and
continued along its tangent beyond; the tests check value and gradient against that closed form in float64."""
import math

import pytest
import torch

from erpo_kernels import LossOptions, erpo_loss
from plain_formula import plain_erpo_loss

ALPHA = 0.01
LIMIT = LossOptions().qkl_linear_beyond
DRIFTS = [0.0, 5.0, -5.0, 50.0, -50.0, 500.0, -500.0]


def closed_form(r: float, estimator: str, limit: float = LIMIT) -> tuple[float, float]:
    """(f(r), f'(r)) of the sequence-level estimator: k inside [-limit, limit], its tangent at the edge beyond."""
    k = {"k1": lambda x: -x, "k2": lambda x: x * x / 2, "k3": lambda x: math.expm1(x) - x}[estimator]
    slope = {"k1": lambda x: -1.0, "k2": lambda x: x, "k3": math.expm1}[estimator]
    if abs(r) <= limit:
        return k(r), slope(r)
    edge = math.copysign(limit, r)
    return k(edge) + slope(edge) * (r - edge), slope(edge)


def drifted_prompt(r: float):
    """One sample of three query rows (no response rows: the loss is alpha * qkl alone) and a padding row; the query
    targets are unlikely (ell_theta(q) about -600 nats), and ref_query_logp = ell_theta(q) + r as a log-likelihood
    would be (negative) for every drift. Returns the batch, d ell_theta(q) / d logits and ell_theta(q) in float64."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 11, generator=g) * 2
    targets = torch.tensor([3, 7, 0, -100])
    logits[torch.arange(3), targets[:3]] = -200.0
    token_kind = torch.tensor([1, 1, 1, 0])
    log_probs = torch.log_softmax(logits.double()[:3], -1)
    ell = log_probs.gather(1, targets[:3, None]).sum()
    d_ell = torch.zeros(4, 11, dtype=torch.float64)
    d_ell[:3] = torch.nn.functional.one_hot(targets[:3], 11).double() - log_probs.exp()
    batch = {"logits": logits, "targets": targets, "token_kind": token_kind,
             "sample_index": torch.zeros(4, dtype=torch.long), "advantages": torch.zeros(1),
             "ref_query_logp": (ell + r).float().reshape(1)}
    assert float(ell) < -550 and float(ell + r) < 0
    return batch, d_ell, ell


def run(batch, backend="torch", **options):
    logits = batch["logits"].clone().requires_grad_(True)
    out = erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"],
                    advantages=batch["advantages"], ref_query_logp=batch["ref_query_logp"], qkl_coef=ALPHA,
                    backend=backend, **options)
    out.loss.backward()
    return out, logits.grad


@pytest.mark.parametrize("estimator", ["k3", "k2", "k1"])
@pytest.mark.parametrize("r", DRIFTS)
def test_value_and_gradient_follow_the_closed_form(r, estimator):
    batch, d_ell, ell = drifted_prompt(r)
    out, grad = run(batch, qkl_estimator=estimator)
    # The drift as the loss sees it: the fp32 sum ell_theta(q) of ~600 nats is off by ~3e-5 nats (that error times
    # f'(r) is not the estimator's); at r = 0 it is exactly 0.
    torch.testing.assert_close(out.query_logp.double()[0], ell, rtol=0, atol=1e-4)
    drift = float(batch["ref_query_logp"].double() - out.query_logp.double())
    assert abs(drift - r) < 1e-3 and (drift == 0) == (r == 0)
    value, slope = closed_form(drift, estimator)
    torch.testing.assert_close(out.loss.double(), torch.tensor(ALPHA * value, dtype=torch.float64),
                               rtol=2e-5, atol=1e-8)
    torch.testing.assert_close(out.metrics["qkl"].double(), torch.tensor(value, dtype=torch.float64),
                               rtol=2e-5, atol=1e-6)
    # loss = alpha f(r), r = ref - ell: d loss / d logits = -alpha f'(r) d ell / d logits
    expected = -ALPHA * slope * d_ell
    torch.testing.assert_close(grad.double(), expected, rtol=2e-4, atol=1e-9)


@pytest.mark.parametrize("r", [50.0, 500.0, -50.0, -500.0])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_far_drift_keeps_a_bounded_nonzero_restoring_gradient(r, backend):
    """The bug this replaces: at |r| > 20 the gradient was exactly 0 (and the value e^20 - 21 whatever r)."""
    batch, d_ell, _ = drifted_prompt(r)
    out, grad = run(batch, backend=backend)
    k3_slope_bound = math.expm1(LIMIT)  # the largest |f'(r)| of k3 over every r
    assert grad.abs().max() > 0.5 * ALPHA * min(abs(closed_form(r, "k3")[1]), k3_slope_bound) * d_ell.abs().max()
    assert grad.abs().max() <= ALPHA * k3_slope_bound * d_ell.abs().max() * (1 + 1e-4)
    # restoring: gradient descent moves ell_theta(q) back toward ell_theta0(q), i.e. up when r > 0
    d_ell_d_step = -(grad.double() * d_ell).sum()
    assert (d_ell_d_step > 0) == (r > 0)
    assert math.isfinite(out.metrics["qkl"].item()) and out.metrics["qkl"].item() < 1e5


def test_the_old_clamp_at_twenty_would_fail():
    """At r = 50 the clamped estimator's gradient is exactly 0 and the value e^20 - 21; the closed form is neither."""
    value, slope = closed_form(50.0, "k3")
    assert slope == pytest.approx(math.expm1(LIMIT)) and slope > 0
    assert value != pytest.approx(math.exp(20) - 21)
    batch, _, _ = drifted_prompt(50.0)
    _, grad = run(batch)
    assert grad.abs().max() > 0


def test_value_and_slope_are_continuous_at_the_limit():
    """C1 at +-qkl_linear_beyond: just inside and just outside agree in value and slope."""
    for estimator in ("k1", "k2", "k3"):
        for edge in (LIMIT, -LIMIT):
            inside, outside = closed_form(edge * (1 - 1e-9), estimator), closed_form(edge * (1 + 1e-9), estimator)
            assert inside[0] == pytest.approx(outside[0], rel=1e-7) and inside[1] == pytest.approx(outside[1], rel=1e-7)


@pytest.mark.parametrize("r", [3.0, 12.0, 30.0, -30.0])
def test_plain_formula_agrees(r):
    """The float64 oracle of the whole loss (tests/support/plain_formula.py) writes the same sequence-level
    estimator."""
    batch, _, _ = drifted_prompt(r)
    logits = batch["logits"].double().requires_grad_(True)
    expected = plain_erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"],
                               advantages=batch["advantages"], ref_query_logp=batch["ref_query_logp"], qkl_coef=ALPHA,
                               qkl_linear_beyond=7.0)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    out, grad = run(batch, qkl_linear_beyond=7.0)
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-4, atol=1e-8)  # fp32 ell vs float64 ell
    torch.testing.assert_close(grad.double(), expected_grad, rtol=2e-4, atol=1e-9)


def test_per_token_clamp_does_not_touch_the_sequence_level_estimator():
    """log_ratio_clamp (the per-token clamp, for TRL / verl parity of the per-token KLs) leaves qkl_s alone."""
    batch, _, _ = drifted_prompt(4.0)
    default, default_grad = run(batch)
    tight, tight_grad = run(batch, log_ratio_clamp=1.0)
    assert torch.equal(default.loss, tight.loss) and torch.equal(default_grad, tight_grad)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan"), None, "5"])
def test_qkl_linear_beyond_is_checked(value):
    with pytest.raises(ValueError, match="qkl_linear_beyond must be a finite number > 0"):
        LossOptions(qkl_linear_beyond=value)
