"""Bad input: a ValueError/TypeError that names the argument, on both backends (API.md, Errors)."""
import os

import pytest
import torch

from erpo_kernels import MAX_QUERY_WEIGHT, ERPOLoss, erpo_loss, query_weights, resolve_backend, token_logprobs
from helpers import loss_inputs, random_batch
from launch_counts import LaunchCounter


def call(batch, backend="triton", **changes):
    args = {**batch, **loss_inputs(batch), **changes}
    tensors = {k: args.pop(k) for k in ("logits", "targets", "token_kind", "sample_index")}
    return erpo_loss(tensors["logits"], tensors["targets"], tensors["token_kind"], tensors["sample_index"],
                     backend=backend, **args)


CASES = [  # (the changed inputs on device d, the error, what its message names)
    (lambda d: dict(logits=torch.randn(48, device=d)), ValueError, "logits"),
    (lambda d: dict(logits=torch.randint(0, 3, (48, 37), device=d)), TypeError, "logits"),
    (lambda d: dict(targets=torch.zeros(47, dtype=torch.long, device=d)), ValueError, "targets"),
    (lambda d: dict(targets=torch.zeros(48, device=d)), TypeError, "targets"),
    (lambda d: dict(token_kind=torch.zeros(49, dtype=torch.long, device=d)), ValueError, "token_kind"),
    (lambda d: dict(sample_index=torch.zeros(48, 1, dtype=torch.long, device=d)), ValueError, "sample_index"),
    (lambda d: dict(advantages=torch.zeros(5, 2, device=d)), ValueError, "advantages"),
    (lambda d: dict(advantages=None), ValueError, "advantages"),
    (lambda d: dict(advantages=torch.zeros(0, device=d), ref_query_logp=torch.zeros(0, device=d),
                    query_weight=torch.zeros(0, device=d), token_kind=torch.zeros(48, dtype=torch.long, device=d)),
     ValueError, "advantages must hold at least one sample"),
    (lambda d: dict(ref_query_logp=torch.zeros(4, device=d)), ValueError, "ref_query_logp"),
    (lambda d: dict(query_weight=torch.zeros(6, device=d)), ValueError, "query_weight"),
    (lambda d: dict(old_logp=torch.zeros(47, device=d)), ValueError, "old_logp"),
    (lambda d: dict(ref_logp=torch.zeros(48, 2, device=d)), ValueError, "ref_logp"),
    (lambda d: dict(token_weight=torch.ones(47, device=d)), ValueError, "token_weight"),
    (lambda d: dict(token_weight=torch.ones(48, dtype=torch.long, device=d)), TypeError, "token_weight"),
    (lambda d: dict(token_weight=torch.ones(48, device=d).index_fill(0, torch.tensor([1], device=d), -0.5)),
     ValueError, "token_weight must be finite and >= 0 on scored rows; row 1 holds -0.5"),
    (lambda d: dict(token_weight=torch.ones(48, device=d).index_fill(0, torch.tensor([1], device=d), float("inf"))),
     ValueError, "token_weight"),
    (lambda d: dict(rollout_logp=torch.zeros(49, device=d)), ValueError, "rollout_logp"),
    (lambda d: dict(rollout_logp=torch.zeros(48, device=d).index_fill(0, torch.tensor([1], device=d), float("nan"))),
     ValueError, "rollout_logp is NaN on response row 1"),
    (lambda d: dict(rollout_logp=torch.zeros(48, device=d), rollout_is_cap=0.0), ValueError, "rollout_is_cap"),
    (lambda d: dict(targets=torch.full((48,), 37, device=d)), ValueError, "targets"),
    (lambda d: dict(targets=torch.full((48,), -5, device=d)), ValueError, "targets"),
    (lambda d: dict(sample_index=torch.full((48,), 5, device=d)), ValueError, "sample_index"),
    (lambda d: dict(token_kind=torch.full((48,), 3, device=d)), ValueError, "token_kind"),
    (lambda d: dict(ref_query_logp=None), ValueError, "ref_query_logp"),
    (lambda d: dict(ref_logp=None, policy_kl_coef=0.1), ValueError, "ref_logp"),
    (lambda d: dict(ref_logp=None, qkl_estimator="k3-token"), ValueError, "ref_logp"),
    (lambda d: dict(loss_agg="mean"), ValueError, "loss_agg"),
    (lambda d: dict(qkl_estimator="k4"), ValueError, "qkl_estimator"),
    (lambda d: dict(ratio_level="seq"), ValueError, "ratio_level"),
    (lambda d: dict(temperature=0.0), ValueError, "temperature"),
    (lambda d: dict(clip_low=-0.1), ValueError, "clip_low"),
    (lambda d: dict(clip_high=float("nan")), ValueError, "clip_high"),
    (lambda d: dict(dual_clip=1.0), ValueError, "dual_clip"),
    (lambda d: dict(num_items=0), ValueError, "num_items"),
    (lambda d: dict(qkl_cof=0.1), TypeError, "qkl_cof"),
    (lambda d: dict(backend="cuda"), ValueError, "backend"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("changes,error,name", CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_names_the_argument(changes, error, name, backend, device):
    changes = changes(device)
    backend = changes.pop("backend", backend)
    with pytest.raises(error, match=name):
        call(random_batch(device=device), backend=backend, **changes)


def test_rows_of_kind_zero_are_never_read(device):
    """Targets and sample_index on rows of kind 0 may hold anything."""
    batch = random_batch(device=device)
    expected = call(batch).loss
    kind0 = batch["token_kind"] == 0
    batch["targets"][kind0] = 10 ** 6
    batch["sample_index"][kind0] = -7
    torch.testing.assert_close(call(batch).loss, expected)


def test_device_mismatch_is_named(device):
    batch = random_batch(device=device)
    with pytest.raises(ValueError, match="advantages is on meta"):
        call(batch, backend="torch", advantages=torch.zeros(5, device="meta"))


def test_token_logprobs_errors(device):
    logits, targets = torch.randn(4, 5, device=device), torch.tensor([0, 1, 2, 3], device=device)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(logits, torch.tensor([0, 1, 5, -100], device=device))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=-1.0)
    with pytest.raises(TypeError, match="logits"):
        token_logprobs(logits.double(), targets)


def test_module_checks_options_at_construction(device):
    with pytest.raises(ValueError, match="loss_agg"):
        ERPOLoss(loss_agg="sum")
    with pytest.raises(ValueError, match="backend"):
        ERPOLoss(backend="gpu")
    batch = random_batch(device=device)
    module = ERPOLoss(qkl_coef=0.1, backend="triton")
    expected = call(batch, qkl_coef=0.1).loss
    out = module(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], **loss_inputs(batch))
    torch.testing.assert_close(out.loss, expected)
    assert "qkl_coef=0.1" in repr(module)


def test_query_weights(device):
    w = query_weights(torch.tensor([-3.0, -6.0], device=device))  # the official code's case: NLL [3, 6] -> [1.5, 0.75]
    torch.testing.assert_close(w, torch.tensor([1.5, 0.75], device=device))
    w = query_weights(torch.tensor([-1.0, -100.0, -1000.0, -50.0], device=device))
    assert w.max() <= 2.0 and w.min() >= 0.0 and w[0] == 2.0
    with pytest.raises(ValueError, match="positive"):
        query_weights(torch.tensor([-1.0, 0.5], device=device))
    with pytest.raises(ValueError, match="finite"):
        query_weights(torch.tensor([-1.0, float("nan")], device=device))
    with pytest.raises(ValueError, match="at least one"):
        query_weights(torch.zeros(0, device=device))
    with pytest.raises(ValueError, match="every query"):
        query_weights(torch.zeros(3, device=device))


def test_query_weights_unclipped(device):
    """max_weight=None: the official code's per-step weight mean(s) / s_i, without the [0, 2] clip."""
    logp = torch.tensor([-1.0, -100.0, -1000.0, -50.0], device=device)
    w = query_weights(logp, max_weight=None)
    torch.testing.assert_close(w, (1151.0 / 4) / torch.tensor([1.0, 100.0, 1000.0, 50.0], device=device))
    assert w[0] > 2.0 and query_weights(logp)[0] == 2.0
    with pytest.raises(ValueError, match="unbounded"):
        query_weights(torch.tensor([-1.0, 0.0], device=device), max_weight=None)


def test_query_weights_relative_to_another_set(device):
    """mean_surprisal: weights of held-out queries on the scale of a set whose mean surprisal is given (the training
    set's), clipped as usual; the default is the queries' own mean."""
    logp = torch.tensor([-1.0, -4.0, -20.0], dtype=torch.float64, device=device)
    torch.testing.assert_close(query_weights(logp, mean_surprisal=4.0), torch.tensor([2.0, 1.0, 0.2], device=device))
    torch.testing.assert_close(query_weights(logp, None, mean_surprisal=4.0),
                               torch.tensor([4.0, 1.0, 0.2], device=device))
    torch.testing.assert_close(query_weights(logp, mean_surprisal=25.0 / 3), query_weights(logp))
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="mean_surprisal must be a finite number > 0"):
            query_weights(logp, mean_surprisal=bad)


def test_query_weights_reads_the_host_once_and_not_at_all_unvalidated(device):
    """Every value check of query_weights in one host read (TRL's current-policy weights call it each micro-batch);
    validate=False reads nothing and gives the same weights."""
    logp = torch.tensor([-1.0, -4.0, -20.0], dtype=torch.float64, device=device)
    mean_on_device = torch.tensor(4.0, dtype=torch.float64, device=device)
    for max_weight, mean_surprisal in ((MAX_QUERY_WEIGHT, None), (None, None), (MAX_QUERY_WEIGHT, 4.0), (None, 4.0),
                                       (MAX_QUERY_WEIGHT, mean_on_device)):
        for validate, reads in ((True, 1), (False, 0)):
            with LaunchCounter(device) as counter:
                w = query_weights(logp, max_weight, mean_surprisal=mean_surprisal, validate=validate)
            assert counter.syncs == reads, (max_weight, mean_surprisal, validate, counter.sync_names)
            assert torch.equal(w, query_weights(logp, max_weight, mean_surprisal=mean_surprisal))


def test_backend_resolution(monkeypatch):
    """resolve_backend: the one rule every entry point applies to `backend`."""
    import erpo_kernels.api
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch" and resolve_backend("torch", "cuda") == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    if os.environ.get("TRITON_INTERPRET") == "1":  # the flag resolve_backend reads: CPU tensors take the interpreter
        assert resolve_backend("triton", cpu) == "triton"
    else:  # a GPU machine, kernels compiled: CPU tensors are refused in one line that says what to do
        with pytest.raises(ValueError, match=r"needs CUDA tensors \(got cpu\); on CPU set TRITON_INTERPRET=1"):
            resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", cpu)
    monkeypatch.setattr(erpo_kernels.api, "TRITON_INSTALLED", False)
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ImportError, match="pip install triton"):
        resolve_backend("triton", torch.device("cuda"))


def test_auto_backend_on_cpu_is_the_reference():
    batch = random_batch(device="cpu")
    auto = call(batch, backend="auto")
    reference = call(batch, backend="torch")
    assert torch.equal(auto.loss, reference.loss) and torch.equal(auto.token_logp, reference.token_logp)
