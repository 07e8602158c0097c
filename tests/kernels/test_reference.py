"""The torch reference (backend="torch") against float64 autograd of API.md's plain formula."""
import math

import pytest
import torch

from erpo_kernels import erpo_loss, reference, token_logprobs
from helpers import loss_inputs, random_batch
from plain_formula import plain_erpo_loss

OPTION_CASES = [
    {},
    {"qkl_estimator": "k1"},
    {"qkl_estimator": "k2", "qkl_coef": 0.5},
    {"qkl_estimator": "k3-token", "qkl_coef": 0.3},
    {"policy_kl_coef": 0.1, "qkl_coef": 0.0},
    {"dual_clip": 3.0, "clip_low": 0.1, "clip_high": 0.28},
    {"ratio_level": "sequence"},
    {"temperature": 0.6, "entropy_coef": 0.05},
    {"loss_agg": "seq-mean-token-mean", "qkl_coef": 0.2},
    {"loss_agg": "seq-mean-token-sum", "num_seqs": 7},
    {"num_items": 100, "log_ratio_clamp": 5.0, "qkl_coef": 1.0},
    {"policy_kl_coef": 0.1, "policy_kl_bias_correction": True},
    {"policy_kl_coef": 0.1, "policy_kl_bias_correction": True, "ratio_level": "sequence"},
    {"policy_kl_coef": 0.1, "kl_clamp": 0.5, "qkl_estimator": "k2", "qkl_coef": 0.5},
    {"kl_clamp": 2.0, "qkl_estimator": "k3-token", "qkl_coef": 0.3},
    {"pg_log_ratio_clamp": 1.0, "dual_clip": 3.0},
    {"entropy_coef": 0.05, "entropy_agg": "token-mean", "loss_agg": "seq-mean-token-sum", "num_seqs": 7},
]


@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_reference_matches_float64_formula(options, device):
    batch = random_batch(device=device)
    logits = batch["logits"].double().requires_grad_(True)
    expected = plain_erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"],
                               **loss_inputs(batch), **options)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    ours_logits = batch["logits"].clone().requires_grad_(True)
    out = erpo_loss(ours_logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend="torch",
                    **loss_inputs(batch), **options)
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_logits.grad.double(), expected_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_token_weight_scales_each_response_rows_policy_gradient(backend, device):
    """token_weight [N] (e.g. a truncated importance-sampling ratio against the rollout engine's log-probs)
    multiplies pg_t next to w_s; query rows and the Query-KL ignore it, and rows of kind 0 may hold anything."""
    batch = random_batch(device=device)
    token_weight = (torch.rand(48, generator=torch.Generator().manual_seed(7)) * 2).to(device)
    token_weight[batch["token_kind"] == 0] = float("nan")  # never read
    options = {"policy_kl_coef": 0.1, "entropy_coef": 0.05}
    logits = batch["logits"].double().requires_grad_(True)
    expected = plain_erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"],
                               token_weight=token_weight, **loss_inputs(batch), **options)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    ours_logits = batch["logits"].clone().requires_grad_(True)
    out = erpo_loss(ours_logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend=backend,
                    token_weight=token_weight, **loss_inputs(batch), **options)
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_logits.grad.double(), expected_grad, rtol=1e-4, atol=1e-6)
    unweighted = erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"],
                           backend=backend, **loss_inputs(batch), **options)
    ones = erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], backend=backend,
                     token_weight=torch.ones(48, device=device), **loss_inputs(batch), **options)
    assert torch.equal(ones.loss, unweighted.loss)
    assert not torch.allclose(out.metrics["pg_loss"], unweighted.metrics["pg_loss"], rtol=1e-2)
    assert torch.equal(out.metrics["qkl"], unweighted.metrics["qkl"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("on_policy", [True, False], ids=["on-policy", "old_logp"])
def test_rollout_logp_applies_truncated_importance_sampling(backend, on_policy, device):
    """With the rollout engine's log-probs, pg_t is weighted by min(exp(old_t - rollout_t), rollout_is_cap), old_t
    being old_logp or (on-policy) the current log-prob, detached; metrics report the weight and the gap."""
    batch = random_batch(device=device)
    g = torch.Generator().manual_seed(11)
    inputs = loss_inputs(batch, ("advantages", "ref_query_logp", "query_weight") + (() if on_policy else ("old_logp",)))
    old = erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"],
                    backend="torch", **inputs).token_logp if on_policy else batch["old_logp"]
    rollout_logp = old + 0.8 * torch.randn(48, generator=g).to(device)  # some weights above the cap, some below 1
    rollout_logp[batch["token_kind"] != 2] = float("nan")  # read on response rows only
    options = {"rollout_is_cap": 1.5}
    logits = batch["logits"].double().requires_grad_(True)
    expected = plain_erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"],
                               rollout_logp=rollout_logp, **inputs, **options)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    ours_logits = batch["logits"].clone().requires_grad_(True)
    out = erpo_loss(ours_logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend=backend,
                    rollout_logp=rollout_logp, **inputs, **options)
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_logits.grad.double(), expected_grad, rtol=1e-4, atol=1e-6)
    response = batch["token_kind"] == 2
    gap = (old - rollout_logp)[response]
    assert bool((gap > math.log(1.5)).any()) and bool((gap < 0).any())
    torch.testing.assert_close(out.metrics["rollout_is_weight"], gap.exp().clamp(max=1.5).mean())
    torch.testing.assert_close(out.metrics["rollout_logp_gap_abs"], gap.abs().mean())
    torch.testing.assert_close(out.metrics["rollout_logp_gap_max"], gap.abs().max())
    plain = erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], backend=backend,
                      **inputs)
    assert "rollout_is_weight" not in plain.metrics and plain.metrics.rollout_logp_gap_abs is None
    assert not torch.allclose(plain.metrics["pg_loss"], out.metrics["pg_loss"], rtol=1e-2)


def test_on_policy_without_old_logp_has_ratio_one(device):
    batch = random_batch(device=device)
    out = erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], backend="torch",
                    advantages=batch["advantages"], ref_query_logp=batch["ref_query_logp"])
    assert out.metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert out.metrics["clip_frac"].item() == 0.0


def test_query_and_response_sums_match_token_logp(device):
    batch = random_batch(device=device)
    out = erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], backend="torch",
                    **loss_inputs(batch))
    for s in range(5):
        q = (batch["sample_index"] == s) & (batch["token_kind"] == 1)
        r = (batch["sample_index"] == s) & (batch["token_kind"] == 2)
        torch.testing.assert_close(out.query_logp[s], out.token_logp[q].sum())
        torch.testing.assert_close(out.response_logp[s], out.token_logp[r].sum())
    assert torch.all(out.token_logp[batch["token_kind"] == 0] == 0)


def test_query_rows_get_gradient_only_from_query_kl(device):
    """Proposition 1: with qkl_coef = 0 query rows get no gradient; the Query-KL term sends none to responses."""
    batch = random_batch(device=device)
    kind = batch["token_kind"]
    logits = batch["logits"].clone().requires_grad_(True)
    erpo_loss(logits, batch["targets"], kind, batch["sample_index"], backend="torch", qkl_coef=0.0,
              **loss_inputs(batch)).loss.backward()
    assert torch.all(logits.grad[kind == 1] == 0) and logits.grad[kind == 2].abs().sum() > 0
    logits.grad = None
    zero_adv = dict(loss_inputs(batch), advantages=torch.zeros(5, device=device))
    erpo_loss(logits, batch["targets"], kind, batch["sample_index"], backend="torch", qkl_coef=1.0,
              **zero_adv).loss.backward()
    assert torch.all(logits.grad[kind == 2] == 0) and logits.grad[kind == 1].abs().sum() > 0
    assert torch.all(logits.grad[kind == 0] == 0)


def test_query_weight_multiplies_policy_gradient_only(device):
    batch = random_batch(device=device)
    args = (batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"])
    base = erpo_loss(*args, backend="torch", **dict(loss_inputs(batch), query_weight=None))
    doubled = erpo_loss(*args, backend="torch",
                        **dict(loss_inputs(batch), query_weight=torch.full((5,), 2.0, device=device)))
    torch.testing.assert_close(doubled.metrics["pg_loss"], 2 * base.metrics["pg_loss"])
    torch.testing.assert_close(doubled.metrics["qkl"], base.metrics["qkl"])


def test_reference_is_chunked(monkeypatch, device):
    """Splitting rows into chunks of one row gives the same values and gradients as one chunk."""
    batch = random_batch(dtype=torch.bfloat16, device=device)
    logits = batch["logits"].clone().requires_grad_(True)
    logp, entropy = token_logprobs(logits, batch["targets"], return_entropy=True, backend="torch")
    (logp.sum() + entropy.sum()).backward()
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 1)
    logits2 = batch["logits"].clone().requires_grad_(True)
    logp2, entropy2 = token_logprobs(logits2, batch["targets"], return_entropy=True, backend="torch")
    (logp2.sum() + entropy2.sum()).backward()
    assert torch.equal(logp, logp2) and torch.equal(entropy, entropy2) and torch.equal(logits.grad, logits2.grad)
    assert len(reference.row_chunks(48, 37)) == 48


def test_masked_vocabulary_entries_are_handled(device):
    """-inf logits (a masked vocabulary entry) are legitimate: finite log-probs, entropy and gradients."""
    logits = torch.randn(4, 9).to(device)
    logits[:, 3] = float("-inf")
    logits.requires_grad_(True)
    targets = torch.tensor([0, 1, 2, 4], device=device)
    logp, entropy = token_logprobs(logits, targets, return_entropy=True, backend="torch")
    (logp.sum() + entropy.sum()).backward()
    expected = torch.log_softmax(logits.detach()[:, [0, 1, 2, 4, 5, 6, 7, 8]], -1)
    torch.testing.assert_close(logp, expected[[0, 1, 2, 3], [0, 1, 2, 3]])
    assert torch.isfinite(entropy).all() and torch.isfinite(logits.grad).all()


PARITY_OPTIONS = {"policy_kl_bias_correction": True, "kl_clamp": 0.5, "pg_log_ratio_clamp": 1.0,
                  "entropy_agg": "token-mean"}


@pytest.mark.parametrize("name", list(PARITY_OPTIONS))
def test_parity_option_changes_loss_and_gradient(name, device):
    """Each option for parity with TRL / verl is active on the test batch (so the float64 comparisons above are not
    vacuous): turning it on changes the loss or, for the bias correction at old = current, only the gradient."""
    batch = random_batch(device=device)
    base = {"policy_kl_coef": 0.1 if "kl" in name else 0.0, "entropy_coef": 0.05, "loss_agg": "seq-mean-token-mean",
            "log_ratio_clamp": 5.0}
    on_policy = name == "policy_kl_bias_correction"
    inputs = loss_inputs(batch, ("advantages", "ref_query_logp", "query_weight", "ref_logp")
                         + (() if on_policy else ("old_logp",)))

    def loss_and_grad(**options):
        logits = batch["logits"].clone().requires_grad_(True)
        out = erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend="torch",
                        **inputs, **base, **options)
        out.loss.backward()
        return out.loss.detach(), logits.grad

    (loss_off, grad_off), (loss_on, grad_on) = loss_and_grad(), loss_and_grad(**{name: PARITY_OPTIONS[name]})
    assert not torch.allclose(grad_on, grad_off, rtol=1e-4, atol=1e-6)
    if on_policy:  # TRL: the ratio is 1 in value, so the loss is the same, but its gradient is not
        torch.testing.assert_close(loss_on, loss_off)
    else:
        assert not torch.allclose(loss_on, loss_off, rtol=1e-4)


def test_pg_log_ratio_clamp_is_not_log_ratio_clamp(device):
    """log_ratio_clamp clamps the KL log-ratios only; the PG ratio is clamped by pg_log_ratio_clamp (verl: 20)."""
    batch = random_batch(device=device)
    old_logp = batch["old_logp"].clone()
    old_logp[batch["token_kind"] == 2] -= 60.0  # log-ratios above 40 on every response row
    inputs = dict(loss_inputs(batch), old_logp=old_logp)
    rows = (batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"])
    ratio_mean = {clamp: erpo_loss(*rows, **inputs, backend="torch", pg_log_ratio_clamp=clamp).metrics["ratio_mean"]
                  for clamp in (None, 20.0)}
    assert ratio_mean[None] > torch.exp(torch.tensor(25.0, device=device))
    torch.testing.assert_close(ratio_mean[20.0], torch.exp(torch.tensor(20.0, device=device)))
