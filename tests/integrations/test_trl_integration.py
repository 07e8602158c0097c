"""erpo.integrations.trl: ERPOTrainer's loss equals TRL's GRPOTrainer._compute_loss (loss and every gradient) when
ERPO's terms are off, and a few real train() steps log the Query-KL and write / reuse the reference cache.
Tiny Qwen2 and character tokenizer built locally (erpo.models.tiny); CPU only."""
import contextlib
import copy
import dataclasses
import importlib.resources
import json
import math
import os

import pytest
import torch

trl = pytest.importorskip("trl", exc_type=ModuleNotFoundError)
datasets = pytest.importorskip("datasets", exc_type=ModuleNotFoundError)
transformers = pytest.importorskip("transformers", exc_type=ModuleNotFoundError)

import erpo.integrations.trl.scorer as scorer_module  # noqa: E402
import erpo_kernels.api as api  # noqa: E402
from erpo.integrations.trl import ERPOConfig, ERPOTrainer  # noqa: E402
from erpo.integrations.trl.layout import completion_rows  # noqa: E402
from erpo.integrations.trl.reference import (  # noqa: E402
    PROMPT_TOKEN_IDS,
    THETA0_RECORD,
    device_prompt_ids,
    weights_fingerprint,
)
from erpo.integrations.trl.scorer import FusedLinearScorer, LogitsScorer  # noqa: E402
from erpo.integrations.trl.trainer import UNSCORED_SAMPLES  # noqa: E402
from erpo.models.fingerprint import model_fingerprint  # noqa: E402
from erpo.reference.cache import (
    CACHE_FILE,  # noqa: E402
    ReferenceCache,
    compute_query_logp,  # noqa: E402
    prompt_hash,
)
from erpo_kernels import fused_linear_token_logprobs, query_weights, token_logprobs  # noqa: E402
from launch_counts import LaunchCounter  # noqa: E402
from tiny_models import save_tiny_model, tiny_test_model  # noqa: E402
from trl_runs import PROMPTS, TRAINER_SETTINGS, reward_length  # noqa: E402


def make_trainer(tiny, output_dir, conversational=False, train_dataset=None, eval_dataset=None, **overrides):
    path, tokenizer = tiny
    rows = [{"prompt": [{"role": "user", "content": p}] if conversational else p} for p in PROMPTS]
    args = ERPOConfig(**{**TRAINER_SETTINGS, "output_dir": str(output_dir), **overrides})
    return ERPOTrainer(model=path, reward_funcs=reward_length, args=args, processing_class=tokenizer,
                       train_dataset=datasets.Dataset.from_list(rows) if train_dataset is None else train_dataset,
                       eval_dataset=eval_dataset)


def trl_inputs(trainer, seed=0):
    """A GRPOTrainer micro-batch as `_generate_and_score_completions` builds it, with every optional tensor:
    left-padded prompts, right-padded completions (one fully masked, as mask_truncated_completions leaves it),
    a tool output inside a completion (tool_mask 0), old and reference log-probs off the current policy,
    vLLM importance-sampling ratios and num_items_in_batch; and the prompts' token ids as host lists, which
    ERPOTrainer's `_generate_and_score_completions` adds."""
    g = torch.Generator().manual_seed(seed)
    tokenizer = trainer.processing_class
    prompts = [tokenizer(p)["input_ids"] for p in ["1+1=", "22+3=", "7*8=", "3*33="]]
    width = max(map(len, prompts))
    prompt_ids = torch.full((4, width), tokenizer.pad_token_id)
    prompt_mask = torch.zeros((4, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p):] = torch.tensor(p)
        prompt_mask[i, width - len(p):] = 1
    completion_ids = torch.randint(3, len(tokenizer), (4, 6), generator=g)
    completion_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [0] * 6, [1] * 5 + [0]])
    completion_ids[completion_mask == 0] = tokenizer.pad_token_id
    tool_mask = torch.ones_like(completion_mask)
    tool_mask[0, 2:4] = 0
    mask = (completion_mask * tool_mask).float()
    return dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, erpo_prompt_token_ids=prompts, completion_ids=completion_ids,
        completion_mask=completion_mask, tool_mask=tool_mask, advantages=torch.tensor([1.0, -0.7, 0.4, -1.3]),
        num_items_in_batch=mask.sum() * 3,
        noise_old=0.3 * torch.randn(4, 6, generator=g), noise_ref=0.3 * torch.randn(4, 6, generator=g),
        importance_sampling_ratio=(torch.rand(4, 6, generator=g) * 1.5 + 0.25),
        noise_sampling=0.2 * torch.randn(4, 6, generator=g),
    )


def with_logps(trainer, inputs, old: bool, sampling: bool = False, nan_at=(0, 0)):
    """Old and reference log-probs = TRL's own current log-probs plus fixed noise (so ratios leave the clip range);
    with `sampling`, vLLM's sampling log-probs = old + noise (a NaN at `nan_at`, a token vLLM could not score; by
    default in the sample of positive advantage, which the off-policy mask keeps anyway) and the importance-sampling
    ratios TRL derives from them (token_truncate at vllm_importance_sampling_clip_max)."""
    inputs = dict(inputs)
    noise_old, noise_ref, noise_sampling = (inputs.pop(f"noise_{name}") for name in ("old", "ref", "sampling"))
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention,
                                                                 inputs["completion_ids"].shape[1])
    if old:
        inputs["old_per_token_logps"] = logps + noise_old
    inputs["ref_per_token_logps"] = logps + noise_ref
    if not (trainer.use_vllm and trainer.vllm_importance_sampling_correction):
        del inputs["importance_sampling_ratio"]   # GRPOTrainer adds it only then (VESPO reads it whenever present)
    if sampling:
        old_logps = inputs.get("old_per_token_logps", logps)
        inputs["sampling_per_token_logps"] = old_logps + noise_sampling
        inputs["sampling_per_token_logps"][nan_at] = float("nan")
        mask = inputs["completion_mask"] * inputs["tool_mask"]
        diff = torch.nan_to_num((old_logps - inputs["sampling_per_token_logps"]) * mask, nan=0.0)
        if trainer.vllm_importance_sampling_correction:
            inputs["importance_sampling_ratio"] = diff.exp().clamp(max=trainer.args.vllm_importance_sampling_clip_max)
    return inputs


def loss_and_grads(trainer, compute_loss, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = compute_loss(trainer, trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def logged(trainer, compute_loss, inputs):
    """(loss, gradients, the metrics this call logged)."""
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode].clear()
    loss, grads = loss_and_grads(trainer, compute_loss, inputs)
    return loss, grads, {k: v[-1] for k, v in trainer._metrics[mode].items()}


def assert_parity(trainer, inputs):
    ours_loss, ours, our_metrics = logged(trainer, ERPOTrainer._compute_loss, inputs)
    trl_loss, theirs, trl_metrics = logged(trainer, trl.GRPOTrainer._compute_loss, inputs)
    assert set(trl_metrics) <= set(our_metrics)          # TRL's own loss metrics, same names and values
    for name, value in trl_metrics.items():
        assert our_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), name
    assert trl_loss.abs() > 1e-4  # a loss that is not trivially zero
    torch.testing.assert_close(ours_loss, trl_loss, rtol=1e-5, atol=0)
    assert ours.keys() == theirs.keys() and len(theirs) == len(list(trainer.model.parameters()))
    for name, grad in theirs.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
    return our_metrics


KL_SETTINGS = {"beta0": dict(beta=0.0), "beta_bias_correction": dict(beta=0.04, use_bias_correction_kl=True),
               "beta_plain": dict(beta=0.04, use_bias_correction_kl=False)}


@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused", "logits"])
@pytest.mark.parametrize("kl", list(KL_SETTINGS))
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_and_gradients_equal_trl(tiny, tmp_path, loss_type, kl, fused_linear):
    """qkl_coef=0, query_weight='none': gradient accumulation 2, num_iterations 2 (old log-probs present)."""
    trainer = make_trainer(tiny, tmp_path, loss_type=loss_type, fused_linear=fused_linear, qkl_coef=0.0,
                           query_weight="none", gradient_accumulation_steps=2, num_iterations=2,
                           **KL_SETTINGS[kl])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    assert_parity(trainer, with_logps(trainer, trl_inputs(trainer), old=True))


@pytest.mark.parametrize("qkl_coef", [0.0, 0.5])
def test_metrics_that_do_not_apply_are_left_out(tiny, tmp_path, qkl_coef):
    """beta 0 (no reference model) and qkl_coef 0 (no ell_theta0 reference): TRL logs no `kl`, and ERPO's `qkl`
    is left out the same way (the loss's qkl is absent), never logged as NaN; with qkl_coef it is logged."""
    trainer = make_trainer(tiny, tmp_path, qkl_coef=qkl_coef, query_weight="none", beta=0.0,
                           gradient_accumulation_steps=2, num_iterations=2)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    _, _, metrics = logged(trainer, ERPOTrainer._compute_loss, with_logps(trainer, trl_inputs(trainer), old=True))
    assert "kl" not in metrics and ("qkl" in metrics) == (qkl_coef != 0)
    assert {"entropy", "query_logp", "clip_ratio/region_mean"} <= set(metrics)
    assert not [name for name, value in metrics.items() if math.isnan(value)]


@pytest.mark.parametrize("case", ["on_policy", "sequence_level", "delta_epsilon_high", "vllm_is", "eval",
                                  "entropy_grpo", "entropy_dapo_beta"])
def test_trl_features_equal_trl(tiny, tmp_path, case):
    """On-policy (no old log-probs), GSPO's sequence-level ratio (with the bias-corrected KL), two-sided clipping
    (delta) with an asymmetric clip range, vLLM's importance-sampling correction, eval mode (no accumulation
    normalizer), and TRL's entropy bonus (a token mean whatever the loss type)."""
    settings = {"on_policy": dict(loss_type="dapo"),
                "sequence_level": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
                "delta_epsilon_high": dict(loss_type="dapo", delta=1.5, epsilon=0.1, epsilon_high=0.28),
                "vllm_is": dict(loss_type="bnpo"),
                "eval": dict(loss_type="grpo"),
                "entropy_grpo": dict(loss_type="grpo", entropy_coef=0.05),
                "entropy_dapo_beta": dict(loss_type="dapo", entropy_coef=0.05, beta=0.04)}[case]
    trainer = make_trainer(tiny, tmp_path, qkl_coef=0.0, query_weight="none", gradient_accumulation_steps=2,
                           **settings)
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.train(case != "eval")
    if case == "vllm_is":  # what GRPOTrainer sets with use_vllm=True (vLLM itself is not needed for the loss)
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    assert_parity(trainer, with_logps(trainer, trl_inputs(trainer), old=case != "on_policy"))


NEW_LOSS_TYPES = {"cispo": dict(loss_type="cispo", epsilon_high=1.0), "sapo": dict(loss_type="sapo"),
                  "vespo": dict(loss_type="vespo"),
                  "luspo": dict(loss_type="luspo", importance_sampling_level="sequence")}


@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused", "logits"])
@pytest.mark.parametrize("kl", ["beta0", "beta_bias_correction"])
@pytest.mark.parametrize("loss_type", list(NEW_LOSS_TYPES))
def test_new_loss_types_equal_trl(tiny, tmp_path, loss_type, kl, fused_linear):
    """TRL 1.16's cispo, sapo, vespo and luspo: loss, every gradient and TRL's metrics (cispo_clip_ratio,
    vespo/phi_seq_mean) equal GRPOTrainer's, gradient accumulation 2, old log-probs present."""
    trainer = make_trainer(tiny, tmp_path, fused_linear=fused_linear, qkl_coef=0.0, query_weight="none",
                           gradient_accumulation_steps=2, num_iterations=2, **NEW_LOSS_TYPES[loss_type],
                           **KL_SETTINGS[kl])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    metrics = assert_parity(trainer, with_logps(trainer, trl_inputs(trainer), old=True))
    if loss_type == "cispo":
        assert 0 < metrics["cispo_clip_ratio"] < 1
    if loss_type == "vespo":
        assert abs(metrics["vespo/phi_seq_mean"] - 1) > 1e-3


@pytest.mark.parametrize("case", ["off_policy_mask", "off_policy_mask_vllm", "off_policy_mask_vllm_on_policy",
                                  "entropy_filter", "vespo_vllm_is", "everything_sapo_eval"])
def test_off_policy_mask_and_entropy_filter_equal_trl(tiny, tmp_path, case):
    """TRL's off-policy sequence mask (against the old log-probs, or vLLM's sampling log-probs), its entropy filter
    with the entropy bonus, VESPO with vLLM's token_truncate importance sampling folded into its sequence weight,
    and all of them at once in eval."""
    settings = {"off_policy_mask": dict(loss_type="dapo", off_policy_mask_threshold=0.02),
                "off_policy_mask_vllm": dict(loss_type="grpo", off_policy_mask_threshold=0.02, beta=0.04),
                "off_policy_mask_vllm_on_policy": dict(loss_type="dapo", off_policy_mask_threshold=0.02),
                "entropy_filter": dict(loss_type="bnpo", top_entropy_quantile=0.4, entropy_coef=0.05),
                "vespo_vllm_is": dict(loss_type="vespo", vllm_importance_sampling_clip_max=1.2),
                "everything_sapo_eval": dict(loss_type="sapo", off_policy_mask_threshold=0.02,
                                             top_entropy_quantile=0.5, entropy_coef=0.05)}[case]
    vllm = case in ("off_policy_mask_vllm", "off_policy_mask_vllm_on_policy", "vespo_vllm_is", "everything_sapo_eval")
    on_policy = case == "off_policy_mask_vllm_on_policy"   # vLLM without the IS correction: no old log-probs
    trainer = make_trainer(tiny, tmp_path, qkl_coef=0.0, query_weight="none", gradient_accumulation_steps=2,
                           **settings)
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.train(case != "everything_sapo_eval")
    if vllm:  # what GRPOTrainer sets with use_vllm=True (vLLM itself is not needed for the loss)
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, not on_policy
    # on-policy: the NaN in a sample of negative advantage, where it counts as zero drift in the mask
    inputs = with_logps(trainer, trl_inputs(trainer), old=not on_policy, sampling=vllm,
                        nan_at=(1, 1) if on_policy else (0, 0))
    assert_parity(trainer, inputs)
    with_option = trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs).item()
    if case == "vespo_vllm_is":   # VESPO without the rollout correction
        inputs = {name: value for name, value in inputs.items() if name != "importance_sampling_ratio"}
    else:
        trainer.__dict__.update(off_policy_mask_threshold=None, top_entropy_quantile=1.0)
    assert abs(trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs).item() - with_option) > 1e-5


def test_adaptive_entropy_equals_trl(tiny, tmp_path):
    """use_adaptive_entropy over 3 optimizer steps of 2 micro-batches (entropy_target above, above, below the
    entropy: the coefficient rises twice, then falls): each micro-batch's loss and gradients, and the coefficient,
    last entropy and window after each one, equal GRPOTrainer's run from the same state."""
    trainer = make_trainer(tiny, tmp_path, loss_type="grpo", qkl_coef=0.0, query_weight="none",
                           gradient_accumulation_steps=2, use_adaptive_entropy=True, entropy_coef=0.05,
                           entropy_coef_delta=0.02, top_entropy_quantile=0.6)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    batches = [with_logps(trainer, trl_inputs(trainer, seed=seed), old=True) for seed in range(6)]
    targets = [10.0, 10.0, 0.1]

    def run(compute_loss):
        trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = 0.05, math.inf, None
        trajectory = []
        for index, inputs in enumerate(batches):
            trainer.args.entropy_target = targets[index // 2]
            trainer.accelerator.gradient_state._set_sync_gradients(index % 2 == 1)
            loss, grads, metrics = logged(trainer, compute_loss, inputs)
            trajectory.append((loss, grads, metrics, trainer.entropy_coef, trainer._last_world_entropy))
        trainer.accelerator.gradient_state._set_sync_gradients(True)
        return trajectory

    ours, theirs = run(ERPOTrainer._compute_loss), run(trl.GRPOTrainer._compute_loss)
    coefs = [step[3] for step in theirs]
    assert coefs == pytest.approx([0.05, 0.07, 0.07, 0.09, 0.09, 0.07])
    for (loss, grads, metrics, coef, last), (trl_loss, trl_grads, trl_metrics, trl_coef, trl_last) in zip(ours, theirs):
        torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=0)
        for name, grad in trl_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item())
        assert coef == pytest.approx(trl_coef, abs=1e-12) and last == pytest.approx(trl_last, rel=1e-5)
        for name, value in trl_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, tiny):
    """A saved tiny Qwen3-MoE (4 experts, 2 per token) at its architecture's default router_aux_loss_coef=0.001."""
    tokenizer = tiny[1]
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert config.router_aux_loss_coef == 0.001 and not config.output_router_logits
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_moe")
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused", "logits"])
def test_moe_router_aux_loss_equals_trl(tiny_moe, tmp_path, fused_linear):
    """An MoE model at its default router_aux_loss_coef is accepted, and the loss includes TRL's load-balancing
    term (coefficient x aux_loss / accumulation): loss, every gradient (the router's included) and the aux_loss
    metric equal GRPOTrainer's."""
    trainer = make_trainer(tiny_moe, tmp_path, loss_type="dapo", qkl_coef=0.0, query_weight="none",
                           fused_linear=fused_linear, gradient_accumulation_steps=2, beta=0.04)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.001
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    metrics = assert_parity(trainer, with_logps(trainer, trl_inputs(trainer), old=True))
    assert metrics["aux_loss"] > 1.0   # the term is really there (about num_experts_per_tok at initialisation)
    trainer.aux_loss_enabled = False   # and it changes the loss
    without = ERPOTrainer._compute_loss(trainer, trainer.model, with_logps(trainer, trl_inputs(trainer), old=True))
    trainer.aux_loss_enabled = True
    with_aux = ERPOTrainer._compute_loss(trainer, trainer.model, with_logps(trainer, trl_inputs(trainer), old=True))
    assert (with_aux - without).item() == pytest.approx(0.001 * metrics["aux_loss"] / 2, rel=1e-4)


@pytest.mark.parametrize("setting, message", [
    (dict(loss_type="ppo"), "loss_type='ppo'"), (dict(query_weight="dynamic"), "query_weight"),
    (dict(qkl_estimator="k3-token"), "k3-token"), (dict(delta=1.1), "delta must be > 1 \\+ epsilon_high"),
    (dict(loss_workspace_mib=0), "^loss_workspace_mib must be an integer >= 1 \\(MiB\\), got 0$"),
    (dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_mask"), "token_mask"),
    (dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_truncate",
          vllm_importance_sampling_clip_min=0.5), "vllm_importance_sampling_clip_min"),
    (dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_truncate",
          vllm_importance_sampling_clip_max=0.9), "vllm_importance_sampling_clip_max < 1")])
def test_unsupported_settings_raise(tmp_path, setting, message):
    with pytest.raises(ValueError, match=message):
        ERPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **setting)


def test_fused_linear_under_fsdp2_with_a_resharded_lm_head_is_refused(tiny, tmp_path):
    """TRL runs the backward after `_compute_loss` returns, so an lm_head FSDP2 reshards after its forward (here its
    own unit, one rank) is refused in one line instead of failing in the backward."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    trainer = make_trainer(tiny, tmp_path, fused_linear=True, qkl_coef=0.0, query_weight="none")
    # An earlier in-process DeepSpeed engine of the suite may have left a one-process default group: use it then.
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        fully_shard(trainer.model.lm_head, reshard_after_forward=True)
        with pytest.raises(ValueError, match="fused_linear=True under FSDP2 needs the lm_head unsharded"):
            ERPOTrainer._compute_loss(trainer, trainer.model, trl_inputs(trainer))
    finally:
        if owns_group:
            dist.destroy_process_group()


def test_trl_options_are_accepted(tmp_path):
    """Every TRL 1.16 loss type and option ERPOTrainer once refused builds a config; delta is only checked
    against epsilon_high for the clipped-surrogate types (TRL ignores it for cispo, sapo and vespo)."""
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo"):
        ERPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, loss_type=loss_type,
                   delta=1.1 if loss_type in ("cispo", "sapo", "vespo") else None)
    ERPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, top_entropy_quantile=0.2,
               off_policy_mask_threshold=0.5, use_adaptive_entropy=True, loss_type="vespo", use_vllm=True,
               vllm_importance_sampling_mode="token_truncate")


def test_grpo_config_is_refused(tiny, tmp_path):
    with pytest.raises(TypeError, match="ERPOConfig"):
        ERPOTrainer(model=tiny[0], reward_funcs=reward_length,
                    args=trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False))


def train_run(tiny, output_dir, max_steps):
    trainer = make_trainer(tiny, output_dir, conversational=True, qkl_coef=0.5, query_weight="static",
                           learning_rate=3e-2, max_steps=max_steps, temperature=1.0)
    trainer.train()
    return trainer, [entry for entry in trainer.state.log_history if "qkl" in entry]


def test_train_logs_qkl_and_reuses_the_reference_cache(tiny, tmp_path):
    trainer, logs = train_run(tiny, tmp_path, max_steps=3)
    assert len(logs) == 3
    assert abs(logs[0]["qkl"]) < 1e-6                    # theta = theta0 at the first step
    assert logs[-1]["qkl"] > 1e-4                        # the model has moved
    assert all(math.isfinite(entry["query_logp"]) and entry["query_weight_mean"] > 0 for entry in logs)
    assert "clip_ratio/region_mean" in logs[0] and "entropy" in logs[0]   # TRL's own metrics still logged

    path = tmp_path / CACHE_FILE
    cache = ReferenceCache.load(str(path))
    ids = trainer._tokenize_prompts([[{"role": "user", "content": p}] for p in PROMPTS])[0]
    assert set(cache.entries) == {prompt_hash(list(p)) for p in ids}
    # A second run with the same model reads the cache instead of rebuilding it: mark an entry and see it back.
    data = json.loads(path.read_text())
    key = prompt_hash(list(ids[0]))
    data["entries"][key][0] = -123.0
    path.write_text(json.dumps(data))
    second = make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5)
    assert second.reference_cache.entries[key][0] == -123.0


@pytest.mark.parametrize("settings, metric", [
    (dict(loss_type="cispo", epsilon_high=1.0, top_entropy_quantile=0.5), "cispo_clip_ratio"),
    (dict(loss_type="vespo", off_policy_mask_threshold=0.1, use_adaptive_entropy=True, entropy_target=10.0,
          save_strategy="steps", save_steps=2), "vespo/phi_seq_mean")], ids=["cispo", "vespo"])
def test_train_with_new_loss_types(tiny, tmp_path, settings, metric):
    """Real train() steps with the new loss types and options: the Query-KL and TRL's metric of the type are
    logged, the parameters move; with use_adaptive_entropy the coefficient is logged each step and saved in the
    checkpoint as GRPOTrainer saves it (entropy_ctrl_state.json)."""
    trainer = make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5, learning_rate=3e-2, max_steps=2,
                           temperature=1.0, **settings)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "qkl" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry[metric]) for entry in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    if settings.get("use_adaptive_entropy"):
        assert [entry["entropy_coef"] for entry in logs] == pytest.approx([0.005, 0.01])   # entropy < target: up
        state = json.loads((tmp_path / "checkpoint-2" / "entropy_ctrl_state.json").read_text())
        assert state["entropy_coef"] == trainer.entropy_coef and state["last_world_entropy"] < 10.0


def test_missing_prompt_is_added_at_theta0_and_refused_after(tiny, tmp_path):
    """A prompt the cache lacks: before the first optimizer step its ell_theta0(q) is the forward's (added, then
    saved at the step); after it, a one-line refusal naming the prompt and its data set."""
    trainer = make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = with_logps(trainer, trl_inputs(trainer), old=False)   # plain-text prompts: not in the cache
    key = prompt_hash(trainer.processing_class("1+1=")["input_ids"])
    trainer.at_theta0 = False
    with pytest.raises(ValueError, match="prompt '1\\+1=' has no ell_theta0.*comes from the train_dataset"):
        trainer._compute_loss(trainer.model, inputs)
    trainer.at_theta0 = True
    trainer._compute_loss(trainer.model, inputs)
    assert key in trainer.reference_cache.entries and key not in ReferenceCache.load(str(tmp_path / CACHE_FILE)).entries
    trainer._leave_theta0()                                        # what the first optimizer step does
    assert ReferenceCache.load(str(tmp_path / CACHE_FILE)).entries[key] == trainer.reference_cache.entries[key]
    assert math.isfinite(trainer._compute_loss(trainer.model, inputs).item())   # from the cache now


def test_reference_lookup_reads_no_prompt_ids_from_the_device(tiny, tmp_path):
    """`_reference_of` looks the micro-batch's ell_theta0(q) and w(q) up by the prompts' token ids as host lists
    (PROMPT_TOKEN_IDS, kept from TRL's `_generate`), not by the device prompt_ids (before 2026-11-26 a boolean index
    and a tolist per sample: 8 reads on 4 samples). Counted by LaunchCounter on the CPU, after theta0: no sync (the
    looked-up values go up from pinned memory without a wait; 2 blocking uploads before 2026-11-26); at theta0 no read
    of the prompts either: it reads the forward's ell_theta(q) once when the cache lacks a prompt, to add it, and not
    at all when it has them all (one read before 2026-11-26). The values are the cache's entries of the device rows,
    bit for bit."""
    trainer = make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5)
    inputs = trl_inputs(trainer)
    device_rows = device_prompt_ids(inputs)
    assert inputs[PROMPT_TOKEN_IDS] == device_rows
    forward_ell = torch.tensor([-3.0, -4.5, -2.25, -6.0], dtype=torch.float64)
    counts = []
    for at_theta0 in (True, False, True):   # at theta0 the cache lacks the prompts, then has them
        trainer.at_theta0 = at_theta0
        with LaunchCounter(device="cpu") as counter:  # the trainer's device
            ell, weight = trainer._reference_of(inputs, "train_dataset", lambda: forward_ell)
        counts.append(dict(counter.sync_names))
        expected = torch.tensor([trainer.reference_cache.entries[prompt_hash(p)] for p in device_rows])
        assert torch.equal(ell, expected[:, 0].float()) and torch.equal(weight, expected[:, 1].float())
    # one tolist: query_weights' checks of the added prompts' ell_theta0, host values the counter takes for device
    # ones (selected by a list index, whose index tensor aten makes unseen); a read of the prompts would be 4
    assert counts[0]["Tensor.cpu"] == 1 and counts[0].get("Tensor.tolist", 0) <= 1 and "aten.index" not in counts[0], \
        counts
    assert counts[1] == {} and counts[2] == {}, counts
    assert torch.equal(ell, forward_ell.float())   # added at theta0, looked up after it
    # a micro-batch without the host lists (a subclass's own _generate_and_score_completions): the device rows are
    # read instead, to the same values
    without = {key: value for key, value in inputs.items() if key != PROMPT_TOKEN_IDS}
    with LaunchCounter(device="cpu") as counter:
        ell_read, weight_read = trainer._reference_of(without, "train_dataset", lambda: forward_ell)
    assert torch.equal(ell_read, ell) and torch.equal(weight_read, weight)
    assert counter.sync_names["Tensor.tolist"] == len(device_rows), dict(counter.sync_names)


@pytest.mark.parametrize("fused_linear, settings", [
    (False, {}), (True, {}), (False, dict(importance_sampling_level="sequence")),
    (False, dict(loss_type="bnpo", top_entropy_quantile=0.4, entropy_coef=0.05)),
    (True, dict(loss_type="bnpo", top_entropy_quantile=0.4, entropy_coef=0.05))],
    ids=["logits", "fused", "logits-sequence", "logits-entropy-filter", "fused-entropy-filter"])
def test_host_reads_per_micro_batch(tiny, tmp_path, fused_linear, settings):
    """One micro-batch's `_compute_loss` and backward after theta0 (grpo with the Policy-KL, the Query-KL and static
    w(q); sequence-level ratios; TRL's entropy filter), counted by LaunchCounter on the CPU: the model forward's read
    (inside transformers: its sdpa mask reads `padding_mask.all()`), the kernels' value checks (validate=True), the
    metrics' one read, and on the fused-linear path the selection of the scored rows (`completion_rows`); no
    blocking upload (ell_theta0 and w go up from pinned memory without a wait, the sequence-level metrics' counts are
    filled on the device); in one process the entropy filter's quantile needs no gather. Before 2026-11-26: 13 reads
    (logits) / 14 (fused), one per metric, and 2 blocking uploads (5 with sequence-level ratios); the entropy
    filter's gather added 4 syncs (logits) / 6 (fused); TRL's own `_compute_loss` reads 12 times on this
    micro-batch."""
    trainer = make_trainer(tiny, tmp_path, **{"qkl_coef": 0.5, "beta": 0.04, "fused_linear": fused_linear,
                                              **settings})
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    trainer.at_theta0 = False
    inputs = with_logps(trainer, trl_inputs(trainer), old=True)
    with LaunchCounter(device="cpu") as counter:  # the trainer's device
        ERPOTrainer._compute_loss(trainer, trainer.model, inputs).backward()
    expected = {"aten._local_scalar_dense": 2, "Tensor.tolist": 1} | ({"Tensor.cpu": 1} if fused_linear else {})
    assert dict(counter.sync_names) == expected, counter.sync_names
    assert {"kl", "qkl", "query_weight_mean", "clip_ratio/low_min", "entropy"} <= trainer._metrics["train"].keys()


def test_clip_ratio_extremes_leave_out_unscored_sequences(tiny, tmp_path):
    """clip_ratio/low_min and high_max over the sequences with scored tokens (TRL drops the NaN of the others), NaN
    when none has any, computed on the device without TRL's boolean index."""
    trainer = make_trainer(tiny, tmp_path)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    ratio = torch.tensor([[0.5, 1.0], [0.1, 0.1], [1.5, 1.0]])
    advantages = torch.tensor([[-1.0], [-1.0], [1.0]])

    def global_mean(values):
        return (values * mask).sum() / mask.sum()

    values = trainer._clip_ratios(mask, ratio, advantages, global_mean)
    assert values["clip_ratio/low_min"].item() == 0.0 and values["clip_ratio/high_max"].item() == 1.0
    values = trainer._clip_ratios(torch.zeros_like(mask), ratio, advantages, global_mean)
    assert values["clip_ratio/low_min"].isnan() and values["clip_ratio/high_max"].isnan()


def test_prompts_added_at_theta0_are_shared_by_every_process(tiny, tmp_path, monkeypatch):
    """Leaving theta0 gathers the entries every process added at theta0 (another rank's, faked here) into this
    process's cache, and the main process saves them all."""
    import erpo.integrations.trl.reference as reference
    trainer = make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5)
    other_rank = {prompt_hash([7, 8, 9]): (-12.5, 1.25)}
    monkeypatch.setattr(reference, "gather_object", lambda objects: objects + [other_rank])
    trainer._theta0_entries = {prompt_hash([4, 5]): (-3.0, 1.5)}
    trainer._leave_theta0()
    saved = ReferenceCache.load(str(tmp_path / CACHE_FILE)).entries
    for key, value in {prompt_hash([4, 5]): (-3.0, 1.5), **other_rank}.items():
        assert trainer.reference_cache.entries[key] == value and tuple(saved[key]) == value
    assert not trainer.at_theta0 and trainer._theta0_entries == {}


@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused", "logits"])
def test_current_query_weight(tiny, tmp_path, fused_linear):
    """query_weight='current': w(q) from the current policy's ell_theta(q) over the micro-batch. Equal prompts give
    w = 1 (TRL's loss exactly); different prompts give other weights (a different loss)."""
    trainer = make_trainer(tiny, tmp_path, loss_type="dapo", qkl_coef=0.0, query_weight="current",
                           fused_linear=fused_linear)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = with_logps(trainer, trl_inputs(trainer), old=True)
    ours = ERPOTrainer._compute_loss(trainer, trainer.model, inputs).item()
    assert abs(ours - trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs).item()) > 1e-4
    same = dict(inputs, prompt_ids=inputs["prompt_ids"][[3, 3, 3, 3]], prompt_mask=inputs["prompt_mask"][[3, 3, 3, 3]],
                erpo_prompt_token_ids=[inputs["erpo_prompt_token_ids"][3]] * 4)
    assert logged(trainer, ERPOTrainer._compute_loss, same)[2]["query_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert_parity(trainer, same)


def test_cache_of_another_model_is_refused(tiny, tmp_path):
    make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5)          # writes the cache for this model
    other = tmp_path / "other"
    tiny_test_model(tiny[1], seed=1).save_pretrained(other)
    with pytest.raises(ValueError, match="does not match this run: model"):
        make_trainer((str(other), tiny[1]), tmp_path, conversational=True, qkl_coef=0.5)


def test_the_same_output_dir_with_another_dataset_or_chat_template_is_refused(tiny, tmp_path):
    """A second run in the same output_dir finds the first run's cache: with a train_dataset that has a prompt more,
    or with another chat template, the constructor raises a ValueError whose one line names the cache file, the
    first missing prompt or what differs, and what to do; never a stale ell_theta0(q)."""
    from erpo.models.tiny import build_tokenizer
    first = make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5)
    path = tmp_path / CACHE_FILE
    added = first._tokenize_prompts([[{"role": "user", "content": "5+5="}]])[0][0]
    with pytest.raises(ValueError) as refused:
        make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5, train_dataset=conversation(["5+5=", *PROMPTS]))
    assert str(refused.value) == (
        f"prompt {tiny[1].decode(list(added))!r} has no ell_theta0(q) in the reference cache {path} (1 of 7 prompts "
        "missing) (the dataset, tokenization or chat template changed since it was built). Delete it to rebuild it, "
        "or set ERPOConfig(ref_cache=...) to another path.")
    other = build_tokenizer()
    other.chat_template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    with pytest.raises(ValueError, match=r"does not match this run: tokenizer: .*\. Delete it to rebuild") as refused:
        make_trainer((tiny[0], other), tmp_path, conversational=True, qkl_coef=0.5)
    assert str(refused.value).startswith(str(path)) and "\n" not in str(refused.value)


def precompute_ref_cache(model_path, run_dir, temperature=1.0, conversational=True):
    """`erpo precompute-ref`'s cache of PROMPTS (data.template=plain), as one user turn through the chat template
    (the token ids of TRL's conversational prompts) or as bare text (those of TRL's plain-text prompts)."""
    from erpo.config import Config, apply_overrides, resolve
    from erpo.reference.setup import precompute_reference
    run_dir.mkdir(parents=True, exist_ok=True)
    source = run_dir / "prompts.jsonl"
    source.write_text("".join(json.dumps({"problem": p, "answer": "0"}) + "\n" for p in PROMPTS))
    cfg = resolve(apply_overrides(Config(), [
        f"output_dir={run_dir}", f"model.name_or_path={model_path}", f"data.source={source}", "data.template=plain",
        f"data.use_chat_template={str(conversational).lower()}", f"rollout.temperature={temperature}"]))
    return precompute_reference(cfg)[1]


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "text"])
def test_precompute_ref_cache_is_used(tiny, tmp_path, conversational):
    """A cache of `erpo precompute-ref` for the same model directory and prompts is read, not rebuilt; one at
    another temperature or of another model is refused. The tokenizer is loaded from the model directory, as erpo
    does (transformers then gives the Qwen2 tokenizer, whose pre-tokenizer differs from erpo.models.tiny's in
    memory)."""
    from erpo.models.loading import load_tokenizer
    path = precompute_ref_cache(tiny[0], tmp_path / "pre", conversational=conversational)
    tiny = (tiny[0], load_tokenizer(tiny[0]))
    data = json.loads(open(path).read())
    key = next(iter(data["entries"]))
    data["entries"][key][0] = -123.0          # a marker: a rebuilt cache would not hold it
    open(path, "w").write(json.dumps(data))
    trainer = make_trainer(tiny, tmp_path / "run", conversational=conversational, qkl_coef=0.5, ref_cache=path)
    assert trainer.reference_cache.entries[key][0] == -123.0
    with pytest.raises(ValueError, match="does not match this run: temperature"):
        make_trainer(tiny, tmp_path / "run", conversational=conversational, qkl_coef=0.5, ref_cache=path,
                     temperature=0.7)
    with pytest.raises(ValueError, match="has no ell_theta0"):   # the other rendering's token ids
        make_trainer(tiny, tmp_path / "run", conversational=not conversational, qkl_coef=0.5, ref_cache=path)

    other = tmp_path / "other"
    save_tiny_model(other, tiny[1], seed=1)
    other_cache = precompute_ref_cache(str(other), tmp_path / "pre-other", conversational=conversational)
    with pytest.raises(ValueError, match="does not match this run: model"):
        make_trainer(tiny, tmp_path / "run", conversational=conversational, qkl_coef=0.5, ref_cache=other_cache)


def test_a_cache_of_more_prompts_gives_the_training_sets_weights(tiny, tmp_path):
    """A `ref_cache` built for six prompts (another run's, or `erpo precompute-ref`'s on a larger data set) serves a
    train_dataset of three of them with appendix C's weights over those three, not the stored ones."""
    path = str(tmp_path / "cache.json")
    stored = make_trainer(tiny, tmp_path / "all", ref_cache=path).reference_cache.entries
    subset = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS[:3]])
    trainer = make_trainer(tiny, tmp_path / "subset", ref_cache=path, train_dataset=subset)
    keys = [prompt_hash(ids) for ids in trainer._prompt_ids(subset)]
    ell = torch.tensor([stored[k][0] for k in keys], dtype=torch.float64)
    weights = torch.tensor([trainer.reference_cache.entries[k][1] for k in keys])
    torch.testing.assert_close(weights, query_weights(ell))
    assert (weights - torch.tensor([stored[k][1] for k in keys])).abs().max() > 0.01


def test_evaluate_with_the_query_kl(tiny, tmp_path):
    """Eval prompts (TRL's dict of eval datasets) get ell_theta0(q) at start, in the same cache, with the training
    prompts' entries unchanged and w(q) scaled by the training prompts' mean surprisal; evaluation then runs the
    ERPO loss on them (before training: those cached values, Query-KL 0; during train(): a Query-KL > 0)."""
    plain = make_trainer(tiny, tmp_path / "train-only", conversational=True, qkl_coef=0.5)
    held_out = ["5+5=", "8*2="]
    eval_rows = {"a": datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in held_out]),
                 "b": datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": PROMPTS[0]}]}])}
    path, tokenizer = tiny
    args = ERPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, per_device_eval_batch_size=2,
                      num_generations=2, max_completion_length=6, report_to=[], use_cpu=True, save_strategy="no",
                      seed=0, bf16=False, qkl_coef=0.5, query_weight="static", learning_rate=3e-2, max_steps=2,
                      eval_strategy="steps", eval_steps=1, logging_steps=1)
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS]
    trainer = ERPOTrainer(model=path, reward_funcs=reward_length, args=args,
                          train_dataset=datasets.Dataset.from_list(rows), eval_dataset=eval_rows,
                          processing_class=tokenizer)
    entries = trainer.reference_cache.entries
    assert len(entries) == len(PROMPTS) + 2
    assert {k: v for k, v in entries.items() if k in plain.reference_cache.entries} == plain.reference_cache.entries
    assert set(ReferenceCache.load(str(tmp_path / "run" / CACHE_FILE)).entries) == set(entries)   # saved
    ids = trainer._tokenize_prompts([[{"role": "user", "content": p}] for p in held_out])[0]
    ell, w = torch.tensor([entries[prompt_hash(list(p))] for p in ids], dtype=torch.float64).unbind(1)
    train_surprisal = -torch.tensor([v[0] for v in plain.reference_cache.entries.values()], dtype=torch.float64)
    torch.testing.assert_close(w, (train_surprisal.mean() / -ell).clamp(0, 2))

    trainer.evaluate(eval_rows["a"], metric_key_prefix="eval_a")
    logs = trainer.state.log_history[-1]
    assert logs["eval_query_logp"] == pytest.approx(ell.mean().item(), rel=1e-5)
    assert logs["eval_query_weight_mean"] == pytest.approx(w.mean().item(), rel=1e-5)
    assert abs(logs["eval_qkl"]) < 1e-6 and math.isfinite(logs["eval_a_loss"])
    trainer.train()
    evaluated = [entry for entry in trainer.state.log_history[1:] if "eval_qkl" in entry]
    assert {"eval_a_loss", "eval_b_loss"} <= {key for entry in evaluated for key in entry}
    assert evaluated[-1]["eval_qkl"] > 1e-6


def conversation(prompts):
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])


def test_iterable_datasets_are_read_at_construction(tiny, tmp_path):
    """IterableDataset train and eval sets: their first `iterable_prompts` rows get ell_theta0(q) at construction
    (read once); train() and evaluation then run the ERPO loss on them."""
    held_out = ["5+5=", "8*2=", "6-1="]
    bounded = make_trainer(tiny, tmp_path / "bounded", conversational=True, qkl_coef=0.5, iterable_prompts=2,
                           max_steps=1,
                           train_dataset=conversation(PROMPTS).to_iterable_dataset(),
                           eval_dataset={"a": conversation(held_out).to_iterable_dataset()})
    ids = bounded._tokenize_prompts([[{"role": "user", "content": p}] for p in PROMPTS[:2] + held_out[:2]])[0]
    assert set(bounded.reference_cache.entries) == {prompt_hash(list(p)) for p in ids}
    trainer = make_trainer(tiny, tmp_path / "run", conversational=True, qkl_coef=0.5, learning_rate=3e-2,
                           max_steps=2, eval_strategy="steps", eval_steps=2,
                           train_dataset=conversation(PROMPTS).to_iterable_dataset(),
                           eval_dataset=conversation(held_out).to_iterable_dataset())
    assert len(trainer.reference_cache.entries) == len(PROMPTS) + len(held_out)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "qkl" in entry or "eval_qkl" in entry]
    assert [entry.get("qkl", entry.get("eval_qkl")) > 1e-6 for entry in logs] == [False, True, True]


def test_evaluate_a_new_dataset(tiny, tmp_path):
    """evaluate(eval_dataset=...) with a data set the trainer was not given: at theta0 its prompts' ell_theta0(q)
    come from the evaluation's forward (Query-KL 0), are added to the cache and saved; after an optimizer step a
    new data set is refused in one line naming it."""
    trainer = make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5, learning_rate=3e-2, max_steps=1)
    trainer.evaluate(eval_dataset=conversation(["5+5=", "8*2="]))
    assert abs(trainer.state.log_history[-1]["eval_qkl"]) < 1e-6
    ids = trainer._tokenize_prompts([[{"role": "user", "content": p}] for p in ["5+5=", "8*2="]])[0]
    saved = ReferenceCache.load(str(tmp_path / CACHE_FILE)).entries
    assert {prompt_hash(list(p)) for p in ids} <= set(saved) and len(saved) == len(PROMPTS) + 2
    trainer.train()
    trainer.evaluate(eval_dataset=conversation(["5+5=", "8*2="]))          # cached: fine
    assert trainer.state.log_history[-1]["eval_qkl"] > 1e-6
    with pytest.raises(ValueError, match="prompt .*6-1=.* has no ell_theta0.*comes from the eval dataset"):
        trainer.evaluate(eval_dataset=conversation(["6-1="]))


def rollout_run(tiny, tmp_path, tokenizer, **trainer_kwargs):
    """An ERPOTrainer at ERPOConfig's defaults (Query-KL 0.01, static w(q)) with `trainer_kwargs` (a rollout_func
    or an environment_factory), trained 3 steps, the prompt token ids of each generation recorded, and the inputs of
    each micro-batch's loss (`trainer.micro_batches`)."""
    args = ERPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
                      seed=0, bf16=False, learning_rate=3e-2, max_steps=3, temperature=1.0)
    trainer = ERPOTrainer(model=tiny[0], reward_funcs=reward_length, args=args, processing_class=tokenizer,
                          train_dataset=conversation(PROMPTS), **trainer_kwargs)
    generated, generate = [], trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: generated.append(output := generate(inputs)) or output
    trainer.micro_batches, compute_loss = [], trainer._compute_loss
    trainer._compute_loss = lambda model, inputs: trainer.micro_batches.append(inputs) or compute_loss(model, inputs)
    trainer.train()
    prompt_ids = [device_prompt_ids(out) for out in generated]
    assert [out[PROMPT_TOKEN_IDS] for out in generated] == prompt_ids   # the host lists the lookups take
    return trainer, prompt_ids


def assert_scored_at_theta0(trainer, tiny, rewritten):
    """The Query-KL is 0 at the first step and > 0 after it; every rewritten prompt's cached ell_theta0(q) equals
    the untrained model's (exactly) and differs from the trained one's; its w(q) is the held-out weight against the
    data set's mean surprisal."""
    qkl = [entry["qkl"] for entry in trainer.state.log_history if "qkl" in entry]
    assert qkl[0] == 0.0 and all(value > 1e-6 for value in qkl[1:]) and len(qkl) == 3
    untrained = transformers.AutoModelForCausalLM.from_pretrained(tiny[0])
    cache = trainer.reference_cache
    if not hasattr(trainer.model, "peft_config"):   # (a PEFT model's fingerprint also holds its adapters)
        assert weights_fingerprint(untrained) == cache.model_fingerprint
    expected = trainer._held_out_entries(cache, rewritten, untrained)
    assert {key: cache.entries[key] for key in expected} == expected
    moved = trainer._held_out_entries(cache, rewritten, trainer.model)
    assert all(abs(moved[key][0] - value[0]) > 1e-4 for key, value in expected.items())
    ell = torch.tensor([value[0] for value in expected.values()], dtype=torch.float64)
    assert [value[1] for value in expected.values()] == \
        (trainer._train_surprisal / -ell).clamp(0, 2).float().tolist()   # fp32, as the training prompts' w(q)
    assert ReferenceCache.load(str(trainer.reference_cache_path)).entries.keys() >= expected.keys()


def test_rollout_func_prompts_are_scored_by_a_frozen_theta0(tiny, tmp_path):
    """A rollout_func that rewrites its prompts differently at each call, with ERPO's defaults: the prompts the
    cache lacks are scored with a frozen copy of theta0, also after the model moved."""
    tokenizer = tiny[1]
    calls = []

    def rollout_func(prompts, trainer):
        calls.append(len(calls))
        rewritten = [prompt[:-1] + [{**prompt[-1], "content": f"{prompt[-1]['content']} #{len(calls)}"}]
                     for prompt in prompts]
        prompt_ids = tokenizer.apply_chat_template(rewritten, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
        g = torch.Generator().manual_seed(len(calls))
        completions = [torch.randint(3, len(tokenizer), (1 + i % 6,), generator=g).tolist()   # rewards differ
                       for i in range(len(prompts))]
        return {"prompt_ids": [list(ids) for ids in prompt_ids], "completion_ids": completions, "logprobs": None}

    trainer, generated = rollout_run(tiny, tmp_path, tokenizer, rollout_func=rollout_func)
    assert len(calls) == 3 and isinstance(trainer._theta0(), contextlib.AbstractContextManager)
    rewritten = [ids for step in generated for ids in step]
    assert all(prompt_hash(ids) not in trainer._theta0_entries for ids in rewritten)
    assert_scored_at_theta0(trainer, tiny, rewritten)


class CountingEnvironment:
    """An environment whose reset() appends an observation that changes at every reset (new prompts each step)."""

    def reset(self, **kwargs) -> str:
        self.resets = getattr(self, "resets", 0) + 1
        return f" (attempt {self.resets})"

    def echo(self, text: str) -> str:
        """
        Echo the text back.

        Args:
            text: The text to echo.

        Returns:
            The same text.
        """
        return text


def tool_tokenizer(tiny):
    """The tiny tokenizer with a chat template TRL can call tools with (Qwen2.5's)."""
    tokenizer = copy.deepcopy(tiny[1])
    tokenizer.chat_template = (importlib.resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    return tokenizer


def test_environment_prompts_are_scored_by_a_frozen_theta0(tiny, tmp_path):
    """An environment_factory whose reset() rewrites the prompts, with ERPO's defaults: its rewritten prompts get
    ell_theta0(q) from the frozen copy of theta0, equal to the untrained model's; the data set's prompts (rendered
    with the environment's tools, before reset) define the mean surprisal of the static w(q)."""
    tokenizer = tool_tokenizer(tiny)
    trainer, generated = rollout_run(tiny, tmp_path, tokenizer, environment_factory=CountingEnvironment)
    rewritten = [ids for step in generated for ids in step]
    texts = [tokenizer.decode(ids) for ids in rewritten]
    assert all("(attempt " in text and '"echo"' in text for text in texts)
    assert {text.split("(attempt ")[1][0] for text in texts} == {"1", "2", "3"}
    assert_scored_at_theta0(trainer, tiny, rewritten)


def test_environment_rows_the_factory_lacks_are_left_to_trl(tiny, tmp_path):
    """Rows naming an environment the factory lacks have no prompt to score at construction; with only such rows
    the cache starts empty and TRL refuses the first one drawn, as with GRPOTrainer."""
    args = ERPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, report_to=[], use_cpu=True, bf16=False, max_steps=1)
    trainer = ERPOTrainer(model=tiny[0], reward_funcs=reward_length, args=args, processing_class=tool_tokenizer(tiny),
                          train_dataset=datasets.Dataset.from_dict({"environment": ["unknown"] * 4}),
                          environment_factory={"counting": CountingEnvironment})
    assert trainer.reference_cache.entries == {}
    with pytest.raises(ValueError, match="not among the environments"):
        trainer.train()


def test_lora_rollout_prompts_are_scored_with_adapters_disabled(tiny, tmp_path):
    """A LoRA adapter the trainer adds (peft_config) starts at theta0: the rollout's prompts are scored with the
    adapters disabled, no copy of the model, equal to the untrained model's."""
    peft = pytest.importorskip("peft", exc_type=ModuleNotFoundError)
    tokenizer = tool_tokenizer(tiny)
    trainer, generated = rollout_run(tiny, tmp_path, tokenizer, environment_factory=CountingEnvironment,
                                     peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with trainer._theta0() as model:
        assert model is trainer.model and all(layer.disable_adapters for layer in model.modules()
                                              if isinstance(layer, peft.tuners.lora.LoraLayer))
    assert_scored_at_theta0(trainer, tiny, [ids for step in generated for ids in step])


def test_cache_of_another_precision_is_refused(tiny, tmp_path):
    """The cache records the training forward's precision (bf16 autocast here, GRPOConfig's default) and a run
    in another precision refuses it, naming both."""
    trainer = make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5, bf16=True)
    assert "autocast=bfloat16,path=fused-linear" in trainer.reference_cache.precision
    with pytest.raises(ValueError, match="precision: cache built with .*autocast=bfloat16.*autocast=off"):
        make_trainer(tiny, tmp_path, conversational=True, qkl_coef=0.5, bf16=False)


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory, tiny):
    """(path, tokenizer) of a tiny Gemma-2 with final_logit_softcapping=2.0 and its logits scaled up (the cap bites)."""
    tokenizer = tiny[1]
    config = transformers.Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       final_logit_softcapping=2.0, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    path = tmp_path_factory.mktemp("gemma2")
    model.save_pretrained(path)
    return str(path), tokenizer


@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused", "logits"])
def test_cached_query_kl_is_zero_past_theta0_with_the_cap_and_a_temperature(tiny_gemma2, tmp_path, fused_linear):
    """The cache of a soft-capped Gemma-2 at temperature 0.7 holds ell_theta0(q) as the loss scores ell_theta(q)
    (cap, then / T, on either path): read from the cache (theta0 left, weights unchanged, eager attention in fp32)
    the Query-KL and its gradient are exactly 0. A cache at T = 1, or without the cap, is off by far more."""
    trainer = make_trainer(tiny_gemma2, tmp_path, qkl_coef=1.0, query_weight="none", beta=0.0, temperature=0.7,
                           fused_linear=fused_linear, model_init_kwargs={"attn_implementation": "eager"})
    trainer.current_gradient_accumulation_steps, trainer.at_theta0 = 1, False
    trainer.model.train()
    loss, grads = loss_and_grads(trainer, ERPOTrainer._compute_loss, masked_completions(trainer))
    assert loss.item() == 0.0 and grads and all(g.abs().max().item() == 0.0 for g in grads.values())


@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused", "logits"])
def test_gemma2_softcap_equals_trl(tiny_gemma2, tmp_path, fused_linear):
    """A Gemma-2 with final_logit_softcapping is no longer refused with fused_linear=True: both paths give TRL's loss
    and gradients on the model's own (capped) logits."""
    trainer = make_trainer(tiny_gemma2, tmp_path / "run", loss_type="dapo", fused_linear=fused_linear,
                           qkl_coef=0.0, query_weight="none", beta=0.04)
    assert trainer._logit_options == ({"logit_scale": 1.0, "logit_softcap": 2.0} if fused_linear else {})
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    assert_parity(trainer, with_logps(trainer, trl_inputs(trainer), old=True))


@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused", "logits"])
def test_vllm_unscored_tokens_take_the_capped_log_prob(tiny_gemma2, tmp_path, fused_linear, monkeypatch):
    """A token vLLM could not score (NaN sampling log-prob, on-policy) takes the current log-prob as the loss
    scores it, with the model's soft-cap: TRL's own log-prob of that token."""
    import erpo.integrations.trl.scorer as scorer_module
    import erpo.integrations.trl.trainer as trainer_module
    trainer = make_trainer(tiny_gemma2, tmp_path, loss_type="dapo", fused_linear=fused_linear, qkl_coef=0.0,
                           query_weight="none", off_policy_mask_threshold=0.02)
    trainer.current_gradient_accumulation_steps = 1
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, False
    inputs = with_logps(trainer, trl_inputs(trainer), old=False, sampling=True, nan_at=(1, 1))
    loss_name = "fused_linear_erpo_loss" if fused_linear else "erpo_loss"
    seen = {}
    loss = getattr(scorer_module, loss_name)
    monkeypatch.setattr(scorer_module, loss_name, lambda *args, **kwargs: seen.update(kwargs) or loss(*args, **kwargs))
    trainer._compute_loss(trainer.model, inputs)
    rows = trainer_module.completion_rows(inputs, every_position=not fused_linear)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].shape[1])[0]
    refilled = rows.loss_rows.gather(seen["rollout_logp"])[1, 1]
    assert refilled.item() == pytest.approx(logps[1, 1].item(), abs=1e-5)


@pytest.mark.parametrize("unscored", [True, False], ids=["unscored-token", "all-scored"])
@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused", "logits"])
def test_unscored_tokens_are_known_without_a_host_read(tiny, tmp_path, fused_linear, unscored):
    """On-policy with vLLM's sampling log-probs (the off-policy mask): UNSCORED_SAMPLES, the host flags kept from
    TRL's `_generate`, tells `_fill_unscored` whether the micro-batch has a token vLLM could not score, where it read
    rollout_logp's NaN on the host before 2026-11-26 (still so without the flags): one host read fewer a
    micro-batch (LaunchCounter on the CPU), the same loss, gradients and metrics bit for bit."""
    trainer = make_trainer(tiny, tmp_path, loss_type="dapo", fused_linear=fused_linear, qkl_coef=0.0,
                           query_weight="none", off_policy_mask_threshold=0.02)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, False
    inputs = with_logps(trainer, trl_inputs(trainer), old=False, sampling=True, nan_at=(1, 1))
    if not unscored:
        inputs["sampling_per_token_logps"] = inputs["sampling_per_token_logps"].nan_to_num(nan=-1.0)
    samples = inputs["advantages"].shape[0]
    flagged = dict(inputs, **{UNSCORED_SAMPLES: [unscored and i == 1 for i in range(samples)]})
    results, reads = [], []
    for given in (inputs, flagged):
        with LaunchCounter(device="cpu") as counter:
            results.append(logged(trainer, ERPOTrainer._compute_loss, given))
        reads.append(counter.syncs)
    (loss, grads, metrics), (flagged_loss, flagged_grads, flagged_metrics) = results
    assert torch.equal(loss, flagged_loss) and metrics == flagged_metrics
    assert grads.keys() == flagged_grads.keys() and all(torch.equal(grads[n], flagged_grads[n]) for n in grads)
    assert reads[1] == reads[0] - 1, reads


def test_generated_unscored_flags_follow_the_sampling_log_probs(tiny, tmp_path):
    """The flags each micro-batch's inputs hold under UNSCORED_SAMPLES (from the host lists of `_generate`, a None
    where vLLM could not score a token), after TRL's shuffle and split, are its sampling log-probs' NaN per sample."""
    tokenizer = tiny[1]

    def rollout_func(prompts, trainer):
        prompt_ids = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
        completions = [[5 + i % 7] * (1 + i % 4) for i in range(len(prompts))]
        logprobs = [[None if (i % 3 == 0 and t == len(ids) - 1) else -0.5 for t in range(len(ids))]
                    for i, ids in enumerate(completions)]
        return {"prompt_ids": [list(ids) for ids in prompt_ids], "completion_ids": completions, "logprobs": logprobs}

    trainer, _ = rollout_run(tiny, tmp_path, tokenizer, rollout_func=rollout_func)
    assert any(any(inputs[UNSCORED_SAMPLES]) for inputs in trainer.micro_batches)
    assert not all(all(inputs[UNSCORED_SAMPLES]) for inputs in trainer.micro_batches)
    for inputs in trainer.micro_batches:
        assert inputs[UNSCORED_SAMPLES] == inputs["sampling_per_token_logps"].isnan().any(1).tolist()


def test_unknown_logit_transform_is_refused(tiny, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny[0])
    model.config.lm_head_temperature = 3.0
    with pytest.raises(ValueError, match="lm_head_temperature"):
        ERPOTrainer(model=model, reward_funcs=reward_length, processing_class=tiny[1],
                    args=ERPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[]),
                    train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]))


def test_absolute_position_model_is_refused(tiny, tmp_path):
    """TRL's forward gives a left-padded prompt positions counted from its padding. A GPT-2 (learned absolute
    positions) then scores a prompt by its padding: with the weights unchanged and theta0 left, the Query-KL of
    `masked_completions` (one pad token on two prompts) was 0.016 with gradient entries up to 0.37, silently. It
    is refused when the loss reads ell_theta0(q), and trains without it (qkl_coef=0, query_weight='none')."""
    tokenizer = tiny[1]
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=1, n_head=2,
                                     pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                     eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    gpt2 = (str(tmp_path / "gpt2"), tokenizer)
    with pytest.raises(ValueError, match="GPT2LMHeadModel adds absolute position embeddings.*qkl_coef=0"):
        make_trainer(gpt2, tmp_path / "erpo")
    assert make_trainer(gpt2, tmp_path / "grpo", qkl_coef=0.0, query_weight="none").reference_cache is None


def test_dropout_is_refused_with_the_query_kl_unless_disabled(tiny, tmp_path):
    """A model whose config keeps dropout (here attention_dropout, which HF attention applies itself in train mode,
    out of reach of TRL's nn.Dropout switch) scores a noisy ell_theta(q) against the cache's, scored without it:
    refused with the Query-KL. disable_dropout=True switches every dropout off (erpo's disable_dropout too), and the
    cached Query-KL past theta0 is then exactly 0."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny[0])
    model.config.attention_dropout = 0.3
    model.save_pretrained(tmp_path / "dropout")
    noisy = (str(tmp_path / "dropout"), tiny[1])
    eager = {"attn_implementation": "eager"}
    with pytest.raises(ValueError, match=r"trains with dropout \(attention_dropout=0.3\).*disable_dropout=True"):
        make_trainer(noisy, tmp_path / "on", disable_dropout=False, model_init_kwargs=eager)
    trainer = make_trainer(noisy, tmp_path / "off", qkl_coef=1.0, query_weight="none", beta=0.0,
                           model_init_kwargs=eager)   # make_trainer's disable_dropout=True
    trainer.current_gradient_accumulation_steps, trainer.at_theta0 = 1, False
    trainer.model.train()
    loss, grads = loss_and_grads(trainer, ERPOTrainer._compute_loss, masked_completions(trainer))
    assert loss.item() == 0.0 and all(g.abs().max().item() == 0.0 for g in grads.values())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused", "logits"])
def test_query_kl_is_exactly_zero_at_theta0(tiny, tmp_path, bf16, fused_linear, attention):
    """At theta0, with every completion masked (as mask_truncated_completions leaves them) and prompts of different
    lengths, the loss (the Query-KL alone) and its gradient are exactly 0: ell_theta0(q) is the forward's own until
    the first optimizer step, whatever the attention kernel and precision. The cached ell_theta0 is scored as the
    training forward (autocast, path): with eager attention it gives exactly 0 too (sdpa's CPU kernel depends on
    the key length in bf16, docs)."""
    trainer = theta0_trainer(tiny, tmp_path, bf16=bf16, fused_linear=fused_linear, attention=attention)
    assert ("autocast=bfloat16" if bf16 else "autocast=off") in trainer.reference_cache.precision
    inputs = masked_completions(trainer)
    for at_theta0 in [True] + ([False] if attention == "eager" else []):
        trainer.at_theta0 = at_theta0
        loss, grads = loss_and_grads(trainer, ERPOTrainer._compute_loss, inputs)
        assert loss.item() == 0.0
        assert grads and all(g.abs().max().item() == 0.0 for g in grads.values())


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_query_kl_is_alpha_times_the_mean_over_the_steps_samples(tiny, tmp_path, loss_type):
    """The paper's alpha * mean_s k3(r_s) over the optimizer step's samples, whatever TRL's loss_type normalizes the
    policy term by: a micro-batch of 4 samples under gradient accumulation 2 contributes alpha * sum k3 / 8. The
    cache's ell_theta0(q) is the forward's own (eager, fp32: bit for bit, as above) plus a known r per prompt."""
    trainer = make_trainer(tiny, tmp_path, loss_type=loss_type, qkl_coef=0.3, query_weight="none", beta=0.0,
                           gradient_accumulation_steps=2, model_init_kwargs={"attn_implementation": "eager"})
    trainer.current_gradient_accumulation_steps, trainer.at_theta0 = 2, False
    trainer.model.train()
    inputs = masked_completions(trainer)
    drift = torch.tensor([0.5, -1.0, 1.5, -0.3], dtype=torch.float64)
    for ids, r in zip(inputs[PROMPT_TOKEN_IDS], drift):
        ell, weight = trainer.reference_cache.entries[prompt_hash(ids)]
        trainer.reference_cache.entries[prompt_hash(ids)] = (ell + float(r), weight)
    loss, _ = loss_and_grads(trainer, ERPOTrainer._compute_loss, inputs)
    expected = 0.3 * (drift.exp() - drift - 1).sum() / (4 * 2)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


def theta0_trainer(tiny, tmp_path, *, bf16=False, fused_linear=False, attention="eager"):
    """A trainer whose loss is the Query-KL alone (qkl_coef=1, w = 1, beta = 0), in training mode, at theta0."""
    trainer = make_trainer(tiny, tmp_path, qkl_coef=1.0, query_weight="none", beta=0.0, bf16=bf16,
                           fused_linear=fused_linear, model_init_kwargs={"attn_implementation": attention})
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def masked_completions(trainer, width=30):
    """`trl_inputs` with every completion masked (as mask_truncated_completions leaves them), `width` tokens long:
    only the prompts are scored. At 30, sdpa's bf16 prompt log-probs differ from the cache's."""
    inputs = {k: v for k, v in trl_inputs(trainer).items() if not k.startswith("noise")}
    vocab = len(trainer.processing_class)
    inputs["completion_ids"] = torch.randint(3, vocab, (4, width), generator=torch.Generator().manual_seed(0))
    inputs["completion_mask"], inputs["tool_mask"] = torch.zeros((4, width), dtype=torch.long), torch.ones((4, width))
    return inputs


def on_the_triton_path(monkeypatch):
    """backend="auto" picks the Triton kernels on CPU tensors too (the interpreter, standing in for CUDA), where the
    per-sample sums' order follows the rows' positions."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU)")
    resolve = api.resolve_backend
    monkeypatch.setattr(api, "resolve_backend",
                        lambda backend, device: resolve("triton" if backend == "auto" else backend, device))


def test_query_kl_is_exactly_zero_at_theta0_on_the_triton_path(tiny, tmp_path, monkeypatch):
    """The logits path on the Triton kernels: the loss sums every position's row (kind 0 where nothing is scored),
    and ell_theta0(q) at theta0, the forward's own, is summed over the same rows in the same order, so the loss and
    its gradient are exactly 0 there too."""
    on_the_triton_path(monkeypatch)
    trainer = theta0_trainer(tiny, tmp_path)
    loss, grads = loss_and_grads(trainer, ERPOTrainer._compute_loss, masked_completions(trainer))
    assert loss.item() == 0.0
    assert grads and all(g.abs().max().item() == 0.0 for g in grads.values())


def test_logits_path_scores_every_position_without_a_selection(tiny, tmp_path):
    """fused_linear=False scores every position of TRL's [B, T] batch (kind 0 where nothing is scored): the model's
    logits are the rows as it returns them (a view, no [R, V] copy), and the forward, the log-probs and the loss's
    fwd+bwd select nothing (no nonzero, no boolean-mask index: each a host read on CUDA; the reads left are the
    value checks' and the model's own). The scored rows' log-probs are, bit for bit, those of the scored rows
    alone."""
    trainer = make_trainer(tiny, tmp_path, fused_linear=False)
    trainer.current_gradient_accumulation_steps = 1
    inputs = with_logps(trainer, trl_inputs(trainer), old=True)
    rows = completion_rows(inputs, every_position=True)
    options, tensors = trainer._loss_options(inputs, rows, "train")
    with LaunchCounter(device="cpu") as counter:  # the trainer's device
        scorer = LogitsScorer(trainer.model, rows.batch, temperature=trainer.temperature,
                              autocast=contextlib.nullcontext, logit_options={})
        assert scorer.logits.data_ptr() == scorer.output.logits.data_ptr()
        with scorer.head():
            logp = scorer.logprobs()
            scorer.loss(advantages=inputs["advantages"], ref_query_logp=torch.full((4,), -10.0), **tensors,
                        **options).loss.backward()
    assert not {"aten.index", "aten.index_put_", "aten.nonzero"} & set(counter.sync_names), counter.sync_names
    scored = rows.layout.rows
    alone = token_logprobs(scorer.logits.detach()[scored], rows.layout.targets[scored], temperature=trainer.temperature)
    assert torch.equal(logp[scored], alone) and not logp[~scored].any()


def test_fused_linear_path_reads_the_layout_once(tiny, tmp_path):
    """fused_linear=True: the selection of the scored rows (`completion_rows`: `CompletionLayout.scored()`) reads
    token_kind on the host once, and the loss's chunk plan takes that read's host layout (`PackedBatch.host_layout`)
    instead of reading the rows again. Counted by LaunchCounter on the CPU over the rows, the forward and the loss's
    fwd+bwd: the selection's read, the model forward's (inside transformers) and the value checks' (validate=True),
    which also check the host layout against the rows; without the host layout the plan reads once more, and the
    loss and its gradient are the same bit for bit."""
    trainer = make_trainer(tiny, tmp_path, fused_linear=True)
    trainer.current_gradient_accumulation_steps = 1
    inputs = with_logps(trainer, trl_inputs(trainer), old=True)
    results = []
    for keep_layout in (True, False):
        trainer.model.zero_grad()
        with LaunchCounter(device="cpu") as counter:  # the trainer's device
            rows = completion_rows(inputs, every_position=False)
            batch = rows.batch if keep_layout else dataclasses.replace(rows.batch, host_layout=None)
            options, tensors = trainer._loss_options(inputs, rows, "train")
            scorer = FusedLinearScorer(trainer.model, batch, temperature=trainer.temperature,
                                       autocast=contextlib.nullcontext, logit_options={},
                                       workspace_bytes=trainer.args.loss_workspace_mib << 20)
            with scorer.head():
                loss = scorer.loss(advantages=inputs["advantages"], ref_query_logp=torch.full((4,), -10.0),
                                   **tensors, **options).loss
                loss.backward()
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
        results.append((dict(counter.sync_names), loss.detach(), grads))
    (reads, loss, grads), (reads_without, loss_without, grads_without) = results
    assert reads == {"Tensor.cpu": 1, "aten._local_scalar_dense": 2}, reads
    assert reads_without == {"Tensor.cpu": 2, "aten._local_scalar_dense": 2}, reads_without
    assert torch.equal(loss, loss_without) and grads and len(grads) == len(grads_without)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_without))


def test_loss_workspace_reaches_the_fused_loss(tiny, tmp_path, monkeypatch):
    """ERPOConfig.loss_workspace_mib is the fused loss's workspace_bytes (MiB -> bytes)."""
    budgets, loss = [], scorer_module.fused_linear_erpo_loss

    def recording(*args, **kwargs):
        budgets.append(kwargs["workspace_bytes"])
        return loss(*args, **kwargs)
    monkeypatch.setattr(scorer_module, "fused_linear_erpo_loss", recording)
    trainer = make_trainer(tiny, tmp_path, fused_linear=True, loss_workspace_mib=3)
    ERPOTrainer._compute_loss(trainer, trainer.model, with_logps(trainer, trl_inputs(trainer), old=True))
    assert budgets == [3 << 20]


def test_fused_linear_logprobs_of_one_kind_select_without_a_read(tiny, tmp_path):
    """FusedLinearScorer.logprobs(kind) (query_weight="current" scores the query rows alone) finds the rows of that
    kind in the batch's host layout (`completion_rows`' read) and uploads their positions without a wait: the one
    host read left is fused_linear_token_logprobs' range check of the targets (validate=True), where the boolean
    indexes it replaced read the mask twice more (hidden's and targets'). The log-probs are, bit for bit, those of
    the rows of that kind selected by their mask, 0 on the other rows."""
    trainer = make_trainer(tiny, tmp_path, fused_linear=True)
    rows = completion_rows(with_logps(trainer, trl_inputs(trainer), old=True), every_position=False)
    scorer = FusedLinearScorer(trainer.model, rows.batch, temperature=trainer.temperature,
                               autocast=contextlib.nullcontext, logit_options={},
                               workspace_bytes=trainer.args.loss_workspace_mib << 20)
    head = trainer.model.get_output_embeddings()
    with scorer.head():
        for kind in (1, 2):
            with LaunchCounter(device="cpu") as counter:  # the trainer's device
                counter.host_memory(rows.batch.host_layout)  # completion_rows' read, before the counting
                logp = scorer.logprobs(kind)
            assert counter.sync_names == {"aten._local_scalar_dense": 1}, counter.sync_names
            of_kind = rows.batch.token_kind == kind
            alone = fused_linear_token_logprobs(scorer.hidden.detach()[of_kind], head.weight,
                                                rows.batch.targets[of_kind], bias=head.bias,
                                                temperature=trainer.temperature)
            assert of_kind.any() and (~of_kind).any()
            assert torch.equal(logp[of_kind], alone) and not logp[~of_kind].any()


def test_reference_cache_scores_the_prompt_rows_alone(tiny, tmp_path, monkeypatch):
    """The reference cache of the logits path does not go through the scorer, which keeps every position: its
    ell_theta0(q) are, bit for bit, the sums of the prompt rows selected from the model's logits (right-padded
    prompts plus one masked column), as at commit 1598eac. On the Triton path, whose per-sample sums the GPU runs."""
    on_the_triton_path(monkeypatch)
    trainer = make_trainer(tiny, tmp_path, fused_linear=False, model_init_kwargs={"attn_implementation": "eager"})
    prompt_ids = trainer._prompt_ids(trainer.train_dataset)

    def selected_rows(batch):   # the cache's scoring before the every-position scorer, written out
        input_ids, attention_mask = (torch.cat([t, torch.zeros_like(t[:, :1])], 1)
                                     for t in (batch.input_ids, batch.attention_mask))
        rows = torch.cat([batch.rows.reshape(len(input_ids), -1), torch.zeros_like(input_ids[:, :1]).bool()], 1)
        logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return token_logprobs(logits.reshape(-1, logits.shape[-1])[rows.reshape(-1)], batch.targets,
                              temperature=trainer.temperature)

    with torch.no_grad():
        expected = compute_query_logp(trainer.model, prompt_ids, pad_id=trainer.processing_class.pad_token_id,
                                      batch_size=trainer.args.per_device_train_batch_size, score=selected_rows)
    cached = torch.tensor([trainer.reference_cache.entries[prompt_hash(p)][0] for p in prompt_ids],
                          dtype=torch.float64)
    assert len(prompt_ids) == len(PROMPTS) and torch.equal(cached, expected)


def test_theta0_is_left_at_the_first_optimizer_step_and_on_resume(tiny, tmp_path):
    """ell_theta0(q) is taken from the forward during the first optimizer step only (2 micro-batches), and a
    train() resumed from a checkpoint past step 0 takes it from the cache from its first step."""
    def spied(trainer):
        seen = []
        reference_of = trainer._reference_of
        trainer._reference_of = lambda *args: seen.append(trainer.at_theta0) or reference_of(*args)
        return seen

    settings = dict(conversational=True, qkl_coef=0.5, learning_rate=3e-2, max_steps=2, temperature=1.0,
                    per_device_train_batch_size=2, gradient_accumulation_steps=2, save_strategy="steps",
                    save_steps=1)
    trainer = make_trainer(tiny, tmp_path, **settings)
    seen = spied(trainer)
    trainer.train()
    assert seen == [True, True, False, False]
    resumed = make_trainer(tiny, tmp_path, **settings)
    seen = spied(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert seen == [False, False]
    assert [entry for entry in resumed.state.log_history if "qkl" in entry][-1]["qkl"] > 1e-6


def test_a_resume_from_a_model_other_than_theta0_is_refused(tiny, tmp_path):
    """Each checkpoint records theta0 (the weights fingerprint of the model the run's trainer was given). A resume
    whose trainer was given other weights, here the checkpoint's own with their cache built afresh elsewhere (the
    run's cache refuses them: "delete it to rebuild it"), would train against another model's ell_theta0(q): it is
    refused in one line before any step, for a checkpoint folder and for resume_from_checkpoint=True alike."""
    settings = dict(conversational=True, qkl_coef=0.5, learning_rate=3e-2, max_steps=1, save_strategy="steps",
                    save_steps=1)
    first = make_trainer(tiny, tmp_path, **settings)
    theta0 = [weights_fingerprint(first.model), model_fingerprint(tiny[0])]
    first.train()
    checkpoint = tmp_path / "checkpoint-1"
    assert json.loads((checkpoint / THETA0_RECORD).read_text()) == {
        "theta0": theta0, "reference_cache": str(tmp_path / CACHE_FILE)}
    moved = make_trainer((str(checkpoint), tiny[1]), tmp_path, ref_cache=str(tmp_path / "rebuilt.json"),
                         **dict(settings, max_steps=2))
    given = [moved.reference_cache.model_fingerprint, model_fingerprint(str(checkpoint))]   # the cache: built from it
    assert not set(given) & set(theta0)
    for resume in (str(checkpoint), True):
        with pytest.raises(ValueError) as refused:
            moved.train(resume_from_checkpoint=resume)
        assert str(refused.value) == (
            f"resume_from_checkpoint={checkpoint}: the run started from other weights ({' or '.join(theta0)}) than "
            f"the model passed to this ERPOTrainer ({' or '.join(given)}), against which its reference cache "
            f"{tmp_path / 'rebuilt.json'} was checked or built, so ell_theta0(q) would be another model's; pass the "
            "model the run started from (not a checkpoint's weights), or start afresh in another output_dir")
        assert moved.state.global_step == 0


@pytest.mark.parametrize("query_weight", ["none", "current"])
def test_settings_without_a_reference_train_past_the_first_optimizer_step(tiny, tmp_path, query_weight):
    """qkl_coef=0 with query_weight 'none' (GRPO's loss) or 'current' reads no ell_theta0(q), so no reference cache is
    built: the first optimizer step leaves theta0 without one to share (it raised AttributeError there), the second
    step trains, and no cache file is written."""
    trainer = make_trainer(tiny, tmp_path, qkl_coef=0.0, query_weight=query_weight, learning_rate=3e-2, max_steps=2,
                           temperature=1.0)
    assert trainer.reference_cache is None
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2 and not trainer.at_theta0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert not (tmp_path / CACHE_FILE).exists()


def test_every_completion_truncated_leaves_the_model_unchanged(tiny, tmp_path):
    """Issue 26's TRL scenario: mask_truncated_completions with every completion truncated, bf16 autocast, sdpa
    attention. Nothing is scored but the prompts, whose Query-KL is exactly 0 at theta0: no parameter moves (as
    with GRPOTrainer)."""
    trainer = make_trainer(tiny, tmp_path, qkl_coef=0.5, query_weight="none", bf16=True, max_completion_length=2,
                           mask_truncated_completions=True, max_steps=1, learning_rate=1e-2,
                           generation_kwargs={"suppress_tokens": tiny[1].all_special_ids})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[0]["completions/clipped_ratio"] == 1.0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
