"""LossOutput.metrics is a `LossMetrics`: a frozen record of detached 0-dim tensors, read by attribute or as a
read-only mapping by name (as every caller reads it), built by keyword, returned whole from a compiled loss. On the
`device` fixture's tensors (CUDA when present)."""
import dataclasses
from collections.abc import Mapping

import pytest
import torch

from erpo_kernels import LossMetrics, erpo_loss
from erpo_kernels.objective import METRIC_NAMES

N, V = 10, 7
TOKEN_KIND = torch.tensor([1, 1, 2, 2, 2, 0, 1, 2, 2, 2])
SAMPLE_INDEX = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
TARGETS = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2)).masked_fill(TOKEN_KIND == 0, -100)
COUNTS = ("response_tokens", "nonfinite_rows", "kept_tokens")


def loss_of(logits, **options):
    device = logits.device
    return erpo_loss(logits, TARGETS.to(device), TOKEN_KIND.to(device), SAMPLE_INDEX.to(device),
                     advantages=torch.tensor([1.0, -0.5], device=device),
                     ref_query_logp=torch.tensor([-3.0, -2.0], device=device), backend="torch", **options)


def test_metrics_are_a_frozen_record_of_detached_scalars(device):
    logits = torch.randn(N, V, device=device, requires_grad=True)
    metrics = loss_of(logits, entropy_coef=0.01).metrics
    assert isinstance(metrics, LossMetrics) and isinstance(metrics, Mapping)
    assert METRIC_NAMES == tuple(f.name for f in dataclasses.fields(LossMetrics))
    for name in METRIC_NAMES:
        value = getattr(metrics, name)
        assert isinstance(value, torch.Tensor) and value.shape == () and not value.requires_grad, name
        assert value.dtype == (torch.int64 if name in COUNTS else torch.float32), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        metrics.qkl = torch.tensor(0.0, device=device)
    assert metrics.response_tokens.item() == 6 and metrics.nonfinite_rows.item() == 0
    assert metrics.qkl.item() > 0 and metrics.rollout_is_weight.isnan()  # no rollout_logp: NaN


def test_metrics_read_as_a_mapping_by_name(device):
    metrics = loss_of(torch.randn(N, V, device=device)).metrics
    as_dict = dict(metrics)
    assert list(as_dict) == list(metrics) == list(metrics.keys()) == list(METRIC_NAMES) and len(metrics) == 16
    assert all(as_dict[name] is getattr(metrics, name) for name in METRIC_NAMES)
    assert dict(metrics.items()) == as_dict and metrics["qkl"] is metrics.qkl
    assert "qkl" in metrics and "kept_entropy" in metrics
    assert "keys" not in metrics and "loss" not in metrics and metrics.get("nope") is None  # names, not attributes
    with pytest.raises(KeyError, match="items"):
        metrics["items"]


def test_metrics_are_built_by_keyword_and_need_every_field(device):
    values = {name: torch.tensor(float(i), device=device) for i, name in enumerate(METRIC_NAMES)}
    metrics = LossMetrics(**values)
    assert [metrics[name].item() for name in METRIC_NAMES] == list(range(len(METRIC_NAMES)))
    del values["vespo_phi_mean"]
    with pytest.raises(TypeError, match="vespo_phi_mean"):
        LossMetrics(**values)


def test_compiled_loss_returns_the_metrics_record(device):
    """fullgraph: the record is built inside the graph and comes back whole, equal to eager's."""
    logits = torch.randn(N, V, device=device)

    def metrics_of(logits):
        return loss_of(logits, top_entropy_quantile=0.5, entropy_coef=0.01).metrics

    torch._dynamo.reset()
    eager = metrics_of(logits)
    compiled = torch.compile(metrics_of, fullgraph=True, backend="aot_eager")(logits)
    assert isinstance(compiled, LossMetrics)
    for name in METRIC_NAMES:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-6, atol=1e-7, equal_nan=True)
