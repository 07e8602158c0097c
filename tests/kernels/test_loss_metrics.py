"""LossOutput.metrics is a `LossMetrics`: a frozen record of detached 0-dim tensors, read by attribute or as a
read-only mapping by name (as every caller reads it), built by keyword, returned whole from a compiled loss. A metric
that does not apply to the call (its option or input is absent) is absent, on both backends: None as an attribute,
left out of the mapping, a KeyError saying what it needs; a NaN is only ever a value. On the `device` fixture's
tensors (CUDA when present)."""
import dataclasses
from collections.abc import Mapping

import pytest
import torch

from erpo_kernels import LossMetrics, erpo_loss, logprob_erpo_loss, token_logprobs
from erpo_kernels.objective import METRIC_NAMES
from helpers import loss_inputs, random_batch

N, V = 10, 7
TOKEN_KIND = torch.tensor([1, 1, 2, 2, 2, 0, 1, 2, 2, 2])
SAMPLE_INDEX = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
TARGETS = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2)).masked_fill(TOKEN_KIND == 0, -100)
COUNTS = ("response_tokens", "nonfinite_rows", "kept_tokens")
# The metrics that do not apply to `loss_of`'s call (ref_query_logp given; no ref_logp, rollout_logp, off-policy mask)
NOT_APPLYING_BY_DEFAULT = {"policy_kl", "rollout_is_weight", "rollout_logp_gap_abs", "rollout_logp_gap_max",
                           "off_policy_masked_frac", "vespo_phi_mean"}


def loss_of(logits, **options):
    device = logits.device
    return erpo_loss(logits, TARGETS.to(device), TOKEN_KIND.to(device), SAMPLE_INDEX.to(device),
                     advantages=torch.tensor([1.0, -0.5], device=device),
                     ref_query_logp=torch.tensor([-3.0, -2.0], device=device), backend="torch", **options)


def test_metrics_are_a_frozen_record_of_detached_scalars(device):
    """Every option and input given (vespo, rollout_logp, the off-policy mask, ref_logp): every metric applies."""
    batch = random_batch(device=device)
    logits = batch["logits"].clone().requires_grad_(True)
    metrics = erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], **loss_inputs(batch),
                        rollout_logp=batch["old_logp"] + 0.1, pg_objective="vespo", off_policy_mask_threshold=0.5,
                        entropy_coef=0.01, backend="torch").metrics
    assert isinstance(metrics, LossMetrics) and isinstance(metrics, Mapping)
    assert METRIC_NAMES == tuple(f.name for f in dataclasses.fields(LossMetrics)) == tuple(metrics)
    for name in METRIC_NAMES:
        value = getattr(metrics, name)
        assert isinstance(value, torch.Tensor) and value.shape == () and not value.requires_grad, name
        assert value.dtype == (torch.int64 if name in COUNTS else torch.float32), name
        assert value.isfinite(), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        metrics.qkl = torch.tensor(0.0, device=device)
    assert metrics.response_tokens.item() == int((batch["token_kind"] == 2).sum()) and metrics.nonfinite_rows == 0


def test_metrics_read_as_a_mapping_by_name(device):
    metrics = loss_of(torch.randn(N, V, device=device)).metrics   # no ref_logp, rollout_logp, mask, vespo
    present = [name for name in METRIC_NAMES if name not in NOT_APPLYING_BY_DEFAULT]
    as_dict = dict(metrics)
    assert list(as_dict) == list(metrics) == list(metrics.keys()) == present and len(metrics) == len(present) == 10
    assert all(as_dict[name] is getattr(metrics, name) for name in present)
    assert dict(metrics.items()) == as_dict and metrics["qkl"] is metrics.qkl
    assert "qkl" in metrics and "kept_entropy" in metrics and "policy_kl" not in metrics
    assert "keys" not in metrics and "loss" not in metrics and metrics.get("nope") is None  # names, not attributes
    with pytest.raises(KeyError, match="items"):
        metrics["items"]


def test_metrics_are_built_by_keyword_and_need_every_field(device):
    values = {name: torch.tensor(float(i), device=device) for i, name in enumerate(METRIC_NAMES)}
    metrics = LossMetrics(**values)
    assert [metrics[name].item() for name in METRIC_NAMES] == list(range(len(METRIC_NAMES)))
    assert list(LossMetrics(**{**values, "policy_kl": None})) == [n for n in METRIC_NAMES if n != "policy_kl"]
    del values["vespo_phi_mean"]
    with pytest.raises(TypeError, match="vespo_phi_mean"):
        LossMetrics(**values)


# (what the call leaves out or sets, the metrics that then do not apply): each case on both backends.
NEEDS = {
    "qkl": "ref_query_logp", "policy_kl": "ref_logp", "entropy": "entropies", "kept_entropy": "entropies",
    "rollout_is_weight": "rollout_logp and a rollout_is_cap", "rollout_logp_gap_abs": "rollout_logp",
    "rollout_logp_gap_max": "rollout_logp", "off_policy_masked_frac": "off_policy_mask_threshold",
    "vespo_phi_mean": "pg_objective 'vespo'",
}
ROLLOUT = ("rollout_logp_gap_abs", "rollout_logp_gap_max", "rollout_is_weight")
ABSENT_CASES = {
    "policy_kl_coef 0 without ref_logp": (dict(_without=("ref_logp",), policy_kl_coef=0.0),
                                          {"policy_kl", *ROLLOUT, "off_policy_masked_frac", "vespo_phi_mean"}),
    "ref_logp given, policy_kl_coef 0": (dict(policy_kl_coef=0.0),
                                         {*ROLLOUT, "off_policy_masked_frac", "vespo_phi_mean"}),
    "no reference, qkl_coef 0": (dict(_without=("ref_logp", "ref_query_logp"), qkl_coef=0.0),
                                 {"qkl", "policy_kl", *ROLLOUT, "off_policy_masked_frac", "vespo_phi_mean"}),
    "k3-token reads ref_logp": (dict(_without=("ref_query_logp",), qkl_estimator="k3-token", qkl_coef=0.3),
                                {*ROLLOUT, "off_policy_masked_frac", "vespo_phi_mean"}),
    "rollout_logp without a cap": (dict(_rollout=True, rollout_is_cap=None),
                                   {"rollout_is_weight", "off_policy_masked_frac", "vespo_phi_mean"}),
    "rollout_logp with a cap": (dict(_rollout=True), {"off_policy_masked_frac", "vespo_phi_mean"}),
    "off-policy mask": (dict(off_policy_mask_threshold=0.2), {*ROLLOUT, "vespo_phi_mean"}),
    "vespo": (dict(pg_objective="vespo"), {*ROLLOUT, "off_policy_masked_frac"}),
}


def assert_absent_exactly(metrics, absent):
    """`absent` (names) are absent from `metrics` in every way, the others present and finite."""
    present = [name for name in METRIC_NAMES if name not in absent]
    assert list(metrics) == list(dict(metrics)) == present and len(metrics) == len(present)
    for name in present:
        assert metrics[name] is getattr(metrics, name) and metrics[name].isfinite(), name
    for name in absent:
        assert name not in metrics and getattr(metrics, name) is None and metrics.get(name) is None, name
        with pytest.raises(KeyError, match=f"{name} does not apply to this call: it needs .*{NEEDS[name]}"):
            metrics[name]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(ABSENT_CASES))
def test_a_metric_that_does_not_apply_is_absent(device, backend, case):
    """Which metrics apply follows the options and which inputs are given, the same on both backends (the Triton
    objective kernels for the fused cases, the reference on the Triton sums for the others)."""
    batch = random_batch(device=device)
    options, absent = ABSENT_CASES[case]
    options = dict(options)
    tensors = loss_inputs(batch)
    for name in options.pop("_without", ()):
        del tensors[name]
    if options.pop("_rollout", False):
        tensors["rollout_logp"] = batch["old_logp"] + 0.2 * torch.randn(batch["old_logp"].shape).to(device)
    out = erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], **tensors,
                    backend=backend, **options)
    assert_absent_exactly(out.metrics, absent)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_without_entropies_the_entropy_metrics_are_absent(device, backend):
    batch = random_batch(device=device)
    rows = batch["token_kind"], batch["sample_index"]
    logp = token_logprobs(batch["logits"], batch["targets"], backend=backend)
    out = logprob_erpo_loss(logp, *rows, **loss_inputs(batch), backend=backend)
    assert_absent_exactly(out.metrics, {"entropy", "kept_entropy", *ROLLOUT, "off_policy_masked_frac",
                                        "vespo_phi_mean"})


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_nan_from_a_nonfinite_row_is_still_a_nan(device, backend):
    """Absence follows the options and inputs, never the values: a NaN row makes the metrics that read it NaN, and
    they stay in the mapping."""
    batch = random_batch(device=device)
    logits = batch["logits"].clone()
    logits[(batch["token_kind"] == 2).nonzero()[0, 0], 3] = float("nan")
    out = erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], **loss_inputs(batch),
                    backend=backend)
    assert out.metrics["nonfinite_rows"].item() == 1 and out.loss.isnan()
    for name in ("entropy", "policy_kl", "ratio_mean", "pg_loss"):
        assert name in out.metrics and out.metrics[name].isnan(), name


def test_compiled_loss_returns_the_metrics_record(device):
    """fullgraph: the record is built inside the graph, its absent metrics too, and comes back whole, equal to
    eager's."""
    logits = torch.randn(N, V, device=device)

    def metrics_of(logits):
        return loss_of(logits, top_entropy_quantile=0.5, entropy_coef=0.01).metrics

    torch._dynamo.reset()
    eager = metrics_of(logits)
    compiled = torch.compile(metrics_of, fullgraph=True, backend="aot_eager")(logits)
    assert isinstance(compiled, LossMetrics)
    assert list(compiled) == list(eager) and compiled.policy_kl is None and "policy_kl" not in compiled
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-6, atol=1e-7)
