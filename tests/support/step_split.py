"""One optimizer step of `erpo train` (plan_step, the w(q) plan, accumulate_loss, step_record) on a hand-made
rollout, so that tests can split the same step over micro-batches (tests/train/test_step_split.py) and over ranks
(tests/workers/step_split_worker.py, tests/distributed/test_step_split_ranks.py) and compare it with the step in
one call.

The rollout: 3 prompts of 3, 2 and 5 tokens x 2 responses of 1 to 7 tokens, sample 1 and both samples of prompt
2 truncated; the policy is a tiny Qwen2 with a sharpened lm_head (unequal entropies) and its reference another
initialisation, so the Query-KL, the Policy-KL and the entropy terms are all far from 0.
"""
import torch

from erpo.config import Config, apply_overrides, resolve
from erpo.models.tiny import build_model, build_tokenizer
from erpo.sequences import logit_transforms
from erpo.tasks.data import PromptSet
from erpo.train import update_step
from erpo.train.metrics import step_record
from erpo.train.rollout_stage import Rollout
from erpo.train.step_plan import plan_query_weights, plan_step
from erpo.train.updater import DeepSpeedUpdater, TorchUpdater, deepspeed_config_for

GROUP = 2
PROMPTS = PromptSet(records=[{}, {}, {}], prompts=["a", "b", "c"], prompt_ids=[[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]],
                    answers=["1", "2", "3"])
REF_QUERY_LOGP = torch.tensor([-12.0, -9.0, -20.0], dtype=torch.float64)   # ell_theta0(q): far from the policy's
STATIC_WEIGHT = torch.tensor([0.5, 1.5, 1.0])
# The step's settings compared: every loss_agg, both entropy_agg, the masks, the sequence ratio, the per-step w(q)
# and GRPO's Policy-KL against a reference model. `top_entropy_quantile` is left out: its quantile is the
# micro-batch's, as TRL's (docs/training.md), so a split changes it by design.
CASES = {
    "token-mean": [],
    "seq-mean-token-mean": ["algorithm.loss_agg=seq-mean-token-mean"],
    "seq-mean-token-sum": ["algorithm.loss_agg=seq-mean-token-sum"],
    "mask-truncated": ["algorithm.mask_truncated=true"],
    "mask-truncated-seq-mean": ["algorithm.mask_truncated=true", "algorithm.loss_agg=seq-mean-token-mean"],
    "sequence-ratio": ["algorithm.ratio_level=sequence"],
    "entropy-loss-agg": ["algorithm.entropy_coef=0.1"],
    "entropy-token-mean": ["algorithm.entropy_coef=0.1", "algorithm.entropy_agg=token-mean"],
    "current-query-weight": ["algorithm.query_weight=current"],
    "grpo": ["algorithm.name=grpo"],
}
RANK_SHARES = ((0, 4), (4, 6))   # 2 ranks: groups 0 and 1 on rank 0, group 2 (its 2 samples truncated) on rank 1
GROUP_2_FILTERED = (True,) * 4 + (False,) * 2   # `keep`: rank 1 then runs stand-ins only
COMPARED_METRICS = ("loss", "qkl", "pg_loss", "policy_kl", "entropy", "clip_ratio", "ratio_mean", "query_weight_mean",
                    "reward", "reward_std", "accuracy", "completions/mean_length", "completions/min_length",
                    "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
                    "completions/min_terminated_length", "completions/max_terminated_length", "filtered_frac",
                    "num_samples", "response_tokens")


def models():
    """(policy, reference, tokenizer): tiny Qwen2 models of two initialisations, the policy's lm_head sharpened."""
    tokenizer = build_tokenizer()
    policy = build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_layers=1)
    with torch.no_grad():
        policy.lm_head.weight.mul_(4.0)
    return policy, build_model(tokenizer, seed=1, hidden_size=32, intermediate_size=64, num_layers=1), tokenizer


def rollout(truncated=(False, True, False, False, True, True), keep=(True,) * 6) -> Rollout:
    """The step's 6 samples (3 prompts x GROUP responses), `truncated` and `keep` per sample."""
    return Rollout(prompts=torch.tensor([0, 0, 1, 1, 2, 2]),
                   response_ids=[[20], [21, 22, 23], [24, 25], [26, 27, 28, 29, 30, 31, 32], [33, 34], [35]],
                   rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.5], dtype=torch.float64),
                   correct=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64),
                   truncated=torch.tensor(truncated), advantages=torch.tensor([1.0, -1.0, 0.7, -0.7, 0.3, -0.4]),
                   keep=torch.tensor(keep), reward_std_zero=torch.zeros(6, dtype=torch.bool), rollout_logp=None)


def accumulate(cfg, updater, reference, samples: Rollout) -> dict:
    """Plan the step of `samples` (this rank's) under `cfg`, accumulate its loss into `updater`'s gradients and
    return its metrics record (over all ranks)."""
    pad_id = build_tokenizer().pad_token_id
    plan = plan_step(cfg, samples, PROMPTS, pad_id, "cpu")
    options = logit_transforms(updater.model)
    weights = plan_query_weights(cfg, plan, updater.model, PROMPTS, pad_id, STATIC_WEIGHT, options)
    ref_model = reference if cfg.algorithm.policy_kl_coef > 0 else None
    sums, gap, _ = update_step.accumulate_loss(cfg, updater, ref_model, plan, None, weights, REF_QUERY_LOGP, options)
    weight_sum = sum(float(w.sum()) for mb, w in zip(plan.micro_batches, weights) if mb.weight and w is not None)
    return step_record(cfg, plan, sums, gap, weight_sum, grad_norm=1.0, lr=1e-3, nonfinite_skipped=0)


def step_config(overrides: list[str], micro_batch_size: int):
    return resolve(apply_overrides(Config(), [*overrides, f"trainer.micro_batch_size={micro_batch_size}"]))


def step_gradient(overrides: list[str], micro_batch_size: int, samples: Rollout) -> tuple[torch.Tensor, dict]:
    """(the gradient [P] of every policy parameter, flattened, and the step's metrics record) of one optimizer step
    of `samples` (this rank's) with the config `overrides`, in micro-batches of `micro_batch_size` samples. The
    gradient is this rank's backward's; under data parallelism DeepSpeed then averages it over ranks."""
    policy, reference, _ = models()
    cfg = step_config(overrides, micro_batch_size)
    record = accumulate(cfg, TorchUpdater(policy, cfg, total_steps=1), reference, samples)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in policy.parameters()]
    return torch.cat([g.flatten() for g in grads]), record


def deepspeed_grad_norm(overrides: list[str], micro_batch_size: int, samples: Rollout, zero_stage: int) -> float:
    """The global gradient norm DeepSpeed reports for the step of `samples` (this rank's) through erpo's
    DeepSpeedUpdater at `zero_stage`: its gradients accumulated over the micro-batches and reduced over ranks."""
    policy, reference, _ = models()
    cfg = step_config([*overrides, "trainer.updater=deepspeed", f"trainer.zero_stage={zero_stage}"], micro_batch_size)
    updater = DeepSpeedUpdater(policy, cfg, total_steps=1, ds_config=deepspeed_config_for(cfg))
    accumulate(cfg, updater, reference, samples)
    return updater.step()[0]
