"""ERPO inside TRL: `ERPOConfig` and `ERPOTrainer`, drop-in replacements for TRL's `GRPOConfig` and `GRPOTrainer`.

ERPOTrainer keeps everything of GRPOTrainer (generation, vLLM, tools, rewards, advantages, old and reference
log-probs, logging) and overrides its loss only, `_compute_loss(model, inputs)`: one forward over prompt +
completion, then erpo_kernels' loss over the prompt rows (the Query-KL against the cached ell_theta0(q)) and the
completion rows (TRL's clipped policy gradient with TRL's normalizers, KL and importance-sampling weights). With
`qkl_coef=0` and `query_weight="none"` it equals `GRPOTrainer._compute_loss` on the same inputs.

ell_theta0(q) is computed at start for every prompt of `train_dataset` and `eval_dataset`, with the model as passed
(theta0) and the prompts tokenized by TRL's own `_tokenize_prompts`, and cached under `output_dir` (or at
`ref_cache`, which may also be a cache of `erpo precompute-ref`); entries are keyed by the prompt's token ids, which
is what reaches the loss.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field

import torch
from transformers.integrations import is_deepspeed_zero3_enabled
from trl import GRPOConfig, GRPOTrainer

from erpo.reference_cache import (ReferenceCache, build_reference_cache, model_fingerprint, prompt_hash,
                                  tokenizer_fingerprint, with_temperature)
from erpo.sequences import PackedBatch, final_hidden, per_sample_sum
from erpo_kernels import (erpo_loss, from_padded, fused_linear_erpo_loss, fused_linear_token_logprobs,
                          query_weights, token_logprobs)
from erpo_kernels.zero3 import gathered_lm_head

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")   # the TRL loss types our loss expresses exactly
QUERY_WEIGHTS = ("static", "current", "none")
QKL_ESTIMATORS = ("k1", "k2", "k3")
CACHE_FILE = "erpo_reference_cache.json"
REBUILD = "Delete it to rebuild it, or set ERPOConfig(ref_cache=...) to another path."
PROMPT_CHUNK = 256  # prompts tokenized at a time when the cache is built
MAX_QUERY_WEIGHT = 2.0  # the clip of a held-out prompt's static w(q), as query_weights' default


@dataclass
class ERPOConfig(GRPOConfig):
    """GRPOConfig plus ERPO's options (the loss's own defaults, docs/API.md)."""

    qkl_coef: float = field(default=0.01, metadata={"help": "alpha, weight of the Query-KL term"})
    qkl_estimator: str = field(default="k3", metadata={
        "help": "KL estimator on the sequence log-ratio ell_theta0(q) - ell_theta(q): k1, k2 or k3"})
    query_weight: str = field(default="static", metadata={
        "help": "w(q) on each query's policy-gradient term: static (from ell_theta0, cached), current (from the "
                "current policy over the micro-batch's prompts, all processes) or none"})
    ref_cache: str | None = field(default=None, metadata={
        "help": "ell_theta0(q) cache to read (written by this trainer or by `erpo precompute-ref`), or to write when "
                "absent; default <output_dir>/" + CACHE_FILE})
    fused_linear: bool = field(default=True, metadata={
        "help": "score hidden states x lm_head without the [N, V] logits (False: the model's own logits)"})

    def __post_init__(self):
        super().__post_init__()
        if self.query_weight not in QUERY_WEIGHTS:
            raise ValueError(f"query_weight must be one of {list(QUERY_WEIGHTS)}, got {self.query_weight!r}")
        if self.qkl_estimator not in QKL_ESTIMATORS:
            raise ValueError(f"qkl_estimator must be one of {list(QKL_ESTIMATORS)} with TRL, got "
                             f"{self.qkl_estimator!r} (k3-token needs reference log-probs of the prompt tokens, "
                             "which GRPOTrainer does not compute)")
        if not (isinstance(self.qkl_coef, (int, float)) and math.isfinite(self.qkl_coef)):
            raise ValueError(f"qkl_coef must be a finite number, got {self.qkl_coef!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not supported by ERPOTrainer; use one of "
                             f"{list(LOSS_TYPES)}")
        epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.delta is not None and self.delta <= 1 + epsilon_high:
            raise ValueError(f"delta must be > 1 + epsilon_high = {1 + epsilon_high} with ERPOTrainer (it is then "
                             f"the dual clip of negative advantages), got {self.delta}")
        unsupported = {"top_entropy_quantile": self.top_entropy_quantile < 1.0,
                       "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
                       "use_adaptive_entropy": self.use_adaptive_entropy}
        for name, is_set in unsupported.items():
            if is_set:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by ERPOTrainer; leave it at "
                                 "GRPOConfig's default")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads ell_theta0(q): for the Query-KL or for the static w(q)."""
        return self.qkl_coef != 0 or self.query_weight == "static"


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the model's state dict (names and raw bytes): the identity of theta0 as passed."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + b"\0")
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return "weights-sha256:" + digest.hexdigest()[:32]


@dataclass
class CompletionRows:
    """TRL's batch (left-padded prompts [B, P], right-padded completions [B, T]) as erpo_kernels' packed rows.

    Completion token j of sample b is predicted at position P + j - 1, so TRL's completion-aligned [B, T]
    tensors (old / reference log-probs, importance-sampling ratios) land on rows through `scatter`.
    """

    batch: PackedBatch
    prompt_width: int
    response_mask: torch.Tensor  # [B, T] float: completion_mask x tool_mask, the tokens TRL's loss scores

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[B, T] or [B, 1] completion-aligned values -> [R] values on the scored rows (0 on query rows)."""
        num, width = self.batch.input_ids.shape
        full = torch.zeros((num, width), dtype=torch.float32, device=values.device)
        full[:, self.prompt_width - 1:width - 1] = values.float().expand_as(self.response_mask)
        return full.reshape(-1)[self.batch.rows]

    def gather(self, row_values: torch.Tensor) -> torch.Tensor:
        """[R] values on the scored rows -> [B, T] completion-aligned values."""
        num, width = self.batch.input_ids.shape
        full = torch.zeros(num * width, dtype=row_values.dtype, device=row_values.device)
        full[self.batch.rows] = row_values
        return full.reshape(num, width)[:, self.prompt_width - 1:width - 1]


def completion_rows(inputs: dict) -> CompletionRows:
    """Packed rows of one TRL micro-batch: query rows on the prompt, response rows on completion_mask x tool_mask,
    nothing on tool outputs or on completions that TRL masks (mask_truncated_completions)."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    response = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    packed = from_padded(input_ids, attention_mask, torch.cat([torch.zeros_like(prompt_mask), response], dim=1),
                         query_mask=torch.cat([prompt_mask, torch.zeros_like(completion_mask)], dim=1))
    rows = packed.token_kind != 0
    batch = PackedBatch(input_ids, attention_mask, rows, packed.targets[rows], packed.token_kind[rows],
                        packed.sample_index[rows])
    return CompletionRows(batch, prompt_ids.shape[1], response.float())


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of [B, T] (or per-sequence [B, 1]) values over mask [B, T], as (sum, count) for a global reduction."""
    if values.shape[1] == 1:
        return torch.stack([values.sum(), torch.tensor(float(values.shape[0]), device=values.device)])
    return torch.stack([(values * mask).sum(), mask.sum()])


class ERPOTrainer(GRPOTrainer):
    """GRPOTrainer with the ERPO loss. Same constructor; `args` is an ERPOConfig."""

    def __init__(self, model, reward_funcs=None, args: ERPOConfig | None = None, *rest, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = ERPOConfig(f"{name.rstrip('/').split('/')[-1]}-ERPO")
        if not isinstance(args, ERPOConfig):
            raise TypeError(f"args must be an ERPOConfig (GRPOConfig plus ERPO's options), got {type(args).__name__}")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._check_model()
        self.reference_cache_path = args.ref_cache or os.path.join(args.output_dir, CACHE_FILE)
        self.reference_cache = self._load_or_build_reference() if args.needs_reference else None

    def _check_model(self) -> None:
        """Reject what the loss cannot reproduce (one line each, naming the setting)."""
        if self.aux_loss_enabled:
            raise ValueError("ERPOTrainer does not add the MoE router auxiliary loss; set router_aux_loss_coef=0")
        if self._is_vlm:
            raise ValueError("ERPOTrainer does not support vision-language models (multimodal prompts)")
        if not self.args.fused_linear:
            return
        config = self.model.config.get_text_config()
        scaled = [name for name in ("final_logit_softcapping", "logit_scale", "output_multiplier",
                                    "lm_head_multiplier", "logits_scaling")
                  if getattr(config, name, None) not in (None, 1.0)]
        if scaled:
            raise ValueError(f"fused_linear=True scores hidden @ lm_head.T, but this model also applies {scaled[0]} "
                             "to its logits; set ERPOConfig(fused_linear=False)")
        if is_deepspeed_zero3_enabled():
            raise ValueError("fused_linear=True is not supported under DeepSpeed ZeRO-3 in ERPOTrainer (TRL runs the "
                             "backward after the loss returns, outside gathered_lm_head); set fused_linear=False")

    # ell_theta0(q): the cached reference

    def _prompt_ids(self, dataset, name: str) -> list[list[int]]:
        """Token ids of every prompt of `dataset` (called `name` in errors), tokenized by TRL's `_tokenize_prompts`."""
        if self.rollout_func is not None or self.environment_factories is not None:
            raise ValueError("ERPOTrainer cannot tokenize prompts ahead of a rollout_func or environment_factory, so "
                             "it has no ell_theta0(q) for them; set qkl_coef=0 and query_weight='none'")
        if not hasattr(dataset, "__len__"):
            raise ValueError(f"ERPOTrainer needs ell_theta0(q) of every prompt: {name} must be a map-style Dataset, "
                             "not an IterableDataset (or set qkl_coef=0 and query_weight='none')")
        prompts = list(dataset["prompt"])
        prompt_ids = []
        for start in range(0, len(prompts), PROMPT_CHUNK):
            ids = self._tokenize_prompts(prompts[start:start + PROMPT_CHUNK])[0]
            prompt_ids.extend(list(map(int, p)) for p in ids)
        return prompt_ids

    def _eval_prompt_ids(self) -> list[list[int]]:
        """Token ids of every prompt of eval_dataset (a Dataset, or TRL's dict of named Datasets; none if absent)."""
        datasets = self.eval_dataset if isinstance(self.eval_dataset, dict) else {None: self.eval_dataset}
        return [ids for key, dataset in datasets.items() if dataset is not None
                for ids in self._prompt_ids(dataset, "eval_dataset" if key is None else f"eval_dataset[{key!r}]")]

    def _theta0_fingerprints(self) -> tuple[str, ...]:
        """Every fingerprint naming theta0 as passed: the hash of its state dict, and, when it was loaded from a
        local directory or a hub name, erpo's `model_fingerprint` of that (what `erpo precompute-ref` records)."""
        name = str(self.model.config._name_or_path or "")
        return (weights_fingerprint(self.model),) + ((model_fingerprint(name),) if name else ())

    def _load_or_build_reference(self) -> ReferenceCache:
        """Load the cache at `reference_cache_path` (checked against this model, tokenizer and temperature, and
        against every training prompt's token ids), or compute ell_theta0(q) of the training prompts with the
        model as passed; then add the eval prompts it lacks, and save it there when it changed."""
        path = self.reference_cache_path
        train_ids, eval_ids = self._prompt_ids(self.train_dataset, "train_dataset"), self._eval_prompt_ids()
        identity = dict(model_id=str(self.model.config._name_or_path), tokenizer_id=str(self._tokenizer.name_or_path),
                        tokenizer_fp=tokenizer_fingerprint(self._tokenizer))
        if os.path.exists(path):
            cache = ReferenceCache.load(path)
            cache.check_compatible(**identity, model_fp=self._theta0_fingerprints(), template=None,
                                   temperature=self.temperature, path=path, remedy=REBUILD)
            self._check_cached(cache, train_ids)
            changed = False
        else:
            cache = build_reference_cache(
                self.model, self._tokenizer, train_ids, model_id=identity["model_id"],
                template=with_temperature("trl", self.temperature), batch_size=self.args.per_device_train_batch_size,
                temperature=self.temperature, model_fp=weights_fingerprint(self.model),
                tokenizer_fp=identity["tokenizer_fp"], progress=True)
            changed = True
        changed |= self._add_held_out(cache, train_ids, eval_ids)
        if changed and self.accelerator.is_main_process:
            cache.save(path)
        self.accelerator.wait_for_everyone()
        return cache

    def _add_held_out(self, cache: ReferenceCache, train_ids: list[list[int]], prompt_ids: list[list[int]]) -> bool:
        """Add ell_theta0(q) of the prompts the cache lacks (eval prompts), with the static w(q) of appendix C
        scaled by the training prompts' mean surprisal (so training weights stay as they are); whether any."""
        missing = [ids for ids in prompt_ids if prompt_hash(ids) not in cache.entries]
        if not missing:
            return False
        held_out = build_reference_cache(
            self.model, self._tokenizer, missing, model_id=cache.model_id, template=cache.template,
            batch_size=self.args.per_device_eval_batch_size, temperature=self.temperature,
            model_fp=cache.model_fingerprint, tokenizer_fp=cache.tokenizer_fingerprint, progress=True)
        train_ell = torch.tensor([cache.entries[key][0] for key in {prompt_hash(ids) for ids in train_ids}],
                                 dtype=torch.float64)
        ell = torch.tensor([value[0] for value in held_out.entries.values()], dtype=torch.float64)
        weights = (-train_ell.mean() / -ell).clamp(0.0, MAX_QUERY_WEIGHT)
        cache.entries.update({key: (float(e), float(w)) for key, e, w in zip(held_out.entries, ell, weights)})
        return True

    def _check_cached(self, cache: ReferenceCache, prompt_ids: list[list[int]]) -> None:
        """ValueError naming the first prompt whose ell_theta0 the cache lacks."""
        for ids in prompt_ids:
            if prompt_hash(ids) not in cache.entries:
                text = self._tokenizer.decode(ids)
                raise ValueError(f"prompt {text[:300]!r} has no ell_theta0(q) in the reference cache "
                                 f"{self.reference_cache_path} (the dataset, tokenization or chat template changed "
                                 "since it was built). " + REBUILD)

    def _reference_of(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(ell_theta0 [B], static w [B]) of the micro-batch's prompts, by their token ids."""
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(inputs["prompt_ids"], inputs["prompt_mask"])]
        self._check_cached(self.reference_cache, prompt_ids)
        ell, weight = self.reference_cache.lookup(prompt_ids, path=self.reference_cache_path)
        device = inputs["prompt_ids"].device
        return ell.to(device), weight.to(device)

    # The loss

    def _loss_options(self, inputs: dict, rows: CompletionRows, mode: str) -> dict:
        """erpo_kernels options reproducing TRL's loss for `self.loss_type` on one micro-batch (normalizers
        included: gradient accumulation, processes, steps_per_generation), plus ERPO's Query-KL."""
        num = inputs["prompt_ids"].shape[0]
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        options = dict(qkl_coef=self.args.qkl_coef, qkl_estimator=self.args.qkl_estimator, policy_kl_coef=self.beta,
                       policy_kl_bias_correction=self.args.use_bias_correction_kl, clip_low=self.epsilon_low,
                       clip_high=self.epsilon_high, dual_clip=self.args.delta,
                       ratio_level=self.importance_sampling_level, temperature=self.temperature,
                       # TRL's entropy bonus: a token mean over the micro-batch, divided by the accumulation steps
                       entropy_coef=self.entropy_coef / accumulation, entropy_agg="token-mean",
                       num_seqs=num * accumulation)  # per-sample means (grpo, the Query-KL) over the optimizer step
        if self.loss_type == "grpo":
            return dict(options, loss_agg="seq-mean-token-mean")
        if self.loss_type == "bnpo":
            num_items = rows.response_mask.sum().clamp(min=1.0) * accumulation
        elif self.loss_type == "dr_grpo":
            num_items = num * self.max_completion_length * accumulation
        else:  # dapo: num_items_in_batch spans the generation batch over all processes
            num_items = inputs["num_items_in_batch"].float().clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * accumulation / self.args.steps_per_generation
        return dict(options, loss_agg="token-mean", num_items=num_items)

    def _current_query_weights(self, query_logp: torch.Tensor) -> torch.Tensor:
        """w(q) [B] from the current policy's ell_theta(q) [B] over this micro-batch's prompts on all processes."""
        everyone = self.accelerator.gather(query_logp.double())
        weights = query_weights(everyone)
        start = self.accelerator.process_index * query_logp.shape[0]
        return weights[start:start + query_logp.shape[0]].to(query_logp.device)

    def _compute_loss(self, model, inputs):
        """ERPO loss of one micro-batch of GRPOTrainer's inputs (TRL's `_compute_loss` contract)."""
        mode = "train" if self.model.training else "eval"
        rows = completion_rows(inputs)
        batch = rows.batch
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError(f"ERPOTrainer expects one advantage per sample, shape [B]; got {tuple(advantages.shape)}")
        ref_query_logp, static_weight = self._reference_of(inputs) if self.args.needs_reference else (None, None)
        old = inputs.get("old_per_token_logps")
        tensors = dict(
            advantages=advantages.float(), ref_query_logp=ref_query_logp,
            old_logp=None if old is None else rows.scatter(old),
            ref_logp=rows.scatter(inputs["ref_per_token_logps"]) if self.beta != 0 else None,
            token_weight=rows.scatter(inputs["importance_sampling_ratio"])
            if self.use_vllm and self.vllm_importance_sampling_correction else None)
        options = self._loss_options(inputs, rows, mode)
        query_rows = batch.token_kind == 1

        def weights(query_token_logp):  # w(q) [B] or None; query_token_logp(targets) -> log-probs of query rows
            if self.args.query_weight != "current":
                return static_weight if self.args.query_weight == "static" else None
            with torch.no_grad():
                logp = torch.zeros(batch.targets.shape[0], dtype=torch.float32, device=advantages.device)
                logp[query_rows] = query_token_logp(batch.targets[query_rows])
                ell = per_sample_sum(logp, batch, kind=1)   # the kernels' fixed-order sums, as erpo's trainer
            return self._current_query_weights(ell)

        with self.accelerator.autocast():
            if self.args.fused_linear:
                hidden = final_hidden(model, batch)
            else:
                logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
                logits = logits.reshape(-1, logits.shape[-1])[batch.rows]
        if self.args.fused_linear:
            with gathered_lm_head(model) as (weight, bias):
                hidden = hidden.to(weight.dtype)
                query_weight = weights(lambda targets: fused_linear_token_logprobs(
                    hidden[query_rows].detach(), weight, targets, bias=bias, temperature=self.temperature))
                out = fused_linear_erpo_loss(hidden, weight, batch.targets, batch.token_kind, batch.sample_index,
                                             bias=bias, query_weight=query_weight, **tensors, **options)
        else:
            query_weight = weights(lambda targets: token_logprobs(logits[query_rows].detach(), targets,
                                                                  temperature=self.temperature))
            out = erpo_loss(logits, batch.targets, batch.token_kind, batch.sample_index, query_weight=query_weight,
                            **tensors, **options)
        self._log_loss_metrics(mode, inputs, rows, out, query_weight, options)
        return out.loss

    # Logging: TRL's own loss metrics (same names and reductions), then ERPO's

    def _log_loss_metrics(self, mode: str, inputs: dict, rows: CompletionRows, out, query_weight, options) -> None:
        metrics = self._metrics[mode]
        mask = rows.response_mask
        logp = rows.gather(out.token_logp)
        old = inputs.get("old_per_token_logps")
        log_ratio = logp - (logp if old is None else old)
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        ratio = torch.exp(log_ratio)
        advantages = inputs["advantages"].unsqueeze(1)

        def global_mean(values):
            total = self.accelerator.reduce(masked_mean(values, mask), reduction="sum")
            return (total[0] / total[1].clamp(min=1.0)).item()

        if self.beta != 0:
            ref = inputs["ref_per_token_logps"]
            kl = torch.expm1(ref - logp) - (ref - logp)
            metrics["kl"].append(global_mean(kl * ratio if self.args.use_bias_correction_kl else kl))
        metrics["entropy"].append(global_mean(rows.gather(out.entropy)))
        low = ((ratio < 1 - self.epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).float()
        metrics["clip_ratio/low_mean"].append(global_mean(low))
        metrics["clip_ratio/high_mean"].append(global_mean(high))
        metrics["clip_ratio/region_mean"].append(global_mean(torch.maximum(low, high)))

        def per_sequence(values):  # NaN for sequences without scored tokens, as TRL
            return values.squeeze(1) if values.shape[1] == 1 else (values * mask).sum(-1) / mask.sum(-1)

        for name, values, reduce in (("low_min", low, torch.min), ("high_max", high, torch.max)):
            gathered = self.accelerator.gather(per_sequence(values))
            gathered = gathered[~gathered.isnan()]
            metrics[f"clip_ratio/{name}"].append(reduce(gathered).item() if gathered.numel() else float("nan"))

        qkl_part = options["qkl_coef"] * out.metrics["qkl"] if options["qkl_coef"] != 0 else 0.0
        if self._entropy_bonus_enabled:  # TRL's loss before the bonus, on TRL's scale (per micro-batch, except dapo)
            policy_loss = out.loss.detach() + options["entropy_coef"] * out.metrics["entropy"] - qkl_part
            if mode == "train" and self.loss_type != "dapo":
                policy_loss = policy_loss * self.current_gradient_accumulation_steps
            metrics["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        num = inputs["prompt_ids"].shape[0]
        if not out.metrics["qkl"].isnan():  # the loss's qkl is a sum over samples / num_seqs
            metrics["qkl"].append(self.accelerator.gather(out.metrics["qkl"] * options["num_seqs"] / num).mean().item())
        metrics["query_logp"].append(self.accelerator.gather(out.query_logp.mean()).mean().item())
        if query_weight is not None:
            metrics["query_weight_mean"].append(self.accelerator.gather(query_weight.float().mean()).mean().item())
