"""What applies the optimizer step: AdamW + linear warmup / cosine decay + gradient clipping, as plain torch (one
process) or as a DeepSpeed engine (ZeRO 0-3, any number of ranks), behind one small protocol (`Updater`).

`choose_updater(cfg)` resolves `trainer.updater` ("auto": DeepSpeed on CUDA, with several ranks or with ZeRO
asked for, else torch); `make_updater` builds it. The training loop only calls the protocol's methods.
"""
from __future__ import annotations

import logging
import math
from typing import Protocol

import torch

from erpo import distributed as D
from erpo.config import Config
from erpo.deepspeed_internals import skip_cpu_shm_op
from erpo.models.loading import torch_dtype
from erpo.train.checkpoint import TorchBundle

log = logging.getLogger("erpo")


class Updater(Protocol):
    """The optimizer side of training. `model` is what forwards run through (the model, or the DeepSpeed engine
    around it); `module` the transformers model itself; `checkpoint_target` what `CheckpointManager` saves."""

    model: torch.nn.Module

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def checkpoint_target(self): ...

    @property
    def lr(self) -> float: ...

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Accumulate the gradient of `loss` (`last_micro_batch`: the optimizer step's last backward)."""

    def step(self) -> tuple[float, bool]:
        """Clip, apply AdamW and advance the schedule: (global grad norm before clipping, applied)."""

    def discard(self) -> None:
        """Drop the accumulated gradients without updating (a skipped step)."""


def choose_updater(cfg: Config) -> str:
    """"deepspeed" or "torch" for trainer.updater, with one log line saying which and why. "auto" is DeepSpeed on
    CUDA, with several ranks (the torch updater is single-process) and when ZeRO is asked for (zero_stage > 0, which
    CPU offload needs); ZeRO-0 in one CPU process is what the torch updater computes."""
    t = cfg.trainer
    kind = t.updater
    if kind == "auto":
        reasons = [why for why, yes in (("CUDA available", torch.cuda.is_available()),
                                        (f"{D.world_size()} ranks", D.world_size() > 1),
                                        (f"trainer.zero_stage={t.zero_stage}", t.zero_stage > 0)) if yes]
        kind = "deepspeed" if reasons else "torch"
        log.info("optimizer updater: %s (%s)", kind, ", ".join(reasons) if reasons else
                 "one process, no CUDA device: plain torch AdamW with the same warmup + cosine schedule and "
                 "clipping; set trainer.updater=deepspeed to force DeepSpeed")
    else:
        log.info("optimizer updater: %s (trainer.updater)", kind)
    if kind == "torch":
        for key in ("zero_stage", "offload_optimizer", "offload_params"):
            if getattr(t, key):
                log.warning("trainer.%s=%s is ignored by the torch updater (ZeRO needs trainer.updater=deepspeed)",
                            key, getattr(t, key))
    if kind == "torch" and D.world_size() > 1:
        raise ValueError("trainer.updater 'torch' is single-process; use trainer.updater=deepspeed (or auto) with "
                         "several ranks")
    if kind == "deepspeed":
        skip_cpu_shm_op()  # before the first DeepSpeed call: ZeRO-3's partitioned model or initialize
    return kind


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


class TorchUpdater:
    """Plain torch AdamW + LambdaLR schedule + `clip_grad_norm_`, in one process."""

    def __init__(self, model, cfg: Config, total_steps: int):
        t = cfg.trainer
        self.model = model
        self.max_grad_norm = t.max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]   # with LoRA: the adapters
        self.optimizer = torch.optim.AdamW(self.params, **adamw_hyperparameters(cfg))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(total_steps, t.warmup_ratio, t.min_lr_ratio))

    @property
    def module(self):
        return self.model

    @property
    def checkpoint_target(self):
        return TorchBundle(self.model, self.optimizer, self.scheduler)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        loss.backward()

    def step(self) -> tuple[float, bool]:
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm or float("inf")))
        if not math.isfinite(norm):
            self.discard()
            return norm, False
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, True

    def discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class DeepSpeedUpdater:
    """A DeepSpeed engine (its AdamW from `ds_config`, our LambdaLR schedule); clipping is DeepSpeed's."""

    def __init__(self, model, cfg: Config, total_steps: int, ds_config: dict):
        import deepspeed
        t = cfg.trainer
        self.zero_stage = t.zero_stage
        schedule = lr_lambda(total_steps, t.warmup_ratio, t.min_lr_ratio)
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))

    @property
    def module(self):
        return self.model.module

    @property
    def checkpoint_target(self):
        return self.model

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        self.model.set_gradient_accumulation_boundary(last_micro_batch)
        self.model.backward(loss)

    def step(self) -> tuple[float, bool]:
        """A non-finite norm skips the update where it can be seen before the step (ZeRO-0: the gradients are whole,
        already all-reduced, on every rank); above ZeRO-0 DeepSpeed's own overflow check skips it."""
        norm = None
        if self.zero_stage == 0:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads))
            if not math.isfinite(norm):
                self.discard()
                return norm, False
        self.model.step()
        reported = self.model.get_global_grad_norm()
        return (float(reported) if reported is not None else norm), True

    def discard(self) -> None:
        """Under ZeRO >= 1 the step goes through the engine, whose ZeRO optimizer treats non-finite gradients as an
        overflow: it skips the update and clears its partitioned gradient buffers, which `zero_grad` alone leaves
        behind to poison the next step. At ZeRO-0 the gradients live on the parameters and `zero_grad` clears them."""
        if self.zero_stage > 0:
            self.model.step()
        self.model.zero_grad()


def make_updater(kind: str, model, cfg: Config, total_steps: int, ds_config: dict | None = None) -> Updater:
    """The updater `kind` ("torch" or "deepspeed", see `choose_updater`) around `model`; ds_config:
    `deepspeed_config_for(cfg)`, needed by "deepspeed". total_steps: the LR schedule's length in optimizer steps."""
    if kind == "deepspeed":
        return DeepSpeedUpdater(model, cfg, total_steps, ds_config)
    return TorchUpdater(model, cfg, total_steps)
