"""Bad input: a ValueError/TypeError that names the argument, on both backends (API.md, Errors)."""
import pytest
import torch

from erpo_kernels import ERPOLoss, erpo_loss, query_weights, resolve_backend, token_logprobs
from helpers import loss_inputs, random_batch


def call(batch, backend="triton", **changes):
    args = {**batch, **loss_inputs(batch), **changes}
    tensors = {k: args.pop(k) for k in ("logits", "targets", "token_kind", "sample_index")}
    return erpo_loss(tensors["logits"], tensors["targets"], tensors["token_kind"], tensors["sample_index"],
                     backend=backend, **args)


CASES = [
    (dict(logits=torch.randn(48)), ValueError, "logits"),
    (dict(logits=torch.randint(0, 3, (48, 37))), TypeError, "logits"),
    (dict(targets=torch.zeros(47, dtype=torch.long)), ValueError, "targets"),
    (dict(targets=torch.zeros(48)), TypeError, "targets"),
    (dict(token_kind=torch.zeros(49, dtype=torch.long)), ValueError, "token_kind"),
    (dict(sample_index=torch.zeros(48, 1, dtype=torch.long)), ValueError, "sample_index"),
    (dict(advantages=torch.zeros(5, 2)), ValueError, "advantages"),
    (dict(advantages=None), ValueError, "advantages"),
    (dict(advantages=torch.zeros(0), ref_query_logp=torch.zeros(0), query_weight=torch.zeros(0),
          token_kind=torch.zeros(48, dtype=torch.long)), ValueError, "advantages must hold at least one sample"),
    (dict(ref_query_logp=torch.zeros(4)), ValueError, "ref_query_logp"),
    (dict(query_weight=torch.zeros(6)), ValueError, "query_weight"),
    (dict(old_logp=torch.zeros(47)), ValueError, "old_logp"),
    (dict(ref_logp=torch.zeros(48, 2)), ValueError, "ref_logp"),
    (dict(token_weight=torch.ones(47)), ValueError, "token_weight"),
    (dict(token_weight=torch.ones(48, dtype=torch.long)), TypeError, "token_weight"),
    (dict(token_weight=torch.ones(48).index_fill(0, torch.tensor([1]), -0.5)), ValueError,
     "token_weight must be finite and >= 0 on scored rows; row 1 holds -0.5"),
    (dict(token_weight=torch.ones(48).index_fill(0, torch.tensor([1]), float("inf"))), ValueError, "token_weight"),
    (dict(rollout_logp=torch.zeros(49)), ValueError, "rollout_logp"),
    (dict(rollout_logp=torch.zeros(48).index_fill(0, torch.tensor([1]), float("nan"))), ValueError,
     "rollout_logp is NaN on response row 1"),
    (dict(rollout_logp=torch.zeros(48), rollout_is_cap=0.0), ValueError, "rollout_is_cap"),
    (dict(targets=torch.full((48,), 37)), ValueError, "targets"),
    (dict(targets=torch.full((48,), -5)), ValueError, "targets"),
    (dict(sample_index=torch.full((48,), 5)), ValueError, "sample_index"),
    (dict(token_kind=torch.full((48,), 3)), ValueError, "token_kind"),
    (dict(ref_query_logp=None), ValueError, "ref_query_logp"),
    (dict(ref_logp=None, policy_kl_coef=0.1), ValueError, "ref_logp"),
    (dict(ref_logp=None, qkl_estimator="k3-token"), ValueError, "ref_logp"),
    (dict(loss_agg="mean"), ValueError, "loss_agg"),
    (dict(qkl_estimator="k4"), ValueError, "qkl_estimator"),
    (dict(ratio_level="seq"), ValueError, "ratio_level"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(clip_low=-0.1), ValueError, "clip_low"),
    (dict(clip_high=float("nan")), ValueError, "clip_high"),
    (dict(dual_clip=1.0), ValueError, "dual_clip"),
    (dict(num_items=0), ValueError, "num_items"),
    (dict(qkl_cof=0.1), TypeError, "qkl_cof"),
    (dict(backend="cuda"), ValueError, "backend"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("changes,error,name", CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_names_the_argument(changes, error, name, backend):
    changes = dict(changes)
    backend = changes.pop("backend", backend)
    with pytest.raises(error, match=name):
        call(random_batch(), backend=backend, **changes)


def test_rows_of_kind_zero_are_never_read():
    """Targets and sample_index on rows of kind 0 may hold anything."""
    batch = random_batch()
    expected = call(batch).loss
    kind0 = batch["token_kind"] == 0
    batch["targets"][kind0] = 10 ** 6
    batch["sample_index"][kind0] = -7
    torch.testing.assert_close(call(batch).loss, expected)


def test_device_mismatch_is_named():
    batch = random_batch()
    with pytest.raises(ValueError, match="advantages is on meta"):
        call(batch, backend="torch", advantages=torch.zeros(5, device="meta"))


def test_token_logprobs_errors():
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(torch.randn(4, 5), torch.tensor([0, 1, 5, -100]))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.randn(4, 5), torch.tensor([0, 1, 2, 3]), temperature=-1.0)
    with pytest.raises(TypeError, match="logits"):
        token_logprobs(torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 3]))


def test_module_checks_options_at_construction():
    with pytest.raises(ValueError, match="loss_agg"):
        ERPOLoss(loss_agg="sum")
    with pytest.raises(ValueError, match="backend"):
        ERPOLoss(backend="gpu")
    batch = random_batch()
    module = ERPOLoss(qkl_coef=0.1, backend="triton")
    expected = call(batch, qkl_coef=0.1).loss
    out = module(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], **loss_inputs(batch))
    torch.testing.assert_close(out.loss, expected)
    assert "qkl_coef=0.1" in repr(module)


def test_query_weights():
    w = query_weights(torch.tensor([-3.0, -6.0]))  # the official code's test case: NLL [3, 6] -> [1.5, 0.75]
    torch.testing.assert_close(w, torch.tensor([1.5, 0.75]))
    w = query_weights(torch.tensor([-1.0, -100.0, -1000.0, -50.0]))
    assert w.max() <= 2.0 and w.min() >= 0.0 and w[0] == 2.0
    with pytest.raises(ValueError, match="positive"):
        query_weights(torch.tensor([-1.0, 0.5]))
    with pytest.raises(ValueError, match="finite"):
        query_weights(torch.tensor([-1.0, float("nan")]))
    with pytest.raises(ValueError, match="at least one"):
        query_weights(torch.zeros(0))
    with pytest.raises(ValueError, match="every query"):
        query_weights(torch.zeros(3))


def test_query_weights_unclipped():
    """max_weight=None: the official code's per-step weight mean(s) / s_i, without the [0, 2] clip."""
    logp = torch.tensor([-1.0, -100.0, -1000.0, -50.0])
    w = query_weights(logp, max_weight=None)
    torch.testing.assert_close(w, (1151.0 / 4) / torch.tensor([1.0, 100.0, 1000.0, 50.0]))
    assert w[0] > 2.0 and query_weights(logp)[0] == 2.0
    with pytest.raises(ValueError, match="unbounded"):
        query_weights(torch.tensor([-1.0, 0.0]), max_weight=None)


def test_query_weights_relative_to_another_set():
    """mean_surprisal: weights of held-out queries on the scale of a set whose mean surprisal is given (the training
    set's), clipped as usual; the default is the queries' own mean."""
    logp = torch.tensor([-1.0, -4.0, -20.0], dtype=torch.float64)
    torch.testing.assert_close(query_weights(logp, mean_surprisal=4.0), torch.tensor([2.0, 1.0, 0.2]))
    torch.testing.assert_close(query_weights(logp, None, mean_surprisal=4.0), torch.tensor([4.0, 1.0, 0.2]))
    torch.testing.assert_close(query_weights(logp, mean_surprisal=25.0 / 3), query_weights(logp))
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="mean_surprisal must be a finite number > 0"):
            query_weights(logp, mean_surprisal=bad)


def test_backend_resolution(monkeypatch):
    """resolve_backend: the one rule every entry point applies to `backend`."""
    import erpo_kernels.api
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch" and resolve_backend("torch", "cuda") == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("triton", cpu) == "triton"          # TRITON_INTERPRET=1: the interpreter
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
    batch = random_batch()
    auto = call(batch, backend="auto")
    reference = call(batch, backend="torch")
    assert torch.equal(auto.loss, reference.loss) and torch.equal(auto.token_logp, reference.token_logp)
