"""ERPO inside OpenRLHF 0.11 (`ActorPPOTrainer.training_step`): the actor loss in place of `PolicyLoss`, and the
action log-probs with ell_theta(q) from one forward of the actor.

OpenRLHF's actor forward (`Actor.forward`) already scores every position of prompt + response and keeps the action
part. `actor_logprobs` runs that forward and scores the prompt rows too, in erpo_kernels (`token_logprobs`,
`sample_sums`): the action log-probs [B, A] that `PolicyLoss` takes, and ell_theta(q) [B], the sum of log p(x_t |
x_<t) over the prompt's tokens 2..P, with its graph. With `fused_linear=True` it runs the actor's backbone as
Actor.forward runs it (its position ids, its packing_samples) for the final hidden states and scores the prompt and
action rows alone against the lm_head in the kernels (`fused_linear_token_logprobs`, with the model's logit transform
and the actor's temperature): the fp32 logits [B, T, V] are never built. `ERPOPolicyLoss` takes PolicyLoss's inputs
plus ell_theta(q), the cached ell_theta0(q) and w(q) (`erpo.integrations.openrlhf_reference`), and forms through
erpo_kernels' `logprob_erpo_loss`

    loss = scale * [ aggregate(w(q) * pg_t) + alpha * sum_s k3(ell_theta0(q_s) - ell_theta(q_s)) / G ]

with OpenRLHF's clipped policy gradient pg_t (clip_eps_low / high, the dual clip, the log-ratio clamped to +-20 for
"ppo"; GSPO's sequence ratio), aggregated as OpenRLHF's `aggregate_loss` (token-level over batch_num_tokens, or
sequence-level over global_batch_size), the Query-KL averaged over the step's G = global_batch_size samples (over
the call's samples without it), and scale = dp_size when OpenRLHF passes the global counts, as `aggregate_loss`.
With alpha = 0 and w(q) = 1 it is PolicyLoss (tests/integrations/test_openrlhf_integration.py, against OpenRLHF's
own code).
"""
from __future__ import annotations

import importlib.metadata
import inspect
import sys
import warnings
from dataclasses import dataclass

import torch

from erpo.integrations.advantages import sample_advantages
from erpo.sequences import head_token_logprobs, last_hidden_and_output, logit_transforms
from erpo.terms import SEQUENCE_QKL_ESTIMATORS, check_choice, check_qkl_coef
from erpo_kernels import LossOptions, did_you_mean, logprob_erpo_loss, sample_sums, token_logprobs
from erpo_kernels.zero3 import find_lm_head

OPENRLHF_VERSION = "0.11.2"     # the OpenRLHF release the parity tests run against
POLICY_LOSS_TYPES = {"ppo": "token", "gspo": "sequence"}   # OpenRLHF's policy_loss_type -> the kernels' ratio_level
PPO_LOG_RATIO_CLAMP = 20.0      # PolicyLoss clamps log(ratio) to +-20 for "ppo" (not for "gspo")
ADVANTAGES_VARY = ("ERPO needs one advantage per sample (an outcome estimator: group_norm, rloo, reinforce_baseline, "
                   "dr_grpo); these advantages vary along the response (advantage estimator gae, or a per-token "
                   "KL reward: use the KL loss, algo.kl.use_loss)")

RING_ATTENTION = ("ring attention (ds.ring_attn_size > 1) is not supported by erpo.integrations.openrlhf (the "
                  "reference cache's forward would run the ring kernel without its slicing, and the step would gather "
                  "every rank's logits [B, T, V]): set ds.ring_attn_size=1")


def check_openrlhf_version() -> None:
    """Warn when the installed OpenRLHF is another release than the one the parity tests ran against (its
    PolicyLoss's arithmetic may have changed); nothing when OpenRLHF is not installed (the loss does not import it)."""
    try:
        installed = importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return
    if installed != OPENRLHF_VERSION:
        warnings.warn(f"erpo.integrations.openrlhf is tested against OpenRLHF {OPENRLHF_VERSION}, this is OpenRLHF "
                      f"{installed}: run tests/integrations/test_openrlhf_integration.py with it before trusting the "
                      "parity", stacklevel=3)


def policy_loss_metrics(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                        action_mask: torch.Tensor, *, sequence_ratio: bool, clip_low: float, clip_high: float,
                        ratio_baseline: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenRLHF's PolicyLoss metrics (0.11.2) by its formulas, detached 0-dim tensors, on [B, A] action-aligned
    tensors: clip_ratio, the fraction of action tokens whose clipped surrogate is the smaller one; ppo_kl, the mean
    of -log(log_probs / old_log_probs) (unclamped). `ratio_baseline`: the ratio's denominator when not the old
    log-probs (GSPO's against the rollout's under the train/rollout correction)."""
    mask = action_mask.float()
    log_ratio = (log_probs - old_log_probs).detach().float()
    if sequence_ratio:   # GSPO: one ratio per sample, exp of the mean log-ratio over its action tokens
        against = log_ratio if ratio_baseline is None else (log_probs - ratio_baseline).detach().float()
        ratio = ((against * mask).sum(-1) / mask.sum(-1).clamp(min=1)).exp().unsqueeze(-1) * mask
    else:
        ratio = log_ratio.clamp(-PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    count = mask.sum()
    return ((surr2 < surr1).float() * mask).sum() / count, (-log_ratio * mask).sum() / count


@dataclass(frozen=True)
class RolloutCorrection:
    """OpenRLHF's train/rollout log-prob mismatch correction (`algo.advantage.is_correction_*`, PolicyLoss's
    is_correction_level / mode / gating / threshold), checked as PolicyLoss checks it. With "ppo" a gate reads a
    statistic of pi_train / pi_rollout per token or per sequence (`level`), the ratio itself or the sampled token's
    binary KL / total variation (`gating`), and drops (`mode` "mask", the survivors weighted by their token IS
    ratio) or clamps ("clip") what lies outside [low, high]; with "gspo" the sequence ratio is taken against the
    rollout's log-probs instead of the old ones."""

    level: str = "off"
    mode: str = "mask"
    gating: str = "ratio"
    threshold: tuple[float, float] = (0.5, 5.0)

    def __post_init__(self):
        check_choice("is_correction_level", self.level, ("off", "token", "seq"))
        check_choice("is_correction_mode", self.mode, ("mask", "clip"))
        check_choice("is_correction_gating", self.gating, ("ratio", "binary_kl", "tv"))
        if self.mode == "clip" and (self.level == "seq" or self.gating != "ratio"):
            raise ValueError("is_correction_mode=clip requires is_correction_level=token and "
                             "is_correction_gating=ratio")
        if self.gating != "ratio" and self.level != "off" and self.threshold[0] > 0:
            raise ValueError(f"is_correction_gating={self.gating} takes an upper bound only: set "
                             "is_correction_threshold's lower bound to 0")

    def token_weights(self, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, action_mask: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """PolicyLoss's "ppo" correction by its formulas (0.11.2), on [B, A] action-aligned tensors: (the detached
        per-token factor on the policy term [B, A], 0 off the actions; vllm_kl, the mean of rollout - old log-prob
        over the actions; is_filter_ratio, the fraction of tokens (or sequences, level "seq") the gate filtered)."""
        low, high = self.threshold
        mask = action_mask.float()
        sequence = self.level == "seq"

        def per_sequence(values):   # the mean over each sample's actions, [B, 1]
            return ((values * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1)

        is_log_ratio = (old_log_probs - rollout_log_probs).detach().float()
        if self.gating == "ratio":
            stat = (per_sequence(is_log_ratio) if sequence else is_log_ratio).exp()
        else:
            p = rollout_log_probs.detach().float().exp().clamp(1e-6, 1 - 1e-6)
            q = old_log_probs.detach().float().exp().clamp(1e-6, 1 - 1e-6)
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log() if self.gating == "binary_kl" \
                else (p - q).abs()
            stat = per_sequence(stat) if sequence else stat
        if self.mode == "clip":
            coef, filtered = stat.clamp(min=low, max=high), (stat < low) | (stat > high)
        else:
            keep = (stat >= low) & (stat <= high)
            coef, filtered = torch.where(keep, is_log_ratio.exp(), 0.0), ~keep
        coef = torch.where(action_mask.bool(), coef, 0.0)   # the kernels read it on action rows only; keep it finite
        filter_ratio = filtered.float().mean() if sequence else (filtered.float() * mask).sum() / mask.sum()
        vllm_kl = ((rollout_log_probs - old_log_probs).detach().float() * mask).sum() / mask.sum()
        return coef, vllm_kl, filter_ratio


class ERPOPolicyLoss(torch.nn.Module):
    """OpenRLHF's `PolicyLoss` with ERPO's Query-KL and w(q): the same constructor options, forward inputs and return
    value (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio), plus ERPO's options (`qkl_coef`: alpha;
    `qkl_estimator`: k1 / k2 / k3 on ell_theta0(q) - ell_theta(q); `backend`: the kernels'). The train/rollout
    correction (is_correction_*) is OpenRLHF's (`RolloutCorrection`). Refused, in one line: a policy_loss_type
    other than "ppo" / "gspo"."""

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: float | None = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold=(0.5, 5.0), *, qkl_coef: float = 0.01, qkl_estimator: str = "k3",
                 backend: str = "auto") -> None:
        super().__init__()
        check_openrlhf_version()
        check_choice("policy_loss_type", policy_loss_type, tuple(POLICY_LOSS_TYPES),
                     hint=" with ERPOPolicyLoss (the kernels' clipped surrogate, per token or per sequence)")
        self.correction = RolloutCorrection(is_correction_level, is_correction_mode, is_correction_gating,
                                            tuple(is_correction_threshold))
        check_qkl_coef(qkl_coef)
        check_choice("qkl_estimator", qkl_estimator, SEQUENCE_QKL_ESTIMATORS)
        self.policy_loss_type = policy_loss_type
        self.clip_eps_low, self.clip_eps_high, self.dual_clip = clip_eps_low, clip_eps_high, dual_clip
        self.token_level_loss = token_level_loss and policy_loss_type != "gspo"   # GSPO is sequence-level, as OpenRLHF
        self.qkl_coef, self.backend = qkl_coef, backend
        self.options = dict(
            qkl_coef=qkl_coef, qkl_estimator=qkl_estimator, clip_low=clip_eps_low, clip_high=clip_eps_high,
            dual_clip=dual_clip, ratio_level=POLICY_LOSS_TYPES[policy_loss_type],
            pg_log_ratio_clamp=PPO_LOG_RATIO_CLAMP if policy_loss_type == "ppo" else None,
            loss_agg="token-mean" if self.token_level_loss else "seq-mean-token-mean")
        LossOptions(**self.options)   # every option checked here, once, in the kernels' words

    def forward(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                action_mask: torch.Tensor | None = None, rollout_log_probs: torch.Tensor | None = None,
                dp_size: int = 1, batch_num_tokens=None, global_batch_size=None, *,
                query_logp: torch.Tensor | None = None, ref_query_logp: torch.Tensor | None = None,
                query_weight: torch.Tensor | None = None, info: dict | None = None):
        """PolicyLoss's forward with ERPO's terms. log_probs, old_log_probs, advantages, action_mask [B, A]
        (action-aligned, as `Actor.forward` returns them; one advantage per sample, broadcast along its actions);
        dp_size, batch_num_tokens, global_batch_size: OpenRLHF's `loss_batch_info`. ERPO's: query_logp [B] fp32,
        ell_theta(q) with its graph (`actor_logprobs`), required when qkl_coef != 0; ref_query_logp [B], the cached
        ell_theta0(q) (nats), required when qkl_coef != 0; query_weight [B], w(q) on each sample's policy term (None:
        1). `info` (OpenRLHF's experience.info), when given, gets ERPO's metrics as per-sample [B] tensors, which
        OpenRLHF's logging averages over samples: qkl (the micro-batch's mean Query-KL, nats), query_logp
        (ell_theta(q)), query_weight_mean (w(q)). Returns (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio), the
        last two None unless the "ppo" loss corrects for the rollout (`RolloutCorrection`), as PolicyLoss's."""
        if action_mask is None:
            raise ValueError("action_mask is required by ERPOPolicyLoss (the action tokens of each sample)")
        num, width = log_probs.shape
        if self.qkl_coef != 0 and (query_logp is None or ref_query_logp is None):
            raise ValueError("qkl_coef != 0 needs query_logp (ell_theta(q), from actor_logprobs) and ref_query_logp "
                             "(the cached ell_theta0(q)); or set qkl_coef=0")
        if query_logp is not None and tuple(query_logp.shape) != (num,):
            raise ValueError(f"query_logp must have shape [{num}] (one ell_theta(q) per sample of log_probs), got "
                             f"{tuple(query_logp.shape)}")
        if self.qkl_coef != 0 and self.token_level_loss and batch_num_tokens is not None and global_batch_size is None:
            # the policy term would be global and scaled by dp_size, the Query-KL a mean over this call's samples
            # scaled by dp_size too: dp_size times its weight. OpenRLHF's loss_batch_info passes both counts.
            raise ValueError("batch_num_tokens without global_batch_size: the Query-KL is a mean over the step's "
                             "samples; pass both (OpenRLHF's loss_batch_info) or neither")
        mask = action_mask.bool()
        per_sample, varies = sample_advantages(advantages, mask)
        if bool(varies):
            raise ValueError(ADVANTAGES_VARY)
        corrected = self.correction.level != "off"
        if corrected and rollout_log_probs is None:
            raise ValueError(f"is_correction_level={self.correction.level!r} needs rollout_log_probs (the rollout "
                             "engine's log-probs: experience.rollout_log_probs)")
        baseline, weight, vllm_kl, filter_ratio = old_log_probs, None, None, None
        if corrected and self.policy_loss_type == "gspo":   # GSPO's ratio is then against the rollout's log-probs
            baseline = rollout_log_probs
        elif corrected:
            weight, vllm_kl, filter_ratio = self.correction.token_weights(old_log_probs, rollout_log_probs, mask)
        # Rows of the kernels' layout, sample by sample: one query row holding ell_theta(q) whole (the loss's sum
        # over a sample's query rows is then that value, its gradient flows into query_logp), then the A actions.
        device = log_probs.device
        zero_column = torch.zeros(num, 1, device=device)
        query_kind = 0 if query_logp is None else 1
        query_column = zero_column if query_logp is None else query_logp.float()[:, None]
        token_logp = torch.cat([query_column, log_probs.float()], 1).reshape(-1)
        old_logp = torch.cat([zero_column, baseline.float()], 1).reshape(-1)
        token_weight = None if weight is None else torch.cat([zero_column, weight], 1).reshape(-1)
        kind = torch.cat([torch.full((num, 1), query_kind, device=device),
                          torch.where(mask, 2, 0)], 1).reshape(-1).long()
        sample_index = torch.arange(num, device=device).repeat_interleave(width + 1)
        global_count = batch_num_tokens if self.token_level_loss else global_batch_size
        out = logprob_erpo_loss(
            token_logp, kind, sample_index, advantages=per_sample, old_logp=old_logp, token_weight=token_weight,
            ref_query_logp=ref_query_logp if self.qkl_coef != 0 else None, query_weight=query_weight,
            backend=self.backend, num_items=batch_num_tokens if self.token_level_loss else None,
            num_seqs=global_batch_size, validate=False, **self.options)   # the rows are built above: no read
        # aggregate_loss multiplies by dp_size when given the global count (DeepSpeed averages the ranks' gradients)
        loss = out.loss * (dp_size if global_count is not None else 1)
        clip_ratio, ppo_kl = policy_loss_metrics(
            log_probs, old_log_probs, advantages, mask, sequence_ratio=self.policy_loss_type == "gspo",
            clip_low=self.clip_eps_low, clip_high=self.clip_eps_high, ratio_baseline=baseline)
        if info is not None:
            self._log_metrics(info, out, query_logp, query_weight, num, global_batch_size)
        return loss, clip_ratio, ppo_kl, vllm_kl, filter_ratio

    @staticmethod
    def _log_metrics(info: dict, out, query_logp, query_weight, num: int, global_batch_size) -> None:
        """ERPO's metrics into OpenRLHF's experience.info, as [B] tensors (OpenRLHF weighs a [B] entry by samples)."""
        with torch.no_grad():
            if "qkl" in out.metrics:   # the loss's qkl is sum_s qkl_s / num_seqs: here the micro-batch's mean
                qkl = out.metrics["qkl"] * (num if global_batch_size is None else global_batch_size) / num
                info["qkl"] = qkl.float().expand(num).clone()
            if query_logp is not None:
                info["query_logp"] = query_logp.detach().float().clone()
            if query_weight is not None:
                info["query_weight_mean"] = query_weight.detach().float().clone()


@dataclass
class ActorScores:
    """What `actor_logprobs` returns for a micro-batch of B sequences [B, T] with A action columns."""

    action_log_probs: torch.Tensor   # [B, A] fp32: Actor.forward's action log-probs (0 where action_mask is 0)
    query_logp: torch.Tensor         # [B] fp32: ell_theta(q), nats, differentiable
    prompt_ids: list[list[int]]      # each sample's prompt token ids (host), the reference cache's key
    output: object                   # the model's output (`ActorRowScores.output`: an MoE's aux_loss); with
    #                                  return_entropy `entropy` [B, T - 1] fp32, as Actor.forward sets it (OpenRLHF's
    #                                  step reads [:, -A:]; with fused_linear, 0 off the prompt and action rows)


def actor_rows(sequences: torch.Tensor, action_mask: torch.Tensor, attention_mask: torch.Tensor):
    """The kernels' rows of every position of a micro-batch [B, T]: row b * T + t scores token t + 1 of sequence b.
    Returns (targets [B * T] int64, -100 where nothing is scored; kind [B, T]: 1 on the prompt's rows (tokens 2..P of
    the real tokens before the first action token, left or right padding alike), 2 on the action rows of action_mask
    [B, A], aligned with the last A rows as `Actor.forward` aligns it, 0 elsewhere (padding, tool outputs); prompt
    [B, T] bool: the prompt's real tokens)."""
    num, length = sequences.shape
    width = action_mask.shape[1]
    if width > length - 1:
        raise ValueError(f"action_mask has {width} columns, more than the {length - 1} scored positions of sequences "
                         f"[{num}, {length}]")
    actions = torch.zeros(num, length, dtype=torch.bool, device=sequences.device)
    actions[:, length - 1 - width:length - 1] = action_mask.bool()
    real = attention_mask.bool()
    first = torch.where(actions.any(1), actions.float().argmax(1), length - 1)   # the first action's row
    position = torch.arange(length, device=sequences.device)
    prompt = real & (position <= first[:, None])   # row `first` scores the first action: token `first` is the prompt's
    query = torch.zeros_like(actions)
    query[:, :-1] = prompt[:, :-1] & prompt[:, 1:]   # the prompt's first real token is predicted by nothing
    kind = torch.where(actions, 2, torch.where(query, 1, 0))
    targets = torch.where(kind != 0, torch.roll(sequences, -1, dims=1), -100).reshape(-1)
    return targets, kind, prompt


def check_no_ring_attention(ring_attn_group) -> None:
    """Refuse OpenRLHF's ring attention in one line: the group a step passes (`ring_attn_group`), or, where no caller
    passes one (the reference cache's forward), OpenRLHF's own record of it (`ring_attn_utils.get_ring_attn_group`,
    set by its strategy; the module is imported, with flash-attn, wherever OpenRLHF's Actor is)."""
    ring = sys.modules.get("openrlhf.models.ring_attn_utils")
    if ring_attn_group is not None or (ring is not None and ring.get_ring_attn_group() is not None):
        raise ValueError(RING_ATTENTION)


def check_multimodal_inputs(actor, mm_inputs: dict, function: str) -> None:
    """Refuse, as Python refuses an unexpected keyword (a one-line TypeError naming it), a keyword of `function`
    (`actor_logprobs`, `actor_row_logprobs`) that cannot be a multimodal input: they pass their other keywords on to
    the model (a VLM processor's pixel_values, image_grid_thw, ...), whose transformers `**kwargs` would drop a
    misspelled option silently. Refused: every one on a text-only actor (OpenRLHF's `is_vlm` unset); on a VLM actor,
    one of Actor.forward's own parameters (return_output, packed_seq_lens, ...: `function` sets them) and a near miss
    of `function`'s own options (`fused_liner`; `did_you_mean` against its signature, no list kept here)."""
    if not mm_inputs:   # a text-only call, every micro-batch's: no signature to read
        return
    own = [name for name, parameter in inspect.signature(actor_row_logprobs).parameters.items()
           if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    forward = [name for name, parameter in inspect.signature(actor.forward).parameters.items()
               if parameter.kind is not inspect.Parameter.VAR_KEYWORD]

    def refused(key: str) -> str | None:   # why `key` cannot be a multimodal input, None when it can
        if near := did_you_mean(key, own, cutoff=0.8):
            return near
        if not getattr(actor, "is_vlm", False):
            return "the actor is not a vision-language model (OpenRLHF's is_vlm), so it takes no multimodal inputs"
        return f"{function} sets Actor.forward's {key} itself" if key in forward else None

    for key in mm_inputs:
        if why := refused(key):
            raise TypeError(f"{function}() got an unexpected keyword argument {key!r} ({why})")


def check_fused_linear(actor) -> None:
    """Refuse, in one line, an actor whose rows the fused-linear path cannot score as Actor.forward does: a
    vision-language actor (its multimodal inputs, own position ids and token types), and an lm_head that is not a
    plain `torch.nn.Linear` holding the whole [V, D] weight (DeepSpeed AutoTP's column shard under
    ds.tensor_parallel_size > 1, a LoRA adapter on lm_head). A head DeepSpeed ZeRO-3 partitions is scored as its own
    forward (`head_token_logprobs`), gathered for the scoring and again for OpenRLHF's backward, whenever that runs."""
    if getattr(actor, "is_vlm", False):
        raise ValueError("fused_linear=True does not score a vision-language actor (Actor.forward's multimodal "
                         "inputs): set fused_linear=False")
    head = find_lm_head(actor.model)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"fused_linear=True needs the actor's lm_head to be a torch.nn.Linear holding the whole "
                         f"[V, D] weight, not a {type(head).__name__} (DeepSpeed AutoTP, ds.tensor_parallel_size > 1, "
                         "shards it; a LoRA adapter on lm_head adds to it): set fused_linear=False")


def backbone_rows(actor, sequences: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor):
    """The final hidden states [R, D] of the rows `rows` [R] (positions b * T + t of a micro-batch [B, T]) and the
    model's whole output, from one forward of the actor's model (`actor.model`: the Hugging Face model, a PEFT model,
    or the DeepSpeed engine around either) on Actor.forward's inputs: position ids counted over the real tokens (1 on
    padding) with the attention mask; with the actor's packing_samples, its unpadding: the real tokens back to back
    in one row [1, N], positions restarting at each sample, no mask (each row then read where its token was packed;
    `rows` must be real tokens: no padding is packed). Only the last position's logits are formed
    (`last_hidden_and_output`)."""
    if getattr(actor, "packing_samples", False):
        real = attention_mask.bool().reshape(-1)
        packed = real.nonzero().squeeze(1)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0).reshape(-1)
        inputs = dict(input_ids=sequences.reshape(-1)[packed][None], position_ids=positions[packed][None],
                      attention_mask=None)
        at = (real.long().cumsum(0) - 1).index_select(0, rows)   # each row's place in the packed forward
    else:
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        inputs = dict(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids)
        at = rows
    hidden, output = last_hidden_and_output(actor.model, **inputs)
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, at), output


@dataclass
class ActorRowScores:
    """Every position of a micro-batch [B, T] scored by the actor (`actor_row_logprobs`): row b * T + t scores token
    t + 1 of sequence b."""

    logp: torch.Tensor             # [B * T] fp32, differentiable: log p of the row's next token, 0 where unscored
    entropy: torch.Tensor | None   # [B * T] fp32 with return_entropy: each position's entropy (nats); with
    #                                fused_linear, of the prompt and action rows (0 elsewhere)
    kind: torch.Tensor             # [B * T] int64: 1 prompt row, 2 action row, 0 neither (`actor_rows`)
    prompt: torch.Tensor           # [B, T] bool: the prompt's real tokens
    output: object                 # the model's output: Actor.forward's, logits [B, T, V] included; with fused_linear
    #                                the model's own, whose logits are the last position's alone (logits_to_keep=1)


def actor_row_logprobs(actor, sequences: torch.Tensor, action_mask: torch.Tensor, attention_mask: torch.Tensor, *,
                       return_entropy: bool = False, fused_linear: bool = False, ring_attn_group=None,
                       **mm_inputs) -> ActorRowScores:
    """One forward of OpenRLHF's actor (an `openrlhf.models.Actor`, as `ActorPPOTrainer.actor`, whose `model` is then
    the DeepSpeed engine) on sequences, attention_mask [B, T] and action_mask [B, A] as `Actor.forward` takes
    them, the prompt and action rows scored in erpo_kernels (with each position's entropy when `return_entropy`).
    fused_linear=False: Actor.forward itself (its position ids, fp32 logits divided by its temperature; with
    packing_samples gathered back to [B, T]) gives the logits [B, T, V], `token_logprobs` scores them.
    fused_linear=True: the actor's backbone on Actor.forward's inputs (`backbone_rows`) gives the final hidden states
    of the prompt and action rows alone, scored against the whole lm_head with the model's logit transform and the
    actor's temperature (`head_token_logprobs`): no [B, T, V] tensor; one host read more (the rows' positions; two
    with packing_samples, whose unpadding reads the real tokens' as OpenRLHF's does); refused where it cannot be
    right (`check_fused_linear`). `mm_inputs`: a vision-language actor's processor inputs (pixel_values,
    image_grid_thw, ...), passed on to Actor.forward; any other keyword is refused (`check_multimodal_inputs`).
    `actor_logprobs` and the reference cache read it. Ring attention is refused (`check_no_ring_attention`)."""
    check_multimodal_inputs(actor, mm_inputs, "actor_row_logprobs")
    return scored_rows(actor, sequences, action_mask, attention_mask, return_entropy=return_entropy,
                       fused_linear=fused_linear, ring_attn_group=ring_attn_group, mm_inputs=mm_inputs)


def scored_rows(actor, sequences: torch.Tensor, action_mask: torch.Tensor, attention_mask: torch.Tensor, *,
                return_entropy: bool, fused_linear: bool, ring_attn_group, mm_inputs: dict) -> ActorRowScores:
    """`actor_row_logprobs` on inputs `check_multimodal_inputs` has checked (`actor_logprobs` checks them under its
    own name)."""
    check_no_ring_attention(ring_attn_group)
    num, length = sequences.shape
    targets, kind, prompt = actor_rows(sequences, action_mask, attention_mask)
    packed = getattr(actor, "packing_samples", False)
    if packed:   # Actor.forward packs no padding: its log-probs and entropy are 0 there
        kind = torch.where(attention_mask.bool(), kind, 0)
        targets = torch.where(kind.reshape(-1) != 0, targets, -100)
    if not fused_linear:
        output = actor(sequences, None, attention_mask=attention_mask, return_output=True, allgather_logits=True,
                       **mm_inputs)
        # validate=False: the targets are the sequences' own tokens, which the forward has just embedded (no read)
        scored = token_logprobs(output["logits"].reshape(num * length, -1), targets, return_entropy=return_entropy,
                                validate=False)
        logp, entropy = scored if return_entropy else (scored, None)
        if packed and entropy is not None:
            entropy = torch.where(attention_mask.reshape(-1).bool(), entropy, 0.0)
        return ActorRowScores(logp, entropy, kind.reshape(-1), prompt, output)
    check_fused_linear(actor)
    rows = (kind.reshape(-1) != 0).nonzero().squeeze(1)   # the one host read: the scored rows' positions
    hidden, output = backbone_rows(actor, sequences, attention_mask, rows)
    scored = head_token_logprobs(actor.model, hidden, targets.index_select(0, rows), temperature=actor.temperature,
                                 logit_options=logit_transforms(actor.model), return_entropy=return_entropy,
                                 validate=False)
    logp, entropy = scored if return_entropy else (scored, None)

    def every_row(values):   # [R] -> [B * T], 0 on the rows not scored, differentiable
        return values.new_zeros(num * length).index_copy(0, rows, values)

    return ActorRowScores(every_row(logp), None if entropy is None else every_row(entropy), kind.reshape(-1), prompt,
                          output)


def actor_logprobs(actor, sequences: torch.Tensor, action_mask: torch.Tensor, attention_mask: torch.Tensor, *,
                   return_entropy: bool = False, fused_linear: bool = False, ring_attn_group=None,
                   **mm_inputs) -> ActorScores:
    """The action log-probs and ell_theta(q) of one forward of OpenRLHF's actor (`actor_row_logprobs`, which takes
    the same arguments; `fused_linear`: the lean path, no [B, T, V] logits): the action rows as Actor.forward returns
    them, each prompt's rows summed by erpo_kernels' `sample_sums`. Host reads beyond the forward's: 2, sample_sums'
    index check and one copy of the prompt tokens (and the lean path's, `actor_row_logprobs`)."""
    check_multimodal_inputs(actor, mm_inputs, "actor_logprobs")
    rows = scored_rows(actor, sequences, action_mask, attention_mask, return_entropy=return_entropy,
                       fused_linear=fused_linear, ring_attn_group=ring_attn_group, mm_inputs=mm_inputs)
    num, length = sequences.shape
    kind, logp = rows.kind, rows.logp
    sample_index = torch.arange(num, device=sequences.device).repeat_interleave(length)
    query_logp = sample_sums(torch.where(kind == 1, logp, 0.0), sample_index, num)
    width = action_mask.shape[1]
    action_log_probs = torch.where(kind == 2, logp, 0.0).reshape(num, length)[:, length - 1 - width:length - 1]
    host = torch.cat([rows.prompt.reshape(-1).long(), sequences.reshape(-1).long()]).tolist()   # the one host read
    kept, tokens = host[:num * length], host[num * length:]
    prompt_ids = [[token for token, keep in zip(tokens[b * length:(b + 1) * length], kept[b * length:(b + 1) * length])
                   if keep] for b in range(num)]
    if rows.entropy is not None:   # where OpenRLHF's step reads it, as Actor.forward sets it
        rows.output.entropy = rows.entropy.reshape(num, length)[:, :-1]
    return ActorScores(action_log_probs, query_logp, prompt_ids, rows.output)
