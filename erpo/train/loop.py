"""ERPO training: the loop over rollout steps, in the order a reader follows it.

One *rollout step* samples `rollout_batch_size` prompts x n responses with the current policy, scores them
(`rollout_stage`) and splits them into `rollout_batch_size / update_batch_size` optimizer steps, each planned once
(`step_plan`): old log-probs from before the first update make the later ones off-policy, PPO-style. Each
optimizer step (`update_step`) accumulates micro-batches whose losses are normalized by the step's global token /
sample counts, so the sum is the full-batch loss on any number of ranks; `train_log` writes its metrics. All loss
math lives in erpo_kernels (`fused_linear_erpo_loss`).
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from erpo import distributed as D
from erpo.config import Config, dump_yaml, run_summary, updates_per_rollout
from erpo.errors import UserError
from erpo.models.export import HF_DIR, export_hf, is_hf_export, publish_hf
from erpo.models.loading import device_for_rank, load_model, model_path_for, tokenizer_for
from erpo.models.lora import MERGED_DIR, AdaptersDisabled, export_merged, held_parameters_line
from erpo.process_state import left_as_found
from erpo.reference.setup import precompute_reference
from erpo.rollout import rollout_engine_for
from erpo.sequences import logit_transforms
from erpo.storage_errors import stop_on_storage_failure
from erpo.tasks.data import PromptSet, load_prompt_set, prompt_set_identity
from erpo.tasks.trainer_progress import TrainerProgress
from erpo.train.checkpoint import CheckpointManager
from erpo.train.metrics import MetricsWriter
from erpo.train.preflight import CheckedRun, check_run
from erpo.train.rollout_stage import filtered_step_warning, rollout_stage
from erpo.train.run_dir import check_resumed_training_set, schedule_mismatch
from erpo.train.run_lock import RunLock, hold_run_dir
from erpo.train.step_plan import old_logprobs, plan_query_weights, plan_step
from erpo.train.stop import GracefulStop
from erpo.train.train_state import TrainState
from erpo.train.update_step import optimizer_step
from erpo.train.updater import Updater, choose_updater, deepspeed_config_for, make_updater

log = logging.getLogger("erpo")


class PromptSampler:
    """Shuffled passes over the training prompts; `state` (epoch, cursor) makes it resumable."""

    def __init__(self, num_prompts: int, seed: int, epoch: int = 0, cursor: int = 0):
        self.num_prompts, self.seed, self.epoch, self.cursor = num_prompts, seed, epoch, cursor
        self.drawn_at = epoch + cursor / num_prompts   # passes done where the last draw began (fractional)

    def _order(self) -> list[int]:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_prompts).tolist()

    def next(self, k: int) -> list[int]:
        """The next k prompt indices (a pass that cannot fill k is dropped: the next pass starts)."""
        if self.cursor + k > self.num_prompts:
            self.epoch, self.cursor = self.epoch + 1, 0
        out = self._order()[self.cursor:self.cursor + k]
        self.drawn_at = self.epoch + self.cursor / self.num_prompts
        self.cursor += k
        return out

    @property
    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}


@dataclass
class Run:
    """Everything a training run holds between rollout steps."""
    out_dir: Path
    checkpoints: CheckpointManager
    tokenizer: object
    prompts: PromptSet
    updater: Updater
    ref_model: torch.nn.Module | AdaptersDisabled | None   # the live reference for policy KL / k3-token (None when
                                                         # not needed; with LoRA: the policy, adapters off)
    engine: object                      # the rollout engine (erpo.rollout.engine.RolloutEngine)
    reward_fns: list
    ref_query_logp: torch.Tensor        # [Q] ell_theta0(q) of every training prompt (reference cache)
    static_weight: torch.Tensor         # [Q] w(q) of every training prompt (reference cache)
    state: TrainState                   # the run's counters (saved in checkpoints with the sampler's position)
    sampler: PromptSampler
    device: torch.device                # where this rank's micro-batches live
    lock: RunLock | None                # the run directory's lock (rank 0; None on the other ranks)
    logit_options: dict                 # the model's final-logit transform (kernel options), read once at setup


def seed_everything(cfg: Config) -> None:
    """Seed Python, NumPy and torch with trainer.seed and set torch's CPU threads (put back when `train` ends)."""
    if cfg.trainer.cpu_threads:
        torch.set_num_threads(cfg.trainer.cpu_threads)
    random.seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)


def check_batch_sizes(cfg: Config, num_prompts: int) -> None:
    """Batch-size constraints that depend on the data and the world size."""
    t = cfg.trainer
    if t.rollout_batch_size > num_prompts:
        raise UserError(f"trainer.rollout_batch_size ({t.rollout_batch_size}) exceeds the {num_prompts} "
                        "training prompts; lower it or add data", exit_code=2)
    if t.update_batch_size % D.world_size():
        raise UserError(f"trainer.update_batch_size ({t.update_batch_size}) must be a multiple of the world size "
                        f"({D.world_size()}): every rank gets the same number of prompts per optimizer step",
                        exit_code=2)


def build_models(cfg: Config, model_path: str, device) -> tuple[Updater, torch.nn.Module | AdaptersDisabled | None]:
    """The policy inside its updater, and the live reference model when the loss needs one (policy KL or the
    k3-token estimator). Under DeepSpeed at ZeRO-3 both are created partitioned over ranks. With LoRA
    (model.lora.rank > 0) the reference is the policy itself with its adapters switched off: no second model."""
    kind = choose_updater(cfg)
    ds_config = deepspeed_config_for(cfg) if kind == "deepspeed" else None
    # At ZeRO-3 the models are created partitioned (never whole on one GPU) while this object is alive.
    zero3_init = D.hf_deepspeed_config(ds_config) if ds_config is not None else None
    model = load_model(cfg, model_path, device, trainable=True)
    a, lora = cfg.algorithm, cfg.model.lora.rank > 0
    needs_ref_model = a.policy_kl_coef > 0 or a.qkl_estimator == "k3-token"
    ref_model = load_model(cfg, model_path, device, trainable=False) if needs_ref_model and not lora else None
    del zero3_init
    # DeepSpeed before any forward: at ZeRO-3 its hooks gather the partitioned weights.
    updater = make_updater(kind, model, cfg, cfg.trainer.max_steps * updates_per_rollout(cfg), ds_config)
    if lora:
        log.info(held_parameters_line(updater.model, reference_needed=needs_ref_model))
        return updater, AdaptersDisabled(updater.model) if needs_ref_model else None
    if ref_model is not None and ds_config is not None:
        ref_model = D.prepare_reference_model(ref_model, ds_config)  # ZeRO-3: partitioned inference engine
    return updater, ref_model


def restore_state(cfg: Config, checkpoints: CheckpointManager, updater: Updater, cache_id: str,
                  cache_path: str) -> dict:
    """The record of the newest checkpoint (`TrainState.checkpoint_record`; model, optimizer and schedule restored
    into `updater`), checked against this run: same reference cache, and an LR schedule of the same length unless
    it is constant."""
    state = checkpoints.load(updater.checkpoint_target)
    if state["reference_cache_id"] != cache_id:
        raise UserError(f"--resume: the checkpoint was trained against reference cache "
                        f"{state['reference_cache_id']}, but {cache_path} is {cache_id}; "
                        f"resume with the original cache")
    problem = schedule_mismatch(state.get("lr_schedule_steps"), cfg)   # also checked by check_run_dir, up front
    if problem:
        raise UserError(f"--resume {cfg.output_dir}: {problem}")
    log.info("resumed from %s at rollout step %d", checkpoints.latest(), state["rollout_step"])
    return state


def start_run(cfg: Config, resume: bool, force: bool = False, checked: CheckedRun | None = None) -> Run:
    """Check what the config alone decides (`checked`: `preflight.check_run`'s, run here when not given), set up
    ranks and seeds, lock the output dir (`force`: take the lock from a run that may be alive), load the data,
    models, reference cache and rollout engine, and restore the newest intact checkpoint when resuming."""
    checked = checked or check_run(cfg, resume=resume)
    out_dir = Path(cfg.output_dir)
    log.info("erpo train: %s (resolved config: %s)", run_summary(cfg), out_dir / "config.yaml")
    checkpoints = CheckpointManager(out_dir, keep_last=cfg.trainer.keep_last, keep_every=cfg.trainer.keep_every)
    D.init_distributed()
    seed_everything(cfg)
    model_path = model_path_for(cfg)   # a mistyped model name stops here, before the run directory is written
    tokenizer = tokenizer_for(cfg, model_path)
    lock = hold_run_dir(out_dir, force=force)   # before anything is written there; released at the end or exit
    if D.is_main():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_yaml(cfg))
    ps = load_prompt_set(cfg, tokenizer)
    training_set = prompt_set_identity(ps)
    if resume:
        check_resumed_training_set(cfg, training_set)
    check_batch_sizes(cfg, len(ps.prompt_ids))
    device = device_for_rank()
    # vLLM loads its own copy of the weights and sizes its memory from what is free: before DeepSpeed allocates.
    engine = rollout_engine_for(cfg, None, tokenizer, model_path) if cfg.rollout.engine == "vllm" else None
    updater, ref_model = build_models(cfg, model_path, device)
    cache, cache_path, (ref_query_logp, static_weight) = precompute_reference(
        cfg, model=updater.module, model_path=model_path, tokenizer=tokenizer, prompt_set=ps,
        cache_path=checked.cache_path)
    engine = engine or rollout_engine_for(cfg, updater.module, tokenizer, model_path)
    schedule_steps = cfg.trainer.max_steps * updates_per_rollout(cfg)
    state = TrainState(reference_cache_id=cache.cache_id, lr_schedule_steps=schedule_steps, training_set=training_set)
    sampler = PromptSampler(len(ps.prompt_ids), cfg.trainer.seed)
    if resume:
        record = restore_state(cfg, checkpoints, updater, cache.cache_id, cache_path)
        state = TrainState.from_checkpoint_record(record, lr_schedule_steps=schedule_steps, training_set=training_set)
        sampler = PromptSampler(len(ps.prompt_ids), cfg.trainer.seed, record["epoch"], record["cursor"])
        engine.sync_weights(updater.module)
    return Run(out_dir=out_dir, checkpoints=checkpoints, tokenizer=tokenizer, prompts=ps, updater=updater,
               ref_model=ref_model, engine=engine, reward_fns=checked.reward_fns, ref_query_logp=ref_query_logp,
               static_weight=static_weight, state=state, sampler=sampler, device=device, lock=lock,
               logit_options=logit_transforms(updater.model))


def save_checkpoint(cfg: Config, run: Run, progress: dict | None = None) -> str:
    """Checkpoint the model with `progress` (a `TrainState.checkpoint_record`; default: the current one)."""
    progress = progress or run.state.checkpoint_record(run.sampler.state)
    with stop_on_storage_failure(f"saving checkpoint step-{progress['rollout_step']}", run.checkpoints.root):
        return run.checkpoints.save(progress["rollout_step"], run.updater.checkpoint_target, progress,
                                    export=cfg.trainer.save_hf, tokenizer=run.tokenizer)


def finish_run(cfg: Config, run: Run) -> None:
    """The final checkpoint, its model exported to OUTPUT_DIR/final, and the training plot."""
    exported = Path(save_checkpoint(cfg, run)) / HF_DIR
    # The checkpoint's own export (rank 0 wrote it; ranks must agree) is linked, not gathered and written again.
    if D.all_gather_object(is_hf_export(exported))[0]:
        publish_hf(exported, run.out_dir / "final")
    else:
        export_hf(run.updater.model, run.tokenizer, run.out_dir / "final")
    if cfg.model.lora.rank and cfg.model.lora.export_merged:   # final/ holds the adapters, final/merged/ the model
        export_merged(run.updater.model, run.tokenizer, run.out_dir / "final" / MERGED_DIR)
    if cfg.logging.plot and D.is_main():
        from erpo.plotting import plot_runs  # matplotlib loads only when a run plots
        png = plot_runs([str(run.out_dir)], str(run.out_dir / "plots" / "training.png"))
        log.info("training curves: %s", png)


@left_as_found()
def train(cfg: Config, *, resume: bool = False, force: bool = False, checked: CheckedRun | None = None) -> str:
    """Run ERPO (or a baseline, per cfg.algorithm) and return the output dir (`checked`: `preflight.check_run`'s for
    this config and `resume`, where its caller ran it before loading this module). Writes config.yaml,
    reference_cache.json, metrics.jsonl, tb/, checkpoints/, final/ and plots/training.png there, holding its
    run.lock meanwhile (`force`: take it over from a run that may still be alive, see erpo.train.run_lock). Once it
    returns or raises, the process's `torch.nn.functional.linear` (which DeepSpeed ZeRO-3 replaces), CPU threads and
    launcher variables are as they were before (`left_as_found`)."""
    run = start_run(cfg, resume, force, checked)
    t, state, sampler, model = cfg.trainer, run.state, run.sampler, run.updater.model
    metrics = MetricsWriter(cfg, run.out_dir, resume=resume, total_steps=t.max_steps * updates_per_rollout(cfg),
                            done_steps=state.opt_step)
    with GracefulStop() as stop:
        while state.rollout_step < t.max_steps:
            started = time.time()
            before_rollout = state.checkpoint_record(sampler.state)   # a checkpoint of the not-yet-updated model
            # 1. Rollout: generate, reward and score this rank's share of the prompts of every optimizer step.
            seed = t.seed * 1_000_003 + state.rollout_step * 1009 + D.rank()
            prompts = sampler.next(t.rollout_batch_size)
            progress = TrainerProgress(global_step=state.opt_step, max_steps=state.lr_schedule_steps,
                                       epoch=sampler.drawn_at, is_world_process_zero=D.is_main(),
                                       is_local_process_zero=D.local_rank() == 0)
            rollouts = rollout_stage(cfg, run.engine, run.prompts, run.tokenizer, run.reward_fns, prompts, seed,
                                     progress)
            rollout_seconds = time.time() - started
            # 2. Micro-batches of every optimizer step, and the old (behaviour) log-probs of the later ones before
            #    the first update (the first step is on-policy: the loss detaches the current log-probs).
            plans = [plan_step(cfg, rollout, run.prompts, run.tokenizer.pad_token_id, run.device)
                     for rollout in rollouts]
            old_logp = [None] + [old_logprobs(plan, model, cfg.rollout.temperature, run.logit_options)
                                 for plan in plans[1:]]
            # 3. Optimizer steps.
            for u, plan in enumerate(plans):
                if plan.num_seqs == 0:
                    log.warning(filtered_step_warning(rollouts[u]))
                    continue
                try:
                    weights = plan_query_weights(cfg, plan, model, run.prompts, run.tokenizer.pad_token_id,
                                                 run.static_weight, run.logit_options)
                    record = optimizer_step(cfg, run.updater, run.ref_model, plan, old_logp[u], weights,
                                            run.ref_query_logp, state, run.logit_options)
                except FloatingPointError as exc:
                    if u > 0:  # earlier updates of this rollout were applied: the last checkpoint is the safe state
                        raise
                    raise FloatingPointError(f"{exc} Checkpoint of the model before this step: "
                                             f"{save_checkpoint(cfg, run, before_rollout)}") from None
                state.opt_step += 1
                record.update(step=state.opt_step, rollout_step=state.rollout_step + 1, epoch=sampler.epoch,
                              rollout_seconds=round(rollout_seconds, 3), step_seconds=round(time.time() - started, 3))
                run.engine.sync_weights(run.updater.module)
                metrics.write(record)
            state.rollout_step += 1
            if t.save_steps and state.rollout_step % t.save_steps == 0:
                save_checkpoint(cfg, run)
            if stop.should_stop():
                path = save_checkpoint(cfg, run)
                log.warning("stopped by signal after rollout step %d; checkpoint %s (resume with --resume)",
                            state.rollout_step, path)
                break
    metrics.close()
    if not stop.requested:
        finish_run(cfg, run)
    if run.lock is not None:
        run.lock.release()
    stop.raise_if_interrupted(f"stopped by Ctrl-C after rollout step {state.rollout_step}")
    if not stop.requested:   # a signal's stop said so above, with its checkpoint: the run is not done
        log.info("done: %s", run.out_dir)
    return str(run.out_dir)
