"""The Triton path's objective kernels (erpo_kernels/triton_objective.py) and row checks (triton_row_checks.py):
what one erpo_loss call costs (kernel launches and host syncs, counted on any machine), and its values, gradients
and metrics against the torch reference for every option combination the kernels fuse."""
import pytest
import torch

from erpo_kernels import erpo_loss
from erpo_kernels.api import objective_on_backend
from erpo_kernels.triton_logits import DEFAULT_FORWARD_VARIANT, FORWARD_VARIANTS
from erpo_kernels.triton_objective import fuses, objective_backward_op, objective_op, objective_settings
from erpo_kernels.triton_quantile import masked_quantile_op
from erpo_kernels.triton_row_checks import first_bad_row_op
from erpo_kernels.triton_segment import sample_spans_op
from erpo_kernels.validation import LossInputs, LossOptions
from helpers import assert_compiled_equals_eager, loss_inputs, random_batch
from launch_counts import LaunchCounter

# per fwd+bwd of erpo_loss on the Triton path (issue 32: at most 20): 15 on the CPU with the entropy filter, one
# more on CUDA (the row checks' code copied to pinned memory)
MAX_LAUNCHES = 13
NUM_ROWS = 48


def rollout_tensors(batch):
    g = torch.Generator().manual_seed(11)
    device = batch["logits"].device
    token_weight = (torch.rand(NUM_ROWS, generator=g) * 2).to(device)
    token_weight[batch["token_kind"] == 0] = float("nan")  # never read on rows of kind 0
    return dict(token_weight=token_weight,
                rollout_logp=batch["old_logp"] + 0.4 * torch.randn(NUM_ROWS, generator=g).to(device))


# The option sets TRL / erpo train with most (issue 32's list); each must be fused (`fuses`).
FUSED_CASES = {
    "default": {},
    "gspo": dict(ratio_level="sequence"),
    "gspo-dual-pg-clamp": dict(ratio_level="sequence", dual_clip=2.0, pg_log_ratio_clamp=0.3, clip_low=0.05),
    "seq-mean-token-mean": dict(loss_agg="seq-mean-token-mean", qkl_coef=0.2),
    "seq-mean-token-sum": dict(loss_agg="seq-mean-token-sum", num_seqs=7),
    "k1": dict(qkl_estimator="k1"),
    "k2-kl-clamp": dict(qkl_estimator="k2", qkl_coef=0.5, kl_clamp=0.5, qkl_linear_beyond=2.0),
    "k3-linear-beyond": dict(qkl_coef=0.3, qkl_linear_beyond=1.5),
    "k3-kl-clamp": dict(qkl_coef=0.3, kl_clamp=20.0, qkl_linear_beyond=8.0),
    "policy-kl": dict(policy_kl_coef=0.1, log_ratio_clamp=0.5),
    "policy-kl-bias": dict(policy_kl_coef=0.1, policy_kl_bias_correction=True, pg_log_ratio_clamp=0.2),
    "policy-kl-bias-gspo": dict(policy_kl_coef=0.1, policy_kl_bias_correction=True, ratio_level="sequence",
                                kl_clamp=0.05),
    "entropy-loss-agg": dict(entropy_coef=0.05, loss_agg="seq-mean-token-mean"),
    "entropy-token-mean": dict(entropy_coef=0.05, entropy_agg="token-mean", loss_agg="seq-mean-token-sum"),
    "dual-clip": dict(dual_clip=1.5, clip_low=0.1, clip_high=0.28),
    "rollout-is": dict(_rollout=True, rollout_is_cap=1.5),
    "rollout-no-cap": dict(_rollout=True, rollout_is_cap=None, policy_kl_coef=0.05),
    "transform-num-items": dict(temperature=0.7, logit_scale=0.5, logit_softcap=3.0, num_items=100),
    "tensor-denominators": dict(_tensor_denominators=True, loss_agg="seq-mean-token-mean"),
    "on-policy": dict(_on_policy=True, qkl_estimator="k2"),
    "no-query-weight": dict(_without=("query_weight",), qkl_coef=0.0),
    "cispo": dict(pg_objective="cispo", cispo_clip_max=1.2),
    "cispo-gspo-rollout": dict(pg_objective="cispo", ratio_level="sequence", _rollout=True, rollout_is_cap=1.5,
                               cispo_clip_max=0.05),
    "sapo": dict(pg_objective="sapo"),
    "sapo-gspo-pg-clamp": dict(pg_objective="sapo", ratio_level="sequence", pg_log_ratio_clamp=0.3,
                               sapo_temperature_neg=2.0),
    "vespo": dict(pg_objective="vespo"),
    "vespo-rollout-pg-clamp": dict(pg_objective="vespo", _rollout=True, rollout_is_cap=1.5, pg_log_ratio_clamp=0.3,
                                   vespo_k_neg=1.5),
    "off-policy-mask": dict(off_policy_mask_threshold=0.1),
    "off-policy-mask-rollout-gspo": dict(off_policy_mask_threshold=0.05, _rollout=True, ratio_level="sequence"),
    "k3-token": dict(qkl_estimator="k3-token", qkl_coef=0.3),
    "entropy-filter": dict(top_entropy_quantile=0.5),
    "entropy-filter-bonus-gspo": dict(top_entropy_quantile=0.3, entropy_coef=0.05, entropy_agg="token-mean",
                                      ratio_level="sequence"),
    "entropy-filter-bonus-loss-agg": dict(top_entropy_quantile=0.7, entropy_coef=0.05, loss_agg="seq-mean-token-mean",
                                          pg_objective="cispo"),
    "k3-token-kl-clamp-bias": dict(qkl_estimator="k3-token", qkl_coef=0.3, kl_clamp=0.2, policy_kl_coef=0.1,
                                   policy_kl_bias_correction=True, log_ratio_clamp=0.4),
}
# Options the kernels leave to the reference objective (on the Triton path's per-sample sums).
FALLBACK_CASES = {
    "entropy-filter-gathered": dict(top_entropy_quantile=0.5, top_entropy_gather=lambda pool: pool),
}


def call_arguments(batch, case: dict):
    """(tensors, options) of one case: the batch's inputs plus the case's own ("_"-prefixed keys are not options)."""
    options = dict(case)
    tensors = loss_inputs(batch)
    if options.pop("_rollout", False):
        tensors.update(rollout_tensors(batch))
    if options.pop("_tensor_denominators", False):
        device = batch["logits"].device
        options.update(num_items=torch.tensor(30.0, device=device), num_seqs=torch.tensor(4.0, device=device))
    if options.pop("_on_policy", False):
        tensors.pop("old_logp")
    for name in options.pop("_without", ()):
        tensors.pop(name)
    return tensors, options


def run(batch, backend, case, **extra):
    tensors, options = call_arguments(batch, case)
    logits = batch["logits"].clone().requires_grad_(True)
    out = erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend=backend,
                    **tensors, **options, **extra)
    out.loss.backward()
    return out, logits.grad


def count_launches(batch, case, **extra):
    tensors, options = call_arguments(batch, case)
    logits = batch["logits"].clone().requires_grad_(True)
    with LaunchCounter() as counter:
        out = erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend="triton",
                        **tensors, **options, **extra)
        out.loss.backward()
    return counter


def assert_matches_reference(batch, case, grad_tolerance=dict(rtol=1e-4, atol=1e-6)):
    (ref, ref_grad), (tri, tri_grad) = (run(batch, backend, case) for backend in ("torch", "triton"))
    torch.testing.assert_close(tri.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tri_grad, ref_grad, **grad_tolerance)
    for name in ("token_logp", "query_logp", "response_logp", "entropy"):
        torch.testing.assert_close(getattr(tri, name), getattr(ref, name), rtol=1e-5, atol=1e-5)
    assert list(tri.metrics) == list(ref.metrics)
    for name, value in ref.metrics.items():
        torch.testing.assert_close(tri.metrics[name], value, rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)
    return tri, tri_grad


def test_the_cases_are_fused_or_not_as_listed():
    logp = torch.zeros(3, device="cpu")  # which cases fuse does not depend on the device: on the CPU on purpose
    for case in FUSED_CASES.values():
        _, options = call_arguments(random_batch(device="cpu"), case)
        assert fuses(LossOptions(**options), logp, logp)
    for case in FALLBACK_CASES.values():
        assert not fuses(LossOptions(**case), logp, logp)
    assert not fuses(LossOptions(), logp.double(), logp.double())  # fp64 log-probs: the reference


@pytest.mark.parametrize("case", FUSED_CASES.values(), ids=FUSED_CASES.keys())
def test_fused_objective_matches_reference(case, device):
    assert_matches_reference(random_batch(device=device), case)


@pytest.mark.parametrize("case", FUSED_CASES.values(), ids=FUSED_CASES.keys())
def test_fwd_bwd_launches_at_most_20_with_one_sync(case, device):
    """aten kernels + Triton launches (the counts do not depend on N or V, nor on the device). validate=True: one
    host read (the row checks); validate=False: none."""
    batch = random_batch(device=device)
    counter = count_launches(batch, case)
    assert counter.launches <= MAX_LAUNCHES, counter.names
    assert counter.syncs == 1, counter.names
    unchecked = count_launches(batch, case, validate=False)
    assert unchecked.syncs == 0
    # validate=False: the spans kernel and its fill instead of the row-check kernel and its code's fill, both
    # finding the spans and writing the scored targets (no mask and where of their own); on CUDA the code's copy to
    # pinned memory (validation.read_code_later) is one launch fewer
    assert unchecked.launches == counter.launches - (1 if device.type == "cuda" else 0)
    assert counter.names["triton._sample_spans_kernel"] == 0 and unchecked.names["triton._sample_spans_kernel"] == 1
    for name in ("aten.ne", "aten.where"):  # the scored targets' mask and where (the entropy filter has a where)
        assert unchecked.names[name] == counter.names[name], name
    assert unchecked.names["triton._objective_sample_kernel"] == 1
    assert unchecked.names[f"triton.{FORWARD_VARIANTS[DEFAULT_FORWARD_VARIANT].backward.__name__}"] == 1


@pytest.mark.parametrize("case", FALLBACK_CASES.values(), ids=FALLBACK_CASES.keys())
def test_unfused_options_run_the_reference_objective(case, device):
    """The gathered entropy filter reads the host once more than the row checks, whatever `validate`: its pool,
    the response rows' entropies, has a data-dependent length (a boolean selection). The row checks' one read is
    their code's: on CUDA a wait on the event after its copy to pinned memory (validation.read_code_later), then a read
    of host memory; elsewhere a scalar read of the code itself."""
    batch = random_batch(device=device)
    assert_matches_reference(batch, case)
    counter = count_launches(batch, case)
    assert counter.names["triton._objective_sample_kernel"] == 0
    row_checks_read = "event.synchronize" if device.type == "cuda" else "aten._local_scalar_dense"
    assert counter.sync_names == {row_checks_read: 1, "aten.index": 1}, counter.sync_names
    assert count_launches(batch, case, validate=False).sync_names == {"aten.index": 1}


def test_launch_count_of_the_default_options_is_8(device):
    """The count API.md quotes, on the CPU, with validate True and False: forward 5 (row checks 2 + 1 read: a fill
    and one kernel that also finds each sample's span of rows, no sort, and forms the scored targets; with
    validate=False the spans kernel and its fill, no read; logp/entropy 1, objective 2), backward 3 (grad_output's
    ones, the objective's coefficients, dlogits)."""
    if device.type != "cpu":
        pytest.skip("the exact count is the interpreter's (CPU); on a GPU the <= 20 test counts")
    counter = count_launches(random_batch(device=device), {})
    assert counter.launches == 8, counter.names
    assert counter.names["triton._first_bad_row_kernel"] == 1 and counter.names["aten.sort"] == 0
    assert counter.names["aten.ne"] == 0 and counter.names["aten.where"] == 0  # no scored targets of their own
    # validate=False: the spans kernel and its fill instead, which write the scored targets too
    assert count_launches(random_batch(device=device), {}, validate=False).launches == 8
    # the entropy filter's threshold first: the pool's mask, its +inf fill, the sort, the quantile program
    filtered = count_launches(random_batch(device=device), dict(top_entropy_quantile=0.5))
    assert filtered.launches == 12 and filtered.names["triton._masked_quantile_kernel"] == 1, filtered.names


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum"])
def test_one_element_denominators_of_any_shape_give_a_0_dim_loss(loss_agg, backend, device):
    """num_items / num_seqs as [1]-shaped tensors: the loss and the metrics are 0-dim, equal to the numbers'."""
    batch = random_batch(device=device)
    case = dict(loss_agg=loss_agg, qkl_coef=0.3)
    as_numbers, _ = run(batch, backend, dict(case, num_items=30.0, num_seqs=4.0))
    as_tensors, _ = run(batch, backend, dict(case, num_items=torch.tensor([30.0], device=device),
                                             num_seqs=torch.tensor([4.0], device=device)))
    assert as_tensors.loss.shape == () and all(value.shape == () for value in as_tensors.metrics.values())
    torch.testing.assert_close(as_tensors.loss, as_numbers.loss, rtol=1e-6, atol=1e-7)
    for name in ("qkl", "pg_loss"):
        torch.testing.assert_close(as_tensors.metrics[name], as_numbers.metrics[name], rtol=1e-6, atol=1e-7)


def test_validate_false_still_checks_shapes_and_options(device):
    batch = random_batch(device=device)
    tensors, _ = call_arguments(batch, {})
    with pytest.raises(ValueError, match="advantages"):
        erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], backend="triton",
                  validate=False, **dict(tensors, advantages=torch.zeros(2, 2, device=device)))
    with pytest.raises(ValueError, match="loss_agg"):
        erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], backend="triton",
                  validate=False, loss_agg="mean", **tensors)
    with pytest.raises(TypeError, match="validate must be True or False"):
        erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], backend="triton",
                  validate="no", **tensors)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", ["token_kind", "sample_index", "targets", "token_weight", "rollout_logp", "two"])
def test_row_checks_name_the_first_bad_row_on_both_backends(bad, backend, device):
    """The Triton row-check kernel and the torch masks report the same first failing check and row."""
    batch = random_batch(device=device)
    tensors = dict(loss_inputs(batch), **rollout_tensors(batch))
    scored = (batch["token_kind"] != 0).nonzero().flatten()
    response = (batch["token_kind"] == 2).nonzero().flatten()
    kind, sample, targets = batch["token_kind"].clone(), batch["sample_index"].clone(), batch["targets"].clone()
    expected = {"token_kind": (kind, scored[3], 7, "token_kind must be 0, 1 or 2"),
                "sample_index": (sample, scored[5], 5, "sample_index must lie in [0, 5)"),
                "targets": (targets, scored[2], 37, "targets must lie in [0, 37)"),
                "token_weight": (tensors["token_weight"], scored[4], -1.0, "token_weight must be finite and >= 0"),
                "rollout_logp": (tensors["rollout_logp"], response[1], float("nan"), "rollout_logp is NaN"),
                "two": (sample, scored[9], -1, "sample_index must lie in [0, 5)")}
    tensor, row, value, message = expected[bad]
    tensor[row] = value
    if bad == "two":  # a later check's bad row before an earlier check's: the earlier check is reported
        tensors["token_weight"][scored[1]] = float("inf")
    with pytest.raises(ValueError) as error:
        erpo_loss(batch["logits"], targets, kind, sample, backend=backend, **tensors)
    assert str(error.value).startswith(message) and f"row {int(row)} " in f"{error.value} ", str(error.value)


def test_fused_objective_is_deterministic_and_batch_rows_may_come_in_any_order(device):
    """Bit for bit run to run; rows of one sample need not be contiguous (they are sorted by sample, stably)."""
    batch = random_batch(device=device, num_rows=NUM_ROWS)
    case = dict(ratio_level="sequence", loss_agg="seq-mean-token-mean", policy_kl_coef=0.1, entropy_coef=0.02)
    first, first_grad = run(batch, "triton", case)
    again, again_grad = run(batch, "triton", case)
    assert torch.equal(first.loss, again.loss) and torch.equal(first_grad, again_grad)
    for name, value in first.metrics.items():
        assert torch.equal(value, again.metrics[name]) or (value.isnan() and again.metrics[name].isnan())
    permutation = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(5)).to(device)
    shuffled = {name: tensor[permutation] if tensor.shape[0] == NUM_ROWS else tensor for name, tensor in batch.items()}
    moved, moved_grad = run(shuffled, "triton", case)
    torch.testing.assert_close(moved.loss, first.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(moved_grad, first_grad[permutation], rtol=1e-5, atol=1e-7)


def test_nonfinite_rows_give_nan_loss_and_zero_rows_stay_exactly_zero(device):
    batch = random_batch(device=device)
    kind = batch["token_kind"]
    batch["logits"][(kind == 2).nonzero()[0, 0], 3] = float("nan")
    padding = (kind == 0).nonzero().flatten()
    batch["logits"][padding[0]] = float("inf")
    out, grad = run(batch, "triton", dict(policy_kl_coef=0.1, entropy_coef=0.05))
    assert torch.isnan(out.loss) and out.metrics["nonfinite_rows"].item() == 1
    assert grad[padding].eq(0).all()
    clean = random_batch(device=device)
    clean["advantages"][:] = 0.0  # no policy gradient: response rows get none; query rows only the Query-KL's
    out, grad = run(clean, "triton", {})
    assert torch.isfinite(out.loss)
    assert grad[clean["token_kind"] == 2].eq(0).all() and grad[clean["token_kind"] == 0].eq(0).all()
    assert grad[clean["token_kind"] == 1].abs().sum() > 0


def test_bf16_logits_through_the_fused_objective(device):
    batch = random_batch(device=device, dtype=torch.bfloat16)
    tri, grad = assert_matches_reference(batch, dict(policy_kl_coef=0.1, ratio_level="sequence"),
                                         grad_tolerance=dict(rtol=2e-2, atol=2e-2))
    assert grad.dtype == torch.bfloat16


@pytest.mark.parametrize("with_entropy", [True, False])
def test_objective_on_log_probs_matches_the_reference(with_entropy, device):
    """The function logprob_erpo_loss runs on: gradients with respect to token_logp and entropy themselves. Without
    entropy the kernels take none (the reference, which needs one, gets zeros: entropy_coef is 0)."""
    batch = random_batch(device=device)
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(NUM_ROWS, generator=g) * 3).to(device)
    entropy = (torch.rand(NUM_ROWS, generator=g) * 2).to(device) if with_entropy else None
    tensors, options = call_arguments(batch, dict(_rollout=True, policy_kl_coef=0.1, ratio_level="sequence",
                                                  entropy_coef=0.05 if with_entropy else 0.0))
    inputs, opts = LossInputs(**tensors), LossOptions(**options)
    results = []
    for triton in (False, True):
        leaves = [logp.clone().requires_grad_(True)] + ([entropy.clone().requires_grad_(True)] if with_entropy else [])
        entropy_leaf = leaves[1] if with_entropy else None if triton else torch.zeros_like(logp)
        out = objective_on_backend(leaves[0], entropy_leaf, batch["token_kind"],
                                   batch["sample_index"], inputs=inputs, options=opts, triton=triton)
        results.append((out, torch.autograd.grad(out.loss, leaves)))
    (ref, ref_grads), (tri, tri_grads) = results
    torch.testing.assert_close(tri.loss, ref.loss, rtol=1e-5, atol=1e-6)
    for grad, ref_grad in zip(tri_grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-7)
    for name in ("qkl", "policy_kl", "pg_loss", "clip_frac", "ratio_mean", "rollout_is_weight"):
        torch.testing.assert_close(tri.metrics[name], ref.metrics[name], rtol=1e-5, atol=1e-6)
    if not with_entropy:  # the kernels' entropy metrics then do not apply
        assert "entropy" not in tri.metrics and "kept_entropy" not in tri.metrics


def test_opcheck_objective_ops(device):
    batch = random_batch(device=device)
    tensors, options = call_arguments(batch, dict(_rollout=True, policy_kl_coef=0.1, entropy_coef=0.05))
    inputs, opts = LossInputs(**tensors), LossOptions(**options)
    logp = (-torch.rand(NUM_ROWS) * 3).to(device).requires_grad_(True)
    entropy = (torch.rand(NUM_ROWS) * 2).to(device).requires_grad_(True)
    spans = sample_spans_op(batch["sample_index"], 5, batch["token_kind"])
    arguments = (logp, entropy, batch["token_kind"], batch["sample_index"], spans, inputs.advantages,
                 inputs.ref_query_logp, inputs.query_weight, inputs.old_logp, inputs.ref_logp, inputs.token_weight,
                 inputs.rollout_logp, None, None, None, objective_settings(opts, inputs, True))
    # Not opcheck's AOT-dispatch comparison: its assert_close has equal_nan=False and the metrics vector holds NaN
    # by definition (the unfused metrics); test_compiled_fused_loss_equals_eager runs the op under AOT autograd.
    torch.library.opcheck(objective_op, arguments,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    coefs = objective_op(*arguments)[5:]
    torch.library.opcheck(objective_backward_op, (torch.tensor(1.0, device=device), batch["token_kind"], *coefs))
    for with_spans, with_scored_targets in ((False, False), (True, False), (True, True)):
        torch.library.opcheck(first_bad_row_op, (batch["token_kind"], batch["sample_index"], batch["targets"],
                                                 inputs.token_weight, inputs.rollout_logp, 5, 37, with_spans,
                                                 with_scored_targets))
    torch.library.opcheck(masked_quantile_op, (entropy.detach(), batch["token_kind"], 2, 0.3))
    torch.library.opcheck(sample_spans_op, (batch["sample_index"], 5, batch["token_kind"]))


@pytest.mark.parametrize("case", [dict(_rollout=True, ratio_level="sequence", policy_kl_coef=0.1),
                                  dict(pg_objective="vespo", top_entropy_quantile=0.4, entropy_coef=0.05)],
                         ids=["gspo-rollout", "vespo-entropy-filter"])
def test_compiled_fused_loss_equals_eager(case, device):
    """torch.compile(fullgraph=True) keeps the ops whole (no graph break); the row checks become one assert."""
    batch = random_batch(device=device)
    tensors, options = call_arguments(batch, case)

    def loss(logits):
        return erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend="triton",
                         **tensors, **options).loss

    assert_compiled_equals_eager(loss, batch["logits"].clone().requires_grad_(True), grad_rtol=1e-6)


def test_host_syncs_of_the_entry_points_on_log_probs_and_sums(device):
    """fwd+bwd: logprob_erpo_loss, token_logprobs and fused_linear_token_logprobs read the host once with
    validate=True (their value checks), never with False; sample_sums once (its value check; it has no `validate`).
    """
    from erpo_kernels import fused_linear_token_logprobs, logprob_erpo_loss, sample_sums, token_logprobs

    batch = random_batch(device=device)
    token_logp = -torch.rand(NUM_ROWS, device=device)
    hidden, weight = torch.randn(NUM_ROWS, 8, device=device), torch.randn(37, 8, device=device)
    calls = {
        "logprob_erpo_loss": lambda validate: logprob_erpo_loss(
            token_logp.clone().requires_grad_(), batch["token_kind"], batch["sample_index"], backend="triton",
            validate=validate, **loss_inputs(batch)).loss,
        "token_logprobs": lambda validate: token_logprobs(batch["logits"].clone().requires_grad_(), batch["targets"],
                                                          backend="triton", validate=validate).sum(),
        "fused_linear_token_logprobs": lambda validate: fused_linear_token_logprobs(
            hidden.clone().requires_grad_(), weight.clone().requires_grad_(), batch["targets"], backend="triton",
            validate=validate).sum(),
        "sample_sums": lambda _: sample_sums(token_logp.clone().requires_grad_(), batch["sample_index"], 5,
                                             backend="triton").sum(),
    }
    for name, call in calls.items():
        for validate in (True,) if name == "sample_sums" else (True, False):
            with LaunchCounter() as counter:
                call(validate).backward()
            assert counter.syncs == int(validate), (name, validate, counter.sync_names)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_token_logprobs_validate_checks_the_targets_or_skips_them(backend, device):
    """token_logprobs and fused_linear_token_logprobs: an out-of-range target raises one line naming the row with
    validate=True; validate=False skips the check (no read) and leaves the in-range rows' values unchanged; a
    non-bool validate is refused."""
    from erpo_kernels import fused_linear_token_logprobs, token_logprobs

    batch = random_batch(device=device)
    hidden, weight = torch.randn(NUM_ROWS, 8, device=device), torch.randn(37, 8, device=device)
    calls = {"token_logprobs": lambda targets, **kw: token_logprobs(batch["logits"], targets, backend=backend, **kw),
             "fused_linear_token_logprobs": lambda targets, **kw: fused_linear_token_logprobs(
                 hidden, weight, targets, backend=backend, **kw)}
    bad = batch["targets"].clone()
    bad[3] = 37
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"targets must lie in \[0, 37\) on scored rows; row 3 holds 37"):
            call(bad)
        with pytest.raises(TypeError, match="validate must be True or False, got 1"):
            call(batch["targets"], validate=1)
        checked = call(batch["targets"])
        torch.testing.assert_close(call(batch["targets"], validate=False), checked, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("entry", ["module", "fused-linear"])
def test_validate_false_reaches_the_other_entry_points(entry, device):
    """ERPOLoss(validate=...) and fused_linear_erpo_loss(validate=...): ERPOLoss reads once on the host when on, never
    when off; the fused-linear path once either way (its chunk plan's read of the rows' layout, which carries the value
    checks' code when on), and raises the bad row's error all the same."""
    from erpo_kernels import ERPOLoss, fused_linear_erpo_loss

    batch = random_batch(device=device)
    hidden, weight = torch.randn(NUM_ROWS, 8).to(device), torch.randn(37, 8).to(device)

    def call(validate, token_kind=batch["token_kind"]):
        if entry == "module":
            loss_fn = ERPOLoss(backend="triton", validate=validate)
            return loss_fn(batch["logits"], batch["targets"], token_kind, batch["sample_index"], **loss_inputs(batch))
        return fused_linear_erpo_loss(hidden, weight, batch["targets"], token_kind, batch["sample_index"],
                                      backend="triton", validate=validate, **loss_inputs(batch))

    # the fused-linear path plans its chunks on the host: one read of token_kind and sample_index together (with the
    # checks' code when on)
    plan_read = int(entry == "fused-linear")
    for validate, syncs in ((True, 1), (False, plan_read)):
        with LaunchCounter() as counter:
            call(validate)
        assert counter.syncs == syncs, counter.sync_names
    bad_kind = batch["token_kind"].clone()
    bad_kind[4] = 3
    with pytest.raises(ValueError, match="token_kind must be 0, 1 or 2; row 4 holds 3"):
        call(True, bad_kind)
