"""`ERPOTrainer`: TRL's GRPOTrainer with the ERPO loss (`_compute_loss`); the cached reference, the loss options
and the metrics are its mixins (reference.py, loss.py, metrics.py)."""
from __future__ import annotations

import math
import os
from functools import partial

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from trl import GRPOTrainer

from erpo.integrations.trl.config import ERPOConfig
from erpo.integrations.trl.layout import completion_rows
from erpo.integrations.trl.loss import LossOptionsMixin
from erpo.integrations.trl.metrics import LossMetricsMixin
from erpo.integrations.trl.reference import ReferenceMixin, Theta0Callback
from erpo.integrations.trl.scorer import FusedLinearScorer, LogitsScorer
from erpo.models.loading import disable_dropout, dropouts_besides_adapters
from erpo.models.lora import peft_model_of
from erpo.reference.cache import CACHE_FILE
from erpo.sequences import logit_transforms, per_sample_sum

# the inputs' key of whether each sample holds a token vLLM could not score (its sampling log-prob None or NaN), a host
# list [B] of bools, from the host lists TRL's `_generate` returns
UNSCORED_SAMPLES = "erpo_unscored_samples"


class ERPOTrainer(ReferenceMixin, LossOptionsMixin, LossMetricsMixin, GRPOTrainer):
    """GRPOTrainer with the ERPO loss. Same constructor; `args` is an ERPOConfig. GRPOTrainer's own state is kept:
    the adaptive entropy coefficient (`entropy_coef`, `_last_world_entropy`, saved in checkpoints by GRPOTrainer)
    and the MoE router auxiliary loss settings (`aux_loss_enabled`, `router_aux_loss_coef`)."""

    def __init__(self, model, reward_funcs=None, args: ERPOConfig | None = None, *rest, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = ERPOConfig(f"{name.rstrip('/').split('/')[-1]}-ERPO")
        if not isinstance(args, ERPOConfig):
            raise TypeError(f"args must be an ERPOConfig (GRPOConfig plus ERPO's options), got {type(args).__name__}")
        passed_with_adapter = not isinstance(model, str) and peft_model_of(model) is not None
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._adapter_added = not passed_with_adapter and peft_model_of(self.model) is not None  # by peft_config
        self._check_model()
        self.reference_cache_path = args.ref_cache or os.path.join(args.output_dir, CACHE_FILE)
        self.reference_cache = self._load_or_build_reference() if args.needs_reference else None
        self._theta0 = self._keep_theta0()  # theta0 for a rollout's prompts, kept as the model as passed (reference.py)
        self.at_theta0 = True      # no optimizer step yet: ell_theta0(q) is the forward's own (reference.py)
        self._theta0_entries = {}  # prompts added to the cache at theta0, not yet shared with the other processes
        self.add_callback(Theta0Callback(self))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """Trainer.train; a resumed run (resume_from_checkpoint: a checkpoint folder, or True for output_dir's last
        one) is first checked against the theta0 its checkpoint records (reference.py, `_check_theta0_record`)."""
        checkpoint = get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True \
            else resume_from_checkpoint
        if checkpoint:   # none found: Trainer.train says so
            self._check_theta0_record(str(checkpoint))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        """GRPOTrainer's; then theta0's record in the checkpoint (reference.py, `_save_theta0_record`)."""
        super()._save_checkpoint(model, trial)
        self._save_theta0_record(os.path.join(self._get_output_dir(trial=trial),
                                              f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"))

    def evaluate(self, *args, **kwargs):
        """Trainer.evaluate; at theta0, the prompts it added to the reference cache are then shared and saved."""
        metrics = super().evaluate(*args, **kwargs)
        if self.at_theta0:
            self._share_theta0_entries()
        return metrics

    def _check_model(self) -> None:
        """Reject what the loss cannot reproduce (one line each, naming the setting)."""
        if self._is_vlm:
            raise ValueError("ERPOTrainer does not support vision-language models (multimodal prompts)")
        if self.args.disable_dropout:   # TRL's zeroes the nn.Dropout modules; erpo's also the rates modules apply
            disable_dropout(self.model)
        active = dropouts_besides_adapters(self.model) if self.args.qkl_coef != 0 else []
        if active:   # ell_theta0(q) is scored without dropout (eval mode); a noisy ell_theta(q) biases the Query-KL
            raise ValueError(f"{type(self.model).__name__} trains with dropout ({', '.join(active)}), so ell_theta(q) "
                             "is noisy against the cached ell_theta0(q), scored without it: a Query-KL above 0 at "
                             "theta0; set disable_dropout=True (or qkl_coef=0)")
        # the model's final-logit transform, read once (a transform erpo does not know is refused): the fused-linear
        # path applies it to hidden @ lm_head; the logits path takes the model's own logits, already transformed
        self._logit_options = logit_transforms(self.model) if self.args.fused_linear else {}

    def _compute_loss(self, model, inputs):
        """ERPO loss of one micro-batch of GRPOTrainer's inputs (TRL's `_compute_loss` contract)."""
        mode = "train" if self.model.training else "eval"
        rows = completion_rows(inputs, every_position=not self.args.fused_linear)
        batch = rows.batch
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError(f"ERPOTrainer expects one advantage per sample, shape [B]; got {tuple(advantages.shape)}")
        options, row_tensors = self._loss_options(inputs, rows, mode)
        tensors = dict(advantages=advantages.float(), **row_tensors)

        router = dict(output_router_logits=True) if self.aux_loss_enabled else {}   # the MoE aux_loss, as TRL
        scorer_class = (partial(FusedLinearScorer, workspace_bytes=self.args.loss_workspace_mib << 20)
                        if self.args.fused_linear else LogitsScorer)
        scorer = scorer_class(model, batch, temperature=self.temperature, autocast=self.accelerator.autocast,
                              logit_options=self._logit_options, **router)
        aux_loss = scorer.output.aux_loss if self.aux_loss_enabled else None
        scorer.release_output()
        with scorer.head():
            def forward_query_logp(query_rows_only: bool = False):  # ell_theta(q) [B] float64 of this forward,
                with torch.no_grad():  # detached; every row scored gives the loss's own sums bit for bit
                    return per_sample_sum(scorer.logprobs(1 if query_rows_only else None), batch, kind=1)

            tensors = self._fill_unscored(tensors, scorer.logprobs, inputs.get(UNSCORED_SAMPLES))
            ref_query_logp, static_weight = self._reference_of(
                inputs, "train_dataset" if mode == "train" else "eval dataset",
                forward_query_logp) if self.args.needs_reference else (None, None)
            if self.args.query_weight == "current":   # w(q) of the current policy, from the query rows only
                query_weight = self._current_query_weights(forward_query_logp(query_rows_only=True))
            else:
                query_weight = static_weight if self.args.query_weight == "static" else None
            out = scorer.loss(query_weight=query_weight, ref_query_logp=ref_query_logp, **tensors, **options)
        loss = out.loss
        if aux_loss is not None:   # TRL's router load-balancing loss, scaled for gradient accumulation like the loss
            loss = loss + self.router_aux_loss_coef * aux_loss / (
                self.current_gradient_accumulation_steps if mode == "train" else 1)
        if self.use_adaptive_entropy and mode == "train":
            self._update_adaptive_entropy(out.metrics["kept_entropy"], out.metrics["kept_tokens"])
        self._log_loss_metrics(mode, inputs, rows, out, query_weight, options, aux_loss)
        return loss

    def _generate(self, prompts: list):
        """GRPOTrainer's; whether each sample's sampling log-probs (the host lists it returns) hold a token vLLM could
        not score is kept for `_generate_and_score_completions`."""
        generated = super()._generate(prompts)
        logprobs = generated[4]   # as GRPOTrainer makes its sampling log-probs of them: None is NaN
        self._generated_unscored = None if logprobs is None else [
            bool(torch.tensor([math.nan if logp is None else logp for logp in sample]).isnan().any())
            for sample in logprobs]
        return generated

    def _generate_and_score_completions(self, inputs):
        """GRPOTrainer's (and the reference's, reference.py), with UNSCORED_SAMPLES, which TRL shuffles and splits
        with the tensors: `_fill_unscored` knows from it, with no host read, whether a micro-batch has such a token."""
        output = super()._generate_and_score_completions(inputs)
        unscored, self._generated_unscored = getattr(self, "_generated_unscored", None), None
        if unscored is not None:
            output[UNSCORED_SAMPLES] = unscored
        return output

    @staticmethod
    def _fill_unscored(tensors: dict, current_logp, unscored: list[bool] | None) -> dict:
        """vLLM's NaN sampling log-probs (tokens it could not score) left by `trl_loss_options` (only without old
        log-probs: on-policy) become the current ones, `current_logp()` [N] (the scorer's rows, with the model's
        logit transform, as the loss scores): no drift there in the off-policy mask, as TRL's nan_to_num. Whether
        the micro-batch has any comes from `unscored` (its UNSCORED_SAMPLES, host bools [B]); without it (a
        subclass's own `_generate_and_score_completions`) rollout_logp is read on the host."""
        rollout = tensors["rollout_logp"]
        if rollout is None or tensors["old_logp"] is not None:
            return tensors
        if not (any(unscored) if unscored is not None else rollout.isnan().any()):
            return tensors
        with torch.no_grad():
            return dict(tensors, rollout_logp=torch.where(rollout.isnan(), current_logp().float(), rollout))

    def _update_adaptive_entropy(self, kept_entropy: torch.Tensor, kept_tokens: torch.Tensor) -> None:
        """GRPOTrainer's adaptive entropy control: add this micro-batch's (entropy sum, token count) over the rows
        the bonus acts on to the window; at the optimizer step, the window's mean over all processes moves
        `entropy_coef` by entropy_coef_delta (up while <= entropy_target, else down, within [min, max]) and becomes
        `_last_world_entropy`, which gates the bonus of the next step."""
        stats = torch.stack([kept_entropy.float() * kept_tokens, kept_tokens.float()]).detach()
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if not self.accelerator.sync_gradients:
            return
        total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None
