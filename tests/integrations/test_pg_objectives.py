"""The policy terms of TRL 1.16's loss types (pg_objective: cispo, sapo, vespo; luspo = ppo-clip with its own
aggregation), TRL's off-policy sequence mask and entropy filter:
- against the float64 plain formula (tests/support/plain_formula.py), values and gradients, composed with ERPO's terms
  (Query-KL, random w(q)), token_weight and the rollout correction;
- against TRL's own GRPOTrainer._compute_loss, called on a stand-in trainer whose forward returns our per-token
  log-probs [B, C]: loss and gradient w.r.t. those log-probs, in float64 (rel 1e-6) and float32 (rel 1e-5), with
  qkl_coef = 0 and w(q) = 1, through erpo.integrations.trl's `trl_loss_options` (the GRPOConfig -> erpo_kernels
  mapping ERPOTrainer uses).
"""
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from erpo_kernels import OPTION_CHOICES, LossInputs, LossOptions, erpo_loss, fused_linear_erpo_loss, token_logprobs
from erpo_kernels.objective import erpo_objective, high_entropy_mask
from helpers import loss_inputs, random_batch
from plain_formula import plain_erpo_loss

# ---------------------------------------------------------------------------------------------------------------
# Float64 formula tests (the torch reference and the Triton logits path against plain_formula)


def near_policy_batch(seed=0):
    """random_batch with old_logp = the current log-probs + noise (ratios around 1, some outside every clip range),
    a token_weight and the rollout engine's log-probs."""
    batch = random_batch(seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    logp = token_logprobs(batch["logits"], torch.where(batch["token_kind"] != 0, batch["targets"], -100),
                          backend="torch")
    batch["old_logp"] = logp + 0.4 * torch.randn(48, generator=g)
    batch["rollout_logp"] = batch["old_logp"] + 0.3 * torch.randn(48, generator=g)
    batch["token_weight"] = torch.rand(48, generator=g) + 0.5
    return batch


ERPO = {"qkl_coef": 0.3}  # the Query-KL on, with the batch's random w(q)
FORMULA_CASES = {
    "cispo": dict(pg_objective="cispo", cispo_clip_max=1.1),
    "cispo-sequence-seqmean": dict(pg_objective="cispo", cispo_clip_max=1.05, ratio_level="sequence",
                                   loss_agg="seq-mean-token-mean", policy_kl_coef=0.1),
    "sapo": dict(pg_objective="sapo", sapo_temperature_pos=1.3, sapo_temperature_neg=2.0),
    "sapo-sequence-kl-bias": dict(pg_objective="sapo", ratio_level="sequence", policy_kl_coef=0.1,
                                  policy_kl_bias_correction=True),
    "vespo": dict(pg_objective="vespo"),
    "vespo-params-pg-clamp": dict(pg_objective="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                                  vespo_lambda_neg=1.5, pg_log_ratio_clamp=0.3),
    "luspo": dict(ratio_level="sequence", loss_agg="seq-mean-token-sum", num_seqs=7),
    "off-policy-mask": dict(off_policy_mask_threshold=0.05, loss_agg="seq-mean-token-mean"),
    "entropy-filter-token-mean": dict(top_entropy_quantile=0.4, entropy_coef=0.05, entropy_agg="token-mean"),
    "entropy-filter-loss-agg": dict(top_entropy_quantile=0.4, entropy_coef=0.05, pg_objective="sapo"),
    "entropy-filter-zero": dict(top_entropy_quantile=0.0, entropy_coef=0.05, entropy_agg="token-mean"),
    "everything-vespo": dict(pg_objective="vespo", off_policy_mask_threshold=0.05, top_entropy_quantile=0.5,
                             entropy_coef=0.05, entropy_agg="token-mean", policy_kl_coef=0.1),
}
ROLLOUT = {"none": {}, "rollout-is": {"rollout_is_cap": 1.5}, "rollout-no-is": {"rollout_is_cap": None}}


def formula_and_ours(batch, options, rollout, backend="torch", tensors=("advantages", "ref_query_logp",
                                                                        "query_weight", "old_logp", "ref_logp",
                                                                        "token_weight")):
    inputs = loss_inputs(batch, tensors)
    if rollout != "none":
        inputs["rollout_logp"] = batch["rollout_logp"]
    options = {**ERPO, **options, **ROLLOUT[rollout]}
    rows = (batch["targets"], batch["token_kind"], batch["sample_index"])
    logits = batch["logits"].double().requires_grad_(True)
    expected = plain_erpo_loss(logits, *rows, **inputs, **options)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    ours_logits = batch["logits"].clone().requires_grad_(True)
    out = erpo_loss(ours_logits, *rows, backend=backend, **inputs, **options)
    out.loss.backward()
    return (expected, expected_grad), (out, ours_logits.grad)


def assert_formula(batch, options, rollout, backend="torch", **kwargs):
    (expected, expected_grad), (out, grad) = formula_and_ours(batch, options, rollout, backend, **kwargs)
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=1e-6)
    return out


@pytest.mark.parametrize("rollout", list(ROLLOUT))
@pytest.mark.parametrize("case", list(FORMULA_CASES))
def test_policy_terms_match_float64_formula(case, rollout):
    assert_formula(near_policy_batch(), FORMULA_CASES[case], rollout)


@pytest.mark.parametrize("case", ["cispo", "vespo", "everything-vespo"])
def test_policy_terms_on_the_triton_path(case):
    assert_formula(near_policy_batch(seed=1), FORMULA_CASES[case], "rollout-is", backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_linear_path_equals_the_logits_path(backend):
    """The objective is shared: hidden @ weight (fused, never the whole logits) gives the logits path's loss and
    gradients with every new option on at once."""
    batch = near_policy_batch()
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(48, 16, generator=g), torch.randn(37, 16, generator=g) * 0.5
    batch["logits"] = hidden @ weight.t()
    options = dict(FORMULA_CASES["everything-vespo"], qkl_coef=0.3, rollout_is_cap=1.5)
    inputs = dict(loss_inputs(batch, ("advantages", "ref_query_logp", "query_weight", "old_logp", "ref_logp",
                                      "token_weight", "rollout_logp")))
    rows = (batch["targets"], batch["token_kind"], batch["sample_index"])
    fused_leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    fused = fused_linear_erpo_loss(*fused_leaves, *rows, backend=backend, **inputs, **options)
    fused.loss.backward()
    leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    expected = erpo_loss(leaves[0] @ leaves[1].t(), *rows, backend="torch", **inputs, **options)
    expected.loss.backward()
    torch.testing.assert_close(fused.loss, expected.loss.detach(), rtol=1e-5, atol=1e-6)
    for name in ("kept_tokens", "kept_entropy", "off_policy_masked_frac", "vespo_phi_mean"):
        torch.testing.assert_close(fused.metrics[name].float(), expected.metrics[name].float(), rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(fused_leaves, leaves):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)


def test_on_policy_policy_terms_match_float64_formula():
    """Without old_logp (ratio 1): CISPO's and VESPO's value is -A logp (phi(1) = 1), SAPO's -A * 4 / tau / 2."""
    for case in ("cispo", "sapo", "vespo", "off-policy-mask"):
        assert_formula(near_policy_batch(), FORMULA_CASES[case], "rollout-is",
                       tensors=("advantages", "ref_query_logp", "query_weight", "ref_logp"))


def metrics_of(options, batch=None, rollout="none"):
    batch = near_policy_batch() if batch is None else batch
    return formula_and_ours(batch, options, rollout)[1][0].metrics


def test_options_are_active_on_the_test_batch():
    """Each option changes something on the formula tests' batch, so their comparisons are not vacuous."""
    batch = near_policy_batch()
    cispo = metrics_of(FORMULA_CASES["cispo"], batch)
    assert 0 < cispo["clip_frac"] < 1                               # some weights truncated, not all
    vespo = metrics_of(FORMULA_CASES["vespo"], batch)
    assert 0.05 < vespo["vespo_phi_mean"] < 0.99                     # phi away from 0 and 1
    masked = metrics_of(FORMULA_CASES["off-policy-mask"], batch)["off_policy_masked_frac"]
    assert 0 < masked < 1
    behind = dict(batch, rollout_logp=batch["old_logp"] - 1.0)   # the rollout log-probs are the behaviour policy
    assert metrics_of(FORMULA_CASES["off-policy-mask"], behind, "rollout-no-is")["off_policy_masked_frac"] == 0
    filtered = metrics_of(FORMULA_CASES["entropy-filter-token-mean"], batch)
    assert 0 < filtered["kept_tokens"] < filtered["response_tokens"]
    assert filtered["kept_entropy"] > filtered["entropy"]          # the filter keeps the high-entropy rows
    assert metrics_of(FORMULA_CASES["entropy-filter-zero"], batch)["kept_tokens"] == 1
    base = metrics_of({}, batch)
    assert base["kept_tokens"] == base["response_tokens"] and "off_policy_masked_frac" not in base
    losses = {case: metrics_of(options, batch)["pg_loss"] for case, options in FORMULA_CASES.items()}
    assert len({round(float(v), 6) for v in losses.values()}) == len(losses)


def test_rollout_is_cap_none_keeps_rollout_logp_out_of_the_loss():
    """rollout_is_cap=None: rollout_logp only feeds metrics and the off-policy mask; no importance weight."""
    batch = near_policy_batch()
    rows = (batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"])
    plain = erpo_loss(*rows, backend="torch", **loss_inputs(batch))
    uncorrected = erpo_loss(*rows, backend="torch", rollout_logp=batch["rollout_logp"], rollout_is_cap=None,
                            **loss_inputs(batch))
    assert torch.equal(plain.loss, uncorrected.loss) and "rollout_is_weight" not in uncorrected.metrics
    assert uncorrected.metrics["rollout_logp_gap_abs"] > 0.1


def test_entropy_filter_uses_the_gathered_entropies():
    """top_entropy_gather: the quantile is over every process's entropies (here: this call's and a far higher set,
    so that no local row reaches the threshold)."""
    batch = near_policy_batch()
    others = torch.full((100,), 1e3)
    rows = (batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"])
    for gather, kept in ((None, lambda n: 0 < n < 20), (lambda local: torch.cat([local, others]), lambda n: n == 0)):
        out = erpo_loss(*rows, backend="torch", **loss_inputs(batch), top_entropy_quantile=0.5,
                        top_entropy_gather=gather)
        assert kept(out.metrics["kept_tokens"])
    entropy = torch.tensor([0.5, 2.0, 1.0, 3.0, 9.0])
    rows = torch.tensor([True, True, True, True, False])
    assert high_entropy_mask(entropy, rows, 0.5).tolist() == [False, True, False, True, False]
    assert not high_entropy_mask(entropy, torch.zeros(5, dtype=torch.bool), 0.5).any()


@pytest.mark.parametrize("options, message", [
    (dict(pg_objective="grpo"), "pg_objective must be one of"),
    (dict(pg_objective="cispo", dual_clip=3.0), "dual_clip applies to pg_objective='ppo-clip' only"),
    (dict(cispo_clip_max=0.0), "cispo_clip_max must be a finite number > 0"),
    (dict(sapo_temperature_pos=-1.0), "sapo_temperature_pos must be"),
    (dict(sapo_temperature_neg=float("inf")), "sapo_temperature_neg must be"),
    (dict(vespo_k_pos=-0.5), "vespo_k_pos must be a finite number >= 0"),
    (dict(vespo_k_neg=float("nan")), "vespo_k_neg must be"),
    (dict(vespo_lambda_pos=0.0), "vespo_lambda_pos must be a finite number >= 0.0001"),
    (dict(vespo_lambda_neg="2"), "vespo_lambda_neg must be"),
    (dict(off_policy_mask_threshold=float("nan")), "off_policy_mask_threshold must be None or a finite number"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile must be a number in \\[0, 1\\]"),
    (dict(top_entropy_quantile=-0.1), "top_entropy_quantile must be"),
    (dict(rollout_is_cap=0.0), "rollout_is_cap must be None or a finite number > 0"),
])
def test_bad_policy_options_raise(options, message):
    batch = random_batch()
    with pytest.raises(ValueError, match=message):
        erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], backend="torch",
                  **loss_inputs(batch), **options)


def test_bad_gather_and_choices():
    with pytest.raises(TypeError, match="top_entropy_gather must be None or a function"):
        LossOptions(top_entropy_gather=3)
    assert OPTION_CHOICES["pg_objective"] == ("ppo-clip", "cispo", "sapo", "vespo")


# ---------------------------------------------------------------------------------------------------------------
# Parity with TRL 1.16's GRPOTrainer._compute_loss

trl = pytest.importorskip("trl", exc_type=ModuleNotFoundError)
from erpo.integrations.trl.loss import trl_loss_options  # noqa: E402

B, P, C = 6, 3, 7              # samples, prompt width, completion width
ACCUMULATION, STEPS_PER_GENERATION, MAX_COMPLETION_LENGTH = 2, 4, 9


def trl_batch(dtype, seed=0):
    """TRL's [B, C] micro-batch: right-padded completions (one empty, one with a tool output), left-padded prompts,
    per-token log-probs (the leaf we differentiate), entropies, old / reference / vLLM sampling log-probs, vLLM's
    token_truncate importance ratios and num_items_in_batch. The log-probs hold fp32 values (exact in float64 too)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 4, 0, 6, 2, 7]
    completion_mask = torch.tensor([[1] * n + [0] * (C - n) for n in lengths])
    tool_mask = torch.ones_like(completion_mask)
    tool_mask[0, 2:4] = 0
    mask = (completion_mask * tool_mask).float()
    logp = -torch.rand(B, C, generator=g) * 3 - 0.05
    old = logp + 0.25 * torch.randn(B, C, generator=g)
    sampling = old + 0.2 * torch.randn(B, C, generator=g)
    # vLLM's token_truncate ratios (clip_min None, clip_max 1.3), computed in `dtype` as TRL does
    is_ratio = torch.exp((old.to(dtype) - sampling.to(dtype)) * mask.to(dtype)).clamp(max=1.3)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, 0] = prompt_mask[3, :2] = 0
    return dict(
        logp=logp.to(dtype), entropy=(torch.rand(B, C, generator=g) * 4).to(dtype),
        advantages=torch.tensor([1.0, -0.7, 0.4, -1.3, -0.2, 0.9]).to(dtype),
        old_per_token_logps=old.to(dtype), sampling_per_token_logps=sampling.to(dtype),
        ref_per_token_logps=(logp + 0.3 * torch.randn(B, C, generator=g)).to(dtype),
        importance_sampling_ratio=is_ratio, prompt_logp=(-torch.rand(B, P, generator=g) * 5).to(dtype),
        completion_mask=completion_mask, tool_mask=tool_mask, prompt_mask=prompt_mask,
        num_items_in_batch=mask.sum() * 3.0,
    )


def trl_args(**overrides):
    """The GRPOConfig fields _compute_loss reads, at GRPOConfig's defaults (TRL 1.16) unless overridden."""
    args = dict(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None, delta=None,
                importance_sampling_level="token", use_bias_correction_kl=True,
                sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, off_policy_mask_threshold=None,
                top_entropy_quantile=1.0, entropy_coef=0.0, use_adaptive_entropy=False, entropy_coef_min=0.0,
                entropy_coef_max=1.0, entropy_coef_delta=0.005, entropy_target=0.2,
                use_vllm=False, vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_max=1.3,
                steps_per_generation=STEPS_PER_GENERATION,
                max_completion_length=MAX_COMPLETION_LENGTH, old_logps=True, training=True, last_world_entropy=None)
    return SimpleNamespace(**{**args, **overrides})


class OneProcess:
    """The accelerator calls of _compute_loss, for one process."""
    num_processes = 1
    sync_gradients = True

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor, reduction="sum"):
        return tensor


def stand_in_trainer(batch, args, logp_leaf):
    """A GRPOTrainer with the state _compute_loss reads, whose forward returns (logp_leaf, entropies)."""
    trainer = trl.GRPOTrainer.__new__(trl.GRPOTrainer)
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    trainer.__dict__.update(
        args=args, accelerator=OneProcess(), model=SimpleNamespace(training=args.training),
        loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon, epsilon_high=epsilon_high,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, entropy_coef=args.entropy_coef,
        use_adaptive_entropy=args.use_adaptive_entropy,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        _last_world_entropy=math.inf if args.last_world_entropy is None else args.last_world_entropy,
        _entropy_window_stats=None, use_vllm=args.use_vllm,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        current_gradient_accumulation_steps=ACCUMULATION, max_completion_length=args.max_completion_length,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp_leaf, batch["entropy"], None))
    return trainer


def trl_inputs(batch, args):
    """GRPOTrainer's micro-batch dict from `batch`, with what `args` makes _generate_and_score_completions add."""
    inputs = dict(prompt_ids=torch.zeros(B, P, dtype=torch.long), prompt_mask=batch["prompt_mask"],
                  completion_ids=torch.zeros(B, C, dtype=torch.long), completion_mask=batch["completion_mask"],
                  tool_mask=batch["tool_mask"], advantages=batch["advantages"],
                  num_items_in_batch=batch["num_items_in_batch"], ref_per_token_logps=batch["ref_per_token_logps"])
    if args.old_logps:
        inputs["old_per_token_logps"] = batch["old_per_token_logps"]
    if args.use_vllm:
        inputs["sampling_per_token_logps"] = batch["sampling_per_token_logps"]
        if args.vllm_importance_sampling_correction:
            inputs["importance_sampling_ratio"] = batch["importance_sampling_ratio"]
    return inputs


def packed(batch, logp_leaf, tensors):
    """Our rows from TRL's layout: per sample, its prompt rows (kind 1, left padding kind 0), then its completion
    rows (kind 2 where completion_mask * tool_mask, else 0)."""
    mask = batch["completion_mask"] * batch["tool_mask"]
    kind = torch.cat([batch["prompt_mask"], 2 * mask], 1).reshape(-1)
    sample_index = torch.arange(B).repeat_interleave(P + C)

    def rows(prompt_part, completion_part):
        return torch.cat([prompt_part, completion_part], 1).reshape(-1)

    zeros = torch.zeros(B, P, dtype=logp_leaf.dtype)
    return dict(
        token_logp=rows(batch["prompt_logp"], logp_leaf), entropy=rows(zeros, batch["entropy"]), token_kind=kind,
        sample_index=sample_index,
        inputs=LossInputs(advantages=batch["advantages"],
                          **{k: None if v is None else rows(zeros, v) for k, v in tensors.items()}))


def ours_and_trl(args, dtype):
    """Our loss through the integration's GRPOConfig -> erpo_kernels mapping (`trl_loss_options`, read before TRL's
    loss updates the adaptive entropy state) and TRL's own _compute_loss, on the same stand-in trainer."""
    batch = trl_batch(dtype)
    trl_leaf = batch["logp"].clone().requires_grad_(True)
    trainer = stand_in_trainer(batch, args, trl_leaf)
    inputs = trl_inputs(batch, args)
    options, tensors = trl_loss_options(trainer, inputs, "train" if args.training else "eval")
    expected = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
    (expected_grad,) = torch.autograd.grad(expected, trl_leaf)
    leaf = batch["logp"].clone().requires_grad_(True)
    rows = packed(batch, leaf, tensors)
    out = erpo_objective(rows["token_logp"], rows["entropy"], rows["token_kind"], rows["sample_index"],
                         inputs=rows["inputs"], options=LossOptions(qkl_coef=0.0, **options))
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return (out, grad), (expected, expected_grad), trainer


TRL_CASES = {
    "cispo": dict(loss_type="cispo", epsilon_high=1.1),
    "cispo-default-clip-max": dict(loss_type="cispo"),                      # epsilon_high -> epsilon = 0.2
    "cispo-sequence-beta": dict(loss_type="cispo", epsilon_high=1.05, importance_sampling_level="sequence", beta=0.04),
    "cispo-vllm-is-on-policy": dict(loss_type="cispo", epsilon_high=1.1, use_vllm=True, old_logps=False),
    "sapo": dict(loss_type="sapo"),
    "sapo-temperatures-sequence": dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5,
                                       importance_sampling_level="sequence"),
    "sapo-beta-plain-eval": dict(loss_type="sapo", beta=0.04, use_bias_correction_kl=False, training=False),
    "vespo": dict(loss_type="vespo"),
    "vespo-params-beta": dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                              vespo_lambda_neg=0.0, beta=0.04),
    "vespo-vllm-is": dict(loss_type="vespo", use_vllm=True),
    "vespo-sequence-level": dict(loss_type="vespo", importance_sampling_level="sequence", beta=0.04),
    "vespo-eval": dict(loss_type="vespo", training=False, entropy_coef=0.05),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "luspo-token-delta": dict(loss_type="luspo", delta=1.5, epsilon_high=0.28),
    "off-policy-mask-dapo": dict(loss_type="dapo", off_policy_mask_threshold=0.02),
    "off-policy-mask-vllm-grpo": dict(loss_type="grpo", off_policy_mask_threshold=0.02, use_vllm=True, beta=0.04),
    "off-policy-mask-vllm-no-is": dict(loss_type="bnpo", off_policy_mask_threshold=0.02, use_vllm=True,
                                       vllm_importance_sampling_correction=False),
    "off-policy-mask-on-policy": dict(loss_type="cispo", off_policy_mask_threshold=0.0, old_logps=False),
    "entropy-filter-grpo": dict(loss_type="grpo", top_entropy_quantile=0.3, entropy_coef=0.05),
    "entropy-filter-dapo-beta": dict(loss_type="dapo", top_entropy_quantile=0.5, beta=0.04),
    "entropy-filter-zero-dr-grpo": dict(loss_type="dr_grpo", top_entropy_quantile=0.0, entropy_coef=0.05),
    "entropy-filter-vespo-opsm": dict(loss_type="vespo", top_entropy_quantile=0.6, entropy_coef=0.05,
                                      off_policy_mask_threshold=0.02, use_vllm=True),
    "adaptive-entropy-applied": dict(loss_type="sapo", use_adaptive_entropy=True, entropy_coef=0.1,
                                     last_world_entropy=0.1, top_entropy_quantile=0.5),
    "adaptive-entropy-gated": dict(loss_type="cispo", use_adaptive_entropy=True, entropy_coef=0.1),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", list(TRL_CASES))
def test_loss_and_gradient_equal_trl(case, dtype):
    args = trl_args(**TRL_CASES[case])
    (out, grad), (expected, expected_grad), trainer = ours_and_trl(args, dtype)
    rtol = 1e-6 if dtype == torch.float64 else 1e-5
    assert expected.abs() > 1e-3 and expected_grad.abs().max() > 1e-3   # not trivially zero
    torch.testing.assert_close(out.loss.to(dtype), expected, rtol=rtol, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=rtol, atol=rtol * expected_grad.abs().max().item())
    if args.use_adaptive_entropy:
        # TRL's controller reads the entropy over the rows the filter keeps: kept_entropy, kept_tokens
        window = trainer._last_world_entropy
        assert window == pytest.approx(out.metrics["kept_entropy"].item(), rel=1e-6)
        step = args.entropy_coef_delta if window <= args.entropy_target else -args.entropy_coef_delta
        expected_coef = min(max(args.entropy_coef + step, args.entropy_coef_min), args.entropy_coef_max)
        assert trainer.entropy_coef == pytest.approx(expected_coef)


def test_trl_parity_cases_exercise_the_options():
    """The TRL batch makes each option act: cispo truncates, the off-policy mask drops a sample and keeps another,
    the entropy filter keeps a strict subset, VESPO's phi is neither 0 nor 1."""
    def metrics(**overrides):
        return ours_and_trl(trl_args(**overrides), torch.float64)[0][0].metrics
    assert 0 < metrics(**TRL_CASES["cispo"])["clip_frac"] < 1
    for case in ("off-policy-mask-dapo", "off-policy-mask-vllm-grpo", "off-policy-mask-vllm-no-is"):
        assert 0 < metrics(**TRL_CASES[case])["off_policy_masked_frac"] < 1, case
    filtered = metrics(**TRL_CASES["entropy-filter-grpo"])
    assert 0 < filtered["kept_tokens"] < filtered["response_tokens"]
    for case in ("vespo", "vespo-vllm-is"):   # phi peaks at w = k / lambda (1.21 for TRL's k_pos, lambda_pos)
        assert 0.05 < metrics(**TRL_CASES[case])["vespo_phi_mean"] and \
            abs(metrics(**TRL_CASES[case])["vespo_phi_mean"] - 1) > 0.01, case
