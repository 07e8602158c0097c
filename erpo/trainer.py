"""ERPO training, end to end, in one file: rollout -> rewards -> advantages -> fused-linear ERPO loss -> update.

One *rollout step* samples `rollout_batch_size` prompts x n responses with the current policy, scores them and
splits them into `rollout_batch_size / update_batch_size` optimizer steps (old log-probs from before the first
update make the later ones off-policy, PPO-style). Each optimizer step accumulates micro-batches whose losses are
normalized by the step's global token / sample counts, so the sum is the full-batch loss on any number of ranks.
All loss math lives in erpo_kernels (`fused_linear_erpo_loss`); this file only feeds it.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from erpo import distributed as D
from erpo.advantages import compute_advantages, equal_reward_groups
from erpo.checkpoint import HF_DIR, CheckpointManager, GracefulStop, TorchBundle, export_hf, publish_hf
from erpo.config import Config, dump_yaml, updates_per_rollout
from erpo.data import PromptSet, load_prompt_set
from erpo.reference_cache import (ReferenceCache, build_reference_cache, compute_query_logp, model_fingerprint,
                                  template_id, tokenizer_fingerprint)
from erpo.rewards import compute_rewards, load_reward_function, math_reward
from erpo.sequences import final_hidden, pack, scored_token_logp
from erpo_kernels import fused_linear_erpo_loss, query_weights
from erpo_kernels.zero3 import gathered_lm_head

log = logging.getLogger("erpo")


# ----------------------------------------------------------------------------------------------- setup

def model_path_for(cfg: Config) -> str:
    """The pre-RL model theta0: the tiny model's cached SFT warm start, or `model.name_or_path`."""
    if cfg.model.name_or_path == "tiny":
        from erpo.sft import tiny_theta0
        path = tiny_theta0(cfg) if D.is_main() else None
        D.barrier()
        return path or tiny_theta0(cfg)
    return cfg.model.name_or_path


def load_tokenizer(cfg: Config, model_path: str):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def torch_dtype(cfg: Config) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, cfg.model.dtype)


def load_model(cfg: Config, model_path: str, device, *, trainable: bool):
    from transformers import AutoModelForCausalLM
    kwargs = {"dtype": torch_dtype(cfg)}
    if cfg.model.attn_implementation:
        kwargs["attn_implementation"] = cfg.model.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    if trainable:
        if cfg.model.gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.x name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        return model.to(device).train()
    model.requires_grad_(False)
    return model.to(device).eval()


def device_for_rank() -> torch.device:
    return torch.device("cuda", D.local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def reference_cache_path(cfg: Config) -> str:
    return cfg.reference.cache_path or os.path.join(cfg.output_dir, "reference_cache.json")


def reference_identity(cfg: Config, model_path: str, tokenizer) -> dict:
    """What a reference cache must have been built with for this run: `ReferenceCache.check_compatible`'s
    keyword arguments (model and tokenizer ids and fingerprints, prompt template and sampling temperature).
    Collective: rank 0 alone reads the weights for the model fingerprint and hands it to every rank."""
    model_fp = D.all_gather_object(model_fingerprint(model_path) if D.is_main() else None)[0]
    return {"model_id": model_path, "model_fp": model_fp,
            "tokenizer_id": str(tokenizer.name_or_path), "tokenizer_fp": tokenizer_fingerprint(tokenizer),
            "template": template_id(cfg.data.template, cfg.data.use_chat_template) +
            f"|temperature={cfg.rollout.temperature}"}


def precompute_reference(cfg: Config, *, overwrite: bool = False, model=None, model_path: str | None = None,
                         tokenizer=None, prompt_set: PromptSet | None = None
                         ) -> tuple[ReferenceCache, str, tuple[torch.Tensor, torch.Tensor]]:
    """Load the reference cache at `reference_cache_path(cfg)` and check it against this run, or build it with
    theta0 when it does not exist (or `overwrite`). Returns (cache, path, (ell_theta0 [Q], w [Q])): the cache's
    fp32 values for the prompt set's Q prompts (`cache.lookup`, done once here)."""
    D.init_distributed()
    model_path = model_path or model_path_for(cfg)
    tokenizer = tokenizer or load_tokenizer(cfg, model_path)
    prompt_set = prompt_set or load_prompt_set(cfg, tokenizer)
    path = reference_cache_path(cfg)
    if os.path.exists(path) and not overwrite:
        cache = ReferenceCache.load(path)
        cache.check_compatible(**reference_identity(cfg, model_path, tokenizer), path=path)
        values = cache.lookup(prompt_set.prompt_ids, path=path)
        log.info("reference cache: %s (%d prompts)", path, len(cache.entries))
        return cache, path, values
    log.info("reference cache: computing ell_theta0(q) for %d prompts with %s", len(prompt_set.prompt_ids), model_path)
    theta0 = model if model is not None else load_model(cfg, model_path, device_for_rank(), trainable=False)
    identity = reference_identity(cfg, model_path, tokenizer)   # after the load: a hub model's revision is cached
    cache = build_reference_cache(theta0, tokenizer, prompt_set.prompt_ids, model_id=model_path,
                                  template=identity["template"], batch_size=cfg.reference.batch_size,
                                  temperature=cfg.rollout.temperature, model_fp=identity["model_fp"],
                                  tokenizer_fp=identity["tokenizer_fp"])
    if D.is_main():
        cache.save(path)
    D.barrier()
    log.info("reference cache: wrote %s", path)
    return cache, path, cache.lookup(prompt_set.prompt_ids, path=path)


def choose_backend(cfg: Config) -> str:
    """"deepspeed" or "torch" for trainer.backend, with one log line saying which and why."""
    backend = cfg.trainer.backend
    if backend == "auto":
        backend = "deepspeed" if torch.cuda.is_available() else "torch"
        log.info("optimizer backend: %s (%s)", backend, "CUDA available" if backend == "deepspeed" else
                 "no CUDA device: plain torch AdamW with the same warmup + cosine schedule and clipping; "
                 "set trainer.backend=deepspeed to force DeepSpeed")
    else:
        log.info("optimizer backend: %s (trainer.backend)", backend)
    if backend == "torch":
        for key in ("zero_stage", "offload_optimizer", "offload_params"):
            if getattr(cfg.trainer, key):
                log.warning("trainer.%s=%s is ignored by the torch backend (ZeRO needs trainer.backend=deepspeed)",
                            key, getattr(cfg.trainer, key))
    if backend == "torch" and D.world_size() > 1:
        raise ValueError("trainer.backend 'torch' is single-process; use trainer.backend=deepspeed with several ranks")
    return backend


def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    """Multiplier of the base lr at optimizer step s: linear warmup, then cosine decay to min_lr_ratio."""
    warmup = int(round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def adamw_hyperparameters(cfg: Config) -> dict:
    """AdamW's lr, betas and weight decay from cfg.trainer (the torch and the DeepSpeed optimizer alike)."""
    t = cfg.trainer
    return {"lr": t.lr, "betas": (t.adam_beta1, t.adam_beta2), "weight_decay": t.weight_decay}


def deepspeed_config_for(cfg: Config) -> dict:
    """The run's DeepSpeed config (ZeRO stage, CPU offload, bf16, clipping, AdamW). Without a launcher, first sets
    up the environment of a one-rank group (DeepSpeed, and ZeRO-3 model creation, need a process group)."""
    t = cfg.trainer
    if not D.is_initialized():
        D.set_launcher_env()
    adam = adamw_hyperparameters(cfg)
    return D.deepspeed_config(zero_stage=t.zero_stage, bf16=torch_dtype(cfg) == torch.bfloat16,
                              offload_optimizer=t.offload_optimizer, offload_params=t.offload_params,
                              grad_clip=t.max_grad_norm, micro_batch=t.micro_batch_size, grad_accum=1,
                              optimizer={"type": "AdamW", "params": {**adam, "betas": list(adam["betas"])}})


class Updater:
    """AdamW + warmup/cosine + clipping behind one interface, as a DeepSpeed engine or plain torch."""

    def __init__(self, model, cfg: Config, backend: str, total_steps: int, ds_config: dict | None = None):
        """ds_config: `deepspeed_config_for(cfg)`, needed by the "deepspeed" backend."""
        t = cfg.trainer
        self.backend = backend
        self.max_grad_norm = t.max_grad_norm
        self.zero_stage = t.zero_stage
        schedule = lr_lambda(total_steps, t.warmup_ratio, t.min_lr_ratio)
        if backend == "deepspeed":
            import deepspeed
            self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config,
                lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        else:
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), **adamw_hyperparameters(cfg))
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    @property
    def module(self):
        """The transformers model (unwrapped)."""
        return self.model.module if self.backend == "deepspeed" else self.model

    @property
    def checkpoint_target(self):
        return self.model if self.backend == "deepspeed" else TorchBundle(self.model, self.optimizer, self.scheduler)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        if self.backend == "deepspeed":
            self.model.set_gradient_accumulation_boundary(last_micro_batch)
            self.model.backward(loss)
        else:
            loss.backward()

    def step(self) -> tuple[float, bool]:
        """Clip, apply AdamW and advance the schedule. Returns (global grad norm before clipping, applied); a
        non-finite norm skips the update where it can be seen before the step (torch, ZeRO-0)."""
        if self.backend == "deepspeed":
            norm = None
            if self.zero_stage == 0:  # gradients are whole (already all-reduced) on every rank
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                norm = float(torch.nn.utils.get_total_norm(grads))
                if not math.isfinite(norm):
                    self.discard()
                    return norm, False
            self.model.step()
            reported = self.model.get_global_grad_norm()
            return (float(reported) if reported is not None else norm), True
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm or float("inf")))
        if not math.isfinite(norm):
            self.discard()
            return norm, False
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, True

    def discard(self) -> None:
        """Drop the accumulated gradients without updating (a skipped step). Under ZeRO >= 1 the step goes through
        the engine, whose ZeRO optimizer treats non-finite gradients as an overflow: it skips the update and clears
        its partitioned gradient buffers, which `zero_grad` alone leaves behind to poison the next step. At ZeRO-0
        the gradients live on the parameters and `zero_grad` clears them."""
        if self.backend == "deepspeed":
            if self.zero_stage > 0:
                self.model.step()
            self.model.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)


def make_rollout_engine(cfg: Config, model, tokenizer, model_path: str):
    if cfg.rollout.backend == "vllm":
        from erpo.rollout_vllm import VLLMRollout
        return VLLMRollout(model_path, tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                           gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                           dtype="bfloat16" if torch_dtype(cfg) == torch.bfloat16 else "float32",
                           seed=cfg.trainer.seed, enable_sleep_mode=cfg.rollout.enable_sleep_mode,
                           llm_kwargs={"max_model_len": cfg.data.max_prompt_length + cfg.rollout.max_new_tokens})
    from erpo.rollout import HFRollout
    return HFRollout(model, tokenizer, batch_size=max(1, cfg.trainer.micro_batch_size))


class PromptSampler:
    """Shuffled passes over the training prompts; `state` (epoch, cursor) makes it resumable."""

    def __init__(self, num_prompts: int, seed: int, epoch: int = 0, cursor: int = 0):
        self.num_prompts, self.seed, self.epoch, self.cursor = num_prompts, seed, epoch, cursor

    def _order(self) -> list[int]:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_prompts).tolist()

    def next(self, k: int) -> list[int]:
        """The next k prompt indices (a pass that cannot fill k is dropped: the next pass starts)."""
        if self.cursor + k > self.num_prompts:
            self.epoch, self.cursor = self.epoch + 1, 0
        out = self._order()[self.cursor:self.cursor + k]
        self.cursor += k
        return out

    @property
    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}


# ------------------------------------------------------------------------------------------ one rollout

@dataclass
class Sample:
    prompt: int                # index into the PromptSet
    response_ids: list[int]
    completion: str
    reward: float
    correct: float
    truncated: bool
    advantage: float = 0.0
    keep: bool = True          # False: its group was filtered out (all rewards equal, filter_groups)
    rollout_logp: list[float] | None = None  # the rollout engine's log-prob of each response token


def score_rollout(cfg: Config, batch, ps: PromptSet, prompt_indices: list[int], tokenizer, reward_fns) -> list[Sample]:
    """Decode, reward and compute advantages for one rollout batch (samples grouped by prompt)."""
    prompts = [prompt_indices[i] for i in batch.prompt_index]
    completions = [tokenizer.decode(r, skip_special_tokens=True) for r in batch.response_ids]
    texts = [ps.prompts[p] for p in prompts]
    keys = sorted({k for p in set(prompts) for k in ps.records[p]})
    columns = {k: [ps.records[p].get(k) for p in prompts] for k in keys}
    columns["answer"] = [ps.answers[p] for p in prompts]
    columns["completion_ids"] = batch.response_ids
    rewards, _ = compute_rewards(reward_fns, cfg.reward.weights, texts, completions, columns)
    correct = math_reward(texts, completions, columns["answer"])
    n, a = cfg.rollout.n, cfg.algorithm
    reward_t = torch.tensor(rewards, dtype=torch.float32)
    advantages = compute_advantages(reward_t, n, estimator=a.advantage, scale_rewards=a.scale_rewards)
    flat = equal_reward_groups(reward_t, n).repeat_interleave(n).tolist() if a.filter_groups else [False] * len(rewards)
    if cfg.rollout.importance_sampling_correction and batch.response_logp is None:
        raise ValueError("rollout.importance_sampling_correction needs the rollout engine's sampling log-probs, but "
                         f"{cfg.rollout.backend!r} returned none; set rollout.importance_sampling_correction=false")
    rollout_logp = batch.response_logp if cfg.rollout.importance_sampling_correction else [None] * len(rewards)
    return [Sample(p, r, c, rw, cr, tr, float(adv), not f, lp) for p, r, c, rw, cr, tr, adv, f, lp in
            zip(prompts, batch.response_ids, completions, rewards, correct, batch.truncated, advantages.tolist(), flat,
                rollout_logp)]


def micro_batches(samples: list[Sample], size: int) -> list[list[Sample]]:
    """The kept samples in micro-batches of `size`. Every rank runs as many micro-batches as the busiest one (model
    forwards are collective under ZeRO-3): a rank with fewer gets empty ones, run as a stand-in with zero weight."""
    kept = [s for s in samples if s.keep]
    mbs = [kept[i:i + size] for i in range(0, len(kept), size)]
    most = D.all_reduce_max(len(mbs))
    return mbs + [[] for _ in range(most - len(mbs))]


def pack_samples(cfg: Config, mb: list[Sample], ps: PromptSet, pad_id: int, device):
    scored = [not (cfg.algorithm.mask_truncated and s.truncated) for s in mb]
    rollout_logp = [s.rollout_logp for s in mb] if cfg.rollout.importance_sampling_correction else None
    return pack([ps.prompt_ids[s.prompt] for s in mb], [s.response_ids for s in mb], pad_id, device, scored,
                rollout_logp)


def global_mean(total: float, count: float) -> float | None:
    total, count = D.all_reduce_sum(float(total)), D.all_reduce_sum(float(count))
    return total / count if count else None


def finite_or_none(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


# ------------------------------------------------------------------------------------------------ train

def train(cfg: Config, *, resume: bool = False) -> str:
    """Run ERPO (or a baseline, per cfg.algorithm) and return the output dir. Writes config.yaml,
    reference_cache.json, metrics.jsonl, tb/, checkpoints/, final/ and plots/training.png there."""
    out_dir = Path(cfg.output_dir)
    checkpoints = CheckpointManager(out_dir, keep_last=cfg.trainer.keep_last)
    if resume and checkpoints.latest() is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {out_dir / 'checkpoints'}")
    if not resume and checkpoints.latest() is not None:
        raise FileExistsError(f"{out_dir} already holds checkpoints (newest: {checkpoints.latest()}); continue that "
                              "run with --resume, or start a fresh one with another --output-dir")
    D.init_distributed()
    if D.is_main():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_yaml(cfg))
    seed = cfg.trainer.seed
    if cfg.trainer.cpu_threads:
        torch.set_num_threads(cfg.trainer.cpu_threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    device = device_for_rank()
    backend = choose_backend(cfg)
    t, a, r = cfg.trainer, cfg.algorithm, cfg.rollout

    model_path = model_path_for(cfg)
    tokenizer = load_tokenizer(cfg, model_path)
    ps = load_prompt_set(cfg, tokenizer)
    if t.rollout_batch_size > len(ps.prompt_ids):
        raise ValueError(f"trainer.rollout_batch_size ({t.rollout_batch_size}) exceeds the {len(ps.prompt_ids)} "
                         "training prompts")
    if t.update_batch_size % D.world_size():
        raise ValueError(f"trainer.update_batch_size ({t.update_batch_size}) must be a multiple of the world size "
                         f"({D.world_size()}): every rank gets the same number of prompts per optimizer step")
    ds_config = deepspeed_config_for(cfg) if backend == "deepspeed" else None
    # At ZeRO-3 the models are created partitioned (never whole on one GPU) while this object is alive.
    zero3_init = D.hf_deepspeed_config(ds_config) if ds_config is not None else None
    model = load_model(cfg, model_path, device, trainable=True)
    needs_ref_model = a.policy_kl_coef > 0 or a.qkl_estimator == "k3-token"
    ref_model = load_model(cfg, model_path, device, trainable=False) if needs_ref_model else None
    del zero3_init
    updates = updates_per_rollout(cfg)
    # DeepSpeed before any forward: at ZeRO-3 its hooks gather the partitioned weights.
    updater = Updater(model, cfg, backend, total_steps=t.max_steps * updates, ds_config=ds_config)
    if ref_model is not None and ds_config is not None:
        ref_model = D.prepare_reference_model(ref_model, ds_config)  # ZeRO-3: partitioned inference engine
    cache, cache_path, (ref_query_logp, static_weight) = precompute_reference(
        cfg, model=updater.module, model_path=model_path, tokenizer=tokenizer, prompt_set=ps)
    reward_fns = [load_reward_function(spec) for spec in cfg.reward.functions]

    rollout = make_rollout_engine(cfg, updater.module, tokenizer, model_path)
    pad_id = tokenizer.pad_token_id
    loss_options = dict(qkl_coef=a.qkl_coef, qkl_estimator=a.qkl_estimator, policy_kl_coef=a.policy_kl_coef,
                        clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip, ratio_level=a.ratio_level,
                        temperature=r.temperature, entropy_coef=a.entropy_coef, loss_agg=a.loss_agg,
                        log_ratio_clamp=a.log_ratio_clamp, rollout_is_cap=r.importance_sampling_cap)

    schedule_steps = t.max_steps * updates   # the LR schedule's length, in optimizer steps
    state = {"rollout_step": 0, "opt_step": 0, "epoch": 0, "cursor": 0, "nonfinite_skipped": 0,
             "reference_cache_id": cache.cache_id, "lr_schedule_steps": schedule_steps}
    if resume:
        state = checkpoints.load(updater.checkpoint_target)
        if state["reference_cache_id"] != cache.cache_id:
            raise ValueError(f"--resume: the checkpoint was trained against reference cache "
                             f"{state['reference_cache_id']}, but {cache_path} is {cache.cache_id}; "
                             f"resume with the original cache")
        saved_steps = state.get("lr_schedule_steps")   # None: a checkpoint from before it was recorded, not checked
        constant_lr = t.warmup_ratio == 0 and t.min_lr_ratio == 1   # the only schedule independent of its length
        if saved_steps is not None and saved_steps != schedule_steps and not constant_lr:
            original = (f"--max-steps {saved_steps // updates}" if saved_steps % updates == 0
                        else "the original trainer.max_steps and batch sizes")
            raise ValueError(f"--resume: the checkpoint's LR schedule (warmup + cosine) spans {saved_steps} optimizer "
                             f"steps, but this config's spans {schedule_steps} (trainer.max_steps={t.max_steps} x "
                             f"{updates} updates per rollout step): the run would not continue on its original "
                             f"schedule. Resume with {original}; only a constant LR (trainer.warmup_ratio=0, "
                             "trainer.min_lr_ratio=1) lets a run be extended")
        state["lr_schedule_steps"] = schedule_steps
        rollout.sync_weights(updater.module)
        log.info("resumed from %s at rollout step %d", checkpoints.latest(), state["rollout_step"])
    sampler = PromptSampler(len(ps.prompt_ids), seed, state["epoch"], state["cursor"])

    writer = None
    if cfg.logging.tensorboard and D.is_main():
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(str(out_dir / "tb"))
    # a fresh run starts its own log (a crash before the first checkpoint leaves nothing to continue); --resume
    # appends, and readers keep the last record of a step logged twice
    metrics_file = open(out_dir / "metrics.jsonl", "a" if resume else "w") if D.is_main() else None
    progress = None
    if cfg.logging.progress_bar and D.is_main():
        from tqdm.auto import tqdm
        progress = tqdm(total=t.max_steps * updates, initial=state["opt_step"], desc=f"{a.name} train", unit="step")

    def save_checkpoint(progress: dict | None = None) -> str:
        """Checkpoint the model with `progress` (default: the current state and sampler position)."""
        progress = progress or {**state, **sampler.state}
        return checkpoints.save(progress["rollout_step"], updater.checkpoint_target, progress, export=t.save_hf,
                                tokenizer=tokenizer)

    with GracefulStop() as stop:
        while state["rollout_step"] < t.max_steps:
            started = time.time()
            before_rollout = {**state, **sampler.state}   # what a checkpoint of the not-yet-updated model holds
            # 1. Rollout: every optimizer step's prompts are sharded over ranks, generated all at once.
            global_prompts = sampler.next(t.rollout_batch_size)
            local_chunks = [D.shard(global_prompts[u * t.update_batch_size:(u + 1) * t.update_batch_size],
                                    D.rank(), D.world_size()) for u in range(updates)]
            local_prompts = [p for chunk in local_chunks for p in chunk]
            rollout.wake_up()
            batch = rollout.generate([ps.prompt_ids[p] for p in local_prompts], n=r.n, temperature=r.temperature,
                                     top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                     seed=seed * 1_000_003 + state["rollout_step"] * 1009 + D.rank())
            rollout.sleep()
            samples = score_rollout(cfg, batch, ps, local_prompts, tokenizer, reward_fns)
            bounds = np.cumsum([0] + [len(c) * r.n for c in local_chunks])
            per_update = [samples[bounds[u]:bounds[u + 1]] for u in range(updates)]
            rollout_seconds = time.time() - started

            # 2. Old (behaviour) log-probs for the later optimizer steps of this rollout, before the first update
            #    (the first step is on-policy: the loss takes the current log-probs, detached, as old ones).
            old_logp = [None] + [[scored_token_logp(updater.model, pack_samples(cfg, mb or us[:1], ps, pad_id, device),
                                                    r.temperature) for mb in micro_batches(us, t.micro_batch_size)]
                                 for us in per_update[1:]]

            # 3. Optimizer steps.
            for u, update_samples in enumerate(per_update):
                try:
                    record = optimizer_step(cfg, updater, ref_model, update_samples, ps, pad_id, device, loss_options,
                                            ref_query_logp, static_weight, old_logp[u], state)
                except FloatingPointError as exc:
                    if u > 0:  # earlier updates of this rollout were applied: the last checkpoint is the safe state
                        raise
                    raise FloatingPointError(f"{exc} Checkpoint of the model before this step: "
                                             f"{save_checkpoint(before_rollout)}") from None
                if record is None:
                    continue
                state["opt_step"] += 1
                record.update(step=state["opt_step"], rollout_step=state["rollout_step"] + 1, epoch=sampler.epoch,
                              lr=record.pop("lr_used"), rollout_seconds=round(rollout_seconds, 3),
                              step_seconds=round(time.time() - started, 3))
                rollout.sync_weights(updater.module)
                if metrics_file is not None:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                if writer is not None:
                    for key, value in record.items():
                        if isinstance(value, (int, float)) and key != "step":
                            writer.add_scalar(f"train/{key}", value, record["step"])
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(reward=f"{record['reward']:.3f}", qkl=f"{record['qkl'] or 0:.4f}")
            state["rollout_step"] += 1
            if t.save_steps and state["rollout_step"] % t.save_steps == 0:
                save_checkpoint()
            if stop.should_stop():
                path = save_checkpoint()
                log.warning("stopped by signal after rollout step %d; checkpoint %s (resume with --resume)",
                            state["rollout_step"], path)
                break

    if progress is not None:
        progress.close()
    if writer is not None:
        writer.close()
    if metrics_file is not None:
        metrics_file.close()
    if not stop.requested:
        exported = Path(save_checkpoint()) / HF_DIR
        # The checkpoint's own export (rank 0 wrote it; ranks must agree) is linked, not gathered and written again.
        if D.all_gather_object(exported.joinpath("config.json").is_file())[0]:
            publish_hf(exported, out_dir / "final")
        else:
            export_hf(updater.model, tokenizer, out_dir / "final")
        if cfg.logging.plot and D.is_main():
            from erpo.plotting import plot_runs
            png = plot_runs([str(out_dir)], str(out_dir / "plots" / "training.png"))
            log.info("training curves: %s", png)
    log.info("done: %s", out_dir)
    return str(out_dir)


def optimizer_step(cfg: Config, updater: Updater, ref_model, samples: list[Sample], ps: PromptSet, pad_id: int,
                   device, loss_options: dict, ref_query_logp: torch.Tensor, static_weight: torch.Tensor,
                   old_logp: list[torch.Tensor] | None, state: dict) -> dict | None:
    """Accumulate the loss over micro-batches of `samples` and take one optimizer step. Returns the metrics record,
    or None when filtering left no sample on any rank (no step taken)."""
    t, a = cfg.trainer, cfg.algorithm
    mbs = micro_batches(samples, t.micro_batch_size)
    packed = [pack_samples(cfg, mb or samples[:1], ps, pad_id, device) for mb in mbs]  # [] runs a stand-in
    num_items = D.all_reduce_sum(sum(int((b.token_kind == 2).sum()) for mb, b in zip(mbs, packed) if mb))
    num_seqs = D.all_reduce_sum(sum(len(mb) for mb in mbs))
    num_kept = sum(s.keep for s in samples)
    record = {
        "reward": global_mean(sum(s.reward for s in samples), len(samples)),
        "accuracy": global_mean(sum(s.correct for s in samples), len(samples)),
        "response_length": global_mean(sum(len(s.response_ids) for s in samples), len(samples)),
        "truncated_frac": global_mean(sum(s.truncated for s in samples), len(samples)),
        "filtered_frac": global_mean(len(samples) - num_kept, len(samples)),
    }
    mean_sq = global_mean(sum(s.reward ** 2 for s in samples), len(samples))
    record["reward_std"] = math.sqrt(max(0.0, mean_sq - record["reward"] ** 2))
    if num_seqs == 0:
        log.warning("optimizer step skipped: every group of this batch has equal rewards (algorithm.filter_groups)")
        return None

    # w(q) of each micro-batch's samples (None: unweighted); a stand-in gets any valid weight
    prompts = [torch.tensor([s.prompt for s in mb or samples[:1]]) for mb in mbs]
    if a.query_weight == "static":
        mb_weights = [static_weight[index] for index in prompts]
    elif a.query_weight == "current":  # recomputed from the current policy over this step's samples
        # ell(q) needs the prompt rows only: one forward over the prompts of each micro-batch (stand-ins too)
        current = [compute_query_logp(updater.model, [ps.prompt_ids[i] for i in index.tolist()], pad_id=pad_id,
                                      batch_size=len(index), temperature=cfg.rollout.temperature)
                   for index in prompts]
        local = torch.cat([c for mb, c in zip(mbs, current) if mb] or [torch.zeros(0, dtype=torch.float64)])
        everyone = D.all_gather_object(local.tolist())
        all_w = query_weights(torch.tensor([v for part in everyone for v in part], dtype=torch.float64))
        offset = sum(len(part) for part in everyone[:D.rank()])
        mb_weights = [w if mb else torch.ones(1) for mb, w in
                      zip(mbs, all_w[offset:offset + len(local)].split([len(mb) for mb in mbs]))]
    else:
        mb_weights = [None] * len(mbs)
    weight_sum = sum(float(w.sum()) for mb, w in zip(mbs, mb_weights) if mb and w is not None)

    sums = {"loss": 0.0, "qkl": 0.0, "pg_loss": 0.0}
    token_weighted = {"entropy": 0.0, "clip_ratio": 0.0, "policy_kl": 0.0, "ratio_mean": 0.0,
                      "rollout_is_weight": 0.0, "rollout_logp_gap_abs": 0.0}
    rollout_gap_max = 0.0
    nonfinite = 0
    for m, (mb, batch) in enumerate(zip(mbs, packed)):
        run = mb or samples[:1]
        ref_logp = scored_token_logp(ref_model, batch, cfg.rollout.temperature) if ref_model is not None else None
        hidden = final_hidden(updater.model, batch)
        with gathered_lm_head(updater.model) as (weight, bias):
            out = fused_linear_erpo_loss(
                hidden, weight, batch.targets, batch.token_kind, batch.sample_index, bias=bias,
                advantages=torch.tensor([s.advantage for s in run], device=device),
                ref_query_logp=ref_query_logp[prompts[m]].to(device),
                query_weight=None if mb_weights[m] is None else mb_weights[m].to(device),
                old_logp=None if old_logp is None else old_logp[m], ref_logp=ref_logp,
                rollout_logp=batch.rollout_logp, num_items=num_items, num_seqs=num_seqs, **loss_options)
            if nonfinite or not torch.isfinite(out.loss):
                nonfinite += 1
            # Every rank runs every backward (ZeRO reduces gradients inside it, so skipping one would hang the
            # others): a stand-in, or a rank that has seen a non-finite loss, runs it with weight 0, and a
            # non-finite step is then discarded on all ranks below.
            scale = D.data_parallel_loss_scale() if mb and not nonfinite else 0.0
            updater.backward(out.loss * scale, m == len(mbs) - 1)
        if not mb:
            continue
        tokens = float(out.metrics["response_tokens"])
        sums["loss"] += float(out.loss.detach())
        sums["qkl"] += float(out.metrics["qkl"])
        sums["pg_loss"] += float(out.metrics["pg_loss"])
        for key, metric in (("entropy", "entropy"), ("clip_ratio", "clip_frac"), ("policy_kl", "policy_kl"),
                            ("ratio_mean", "ratio_mean"), ("rollout_is_weight", "rollout_is_weight"),
                            ("rollout_logp_gap_abs", "rollout_logp_gap_abs")):
            token_weighted[key] += float(out.metrics[metric]) * tokens
        rollout_gap_max = max(rollout_gap_max, float(out.metrics["rollout_logp_gap_max"]))
        del hidden, out

    lr_used = updater.lr
    bad = D.all_reduce_sum(int(nonfinite)) > 0
    grad_norm = float("nan")
    if bad:
        updater.discard()
    else:
        grad_norm, applied = updater.step()
        bad = not applied
        if applied and not math.isfinite(grad_norm):
            log.warning("DeepSpeed reported a non-finite grad norm at optimizer step %d (the step was applied)",
                        state["opt_step"] + 1)
    if bad:
        state["nonfinite_skipped"] += 1
        message = (f"non-finite loss or gradient at optimizer step {state['opt_step'] + 1} (rollout step "
                   f"{state['rollout_step'] + 1}); prompts {sorted({s.prompt for s in samples})[:8]}")
        if t.on_nonfinite == "stop":
            raise FloatingPointError(message + ". No update was applied for this step. Set trainer.on_nonfinite=skip "
                                     "to skip such steps; resume from the last checkpoint with --resume.")
        log.warning("%s: step skipped (%d skipped so far)", message, state["nonfinite_skipped"])
    record.update({
        "qkl": finite_or_none(D.all_reduce_sum(sums["qkl"])),
        "policy_kl": finite_or_none(D.all_reduce_sum(token_weighted["policy_kl"]) / max(num_items, 1)),
        "entropy": finite_or_none(D.all_reduce_sum(token_weighted["entropy"]) / max(num_items, 1)),
        "loss": finite_or_none(D.all_reduce_sum(sums["loss"])),
        "pg_loss": finite_or_none(D.all_reduce_sum(sums["pg_loss"])),
        "clip_ratio": finite_or_none(D.all_reduce_sum(token_weighted["clip_ratio"]) / max(num_items, 1)),
        "ratio_mean": finite_or_none(D.all_reduce_sum(token_weighted["ratio_mean"]) / max(num_items, 1)),
        "rollout_is_weight": finite_or_none(D.all_reduce_sum(token_weighted["rollout_is_weight"]) / max(num_items, 1)),
        "rollout_logp_gap_abs": finite_or_none(D.all_reduce_sum(token_weighted["rollout_logp_gap_abs"])
                                               / max(num_items, 1)),
        "rollout_logp_gap_max": (finite_or_none(D.all_reduce_max(rollout_gap_max))
                                 if cfg.rollout.importance_sampling_correction else None),
        "query_weight_mean": global_mean(weight_sum, num_seqs) if a.query_weight != "none" else None,
        "grad_norm": finite_or_none(grad_norm),
        "lr_used": lr_used,
        "num_samples": num_seqs,
        "response_tokens": num_items,
        "nonfinite_skipped": state["nonfinite_skipped"],
    })
    return record
