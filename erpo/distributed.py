"""Data-parallel plumbing: process group, rank queries, reductions, prompt sharding, DeepSpeed configs.

Every function works unchanged in a single process (no process group): rank 0 of a world of 1.
Launchers supported: `torchrun` and `deepspeed` (both export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT); `init_distributed()` reads them.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from erpo.deepspeed_internals import forget_process_groups, is_partitioned, skip_cpu_shm_op
from erpo.errors import MissingPackageError

ZERO_STAGES = (0, 1, 2, 3)


def is_initialized() -> bool:
    """True when a torch.distributed process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank of this process (0 without a process group)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of data-parallel processes (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def local_rank() -> int:
    """Rank of this process on its node, from the launcher's LOCAL_RANK (0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """True on global rank 0: the process that writes logs, metrics and exported models."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if is_initialized():
        dist.barrier()


def launched_distributed() -> bool:
    """True when a launcher (torchrun, deepspeed) started this process as one of WORLD_SIZE > 1 ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


# the variables a launcher (torchrun, deepspeed) exports to each rank, which set_launcher_env fills for one process
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def set_launcher_env() -> None:
    """RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as a launcher (torchrun, deepspeed) exports
    them: kept when set, else filled for a world of one process on a free local port (DeepSpeed and vLLM's
    external launcher mode need them even in a single process)."""
    defaults = {"RANK": str(rank()), "LOCAL_RANK": str(local_rank()), "WORLD_SIZE": str(world_size()),
                "MASTER_ADDR": "127.0.0.1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])


def default_communicator() -> str:
    """The process group's communication library: "nccl" when CUDA is available, else "gloo" (CPU runs and CI)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(communicator: str | None = None) -> bool:
    """Create the process group from the launcher's environment if WORLD_SIZE > 1; idempotent.

    Uses `deepspeed.init_distributed` when DeepSpeed is installed (it also sets up DeepSpeed's own comm
    layer; without CUDA, without building its shared-memory op: `skip_cpu_shm_op`), else
    `torch.distributed.init_process_group`. On CUDA, binds this process to GPU LOCAL_RANK.
    `communicator`: torch.distributed's backend, "nccl" / "gloo" / None (nccl with CUDA, gloo on CPU).
    Returns True when a group exists.
    """
    if is_initialized():
        return True
    if not launched_distributed():
        return False
    communicator = communicator or default_communicator()
    if communicator not in ("nccl", "gloo", "mpi", "ccl", "hccl"):
        raise ValueError(f"communicator must be one of nccl, gloo, mpi, ccl, hccl, got {communicator!r}")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    try:
        import deepspeed
    except ImportError:
        dist.init_process_group(backend=communicator)
    else:
        skip_cpu_shm_op()
        deepspeed.init_distributed(dist_backend=communicator)
    return True


def destroy_distributed() -> None:
    """Tear the process group down (call once at the end of a run, on every rank); no-op without one.
    Without it some backends abort at interpreter exit and the launcher reports a failed rank. DeepSpeed's cached
    copies of the world group are dropped with it, so a later run in the same process (`erpo compare`, tests)
    builds its engine on the new group instead of the destroyed one."""
    if is_initialized():
        dist.destroy_process_group()
    forget_process_groups()


def reduction_device() -> torch.device:
    """Device that collective tensors must live on: the current GPU under NCCL, else CPU."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(value: torch.Tensor | int | float, op: str) -> torch.Tensor | int | float:
    """`op` ("sum" or "max") over all ranks; returns a new value of the same kind (tensor in, tensor out on
    the same device; a Python number in, a Python number out). Identity in a single process."""
    if isinstance(value, bool) or not isinstance(value, (torch.Tensor, int, float)):
        raise TypeError(f"tensor must be a torch.Tensor, int or float, got {type(value).__name__}")
    if op not in ("sum", "max"):
        raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
    if not is_initialized():
        return value.clone() if isinstance(value, torch.Tensor) else value
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    if isinstance(value, torch.Tensor):
        reduced = value.detach().to(reduction_device(), copy=True)
        dist.all_reduce(reduced, op=reduce_op)
        return reduced.to(value.device)
    dtype = torch.int64 if isinstance(value, int) else torch.float64
    reduced = torch.tensor(value, dtype=dtype, device=reduction_device())
    dist.all_reduce(reduced, op=reduce_op)
    return type(value)(reduced.item())


def all_reduce_sum(tensor: torch.Tensor | int | float) -> torch.Tensor | int | float:
    """Sum over all ranks (see `all_reduce`). Use it for the global token-mean normalizers:
    `num_items = all_reduce_sum(local_response_tokens)`, `num_seqs = all_reduce_sum(local_samples)`."""
    return all_reduce(tensor, "sum")


def all_reduce_max(tensor: torch.Tensor | int | float) -> torch.Tensor | int | float:
    """Maximum over all ranks (see `all_reduce`). Under DeepSpeed every rank must run the same number of
    forward/backward passes per optimizer step (ZeRO-2 reduces gradients in every backward, ZeRO-3 gathers
    weights in every forward): `num_micro_batches = all_reduce_max(len(local_micro_batches))`, and ranks with
    fewer run the missing ones on padding with a zero-weighted loss."""
    return all_reduce(tensor, "max")


def data_parallel_loss_scale() -> int:
    """Factor to multiply a rank's loss by before backward when its normalizers are global.

    DeepSpeed (and DDP) average gradients over ranks. A per-rank loss whose denominators are the
    all-reduced `num_items` / `num_seqs` is that rank's share of the global loss (the shares sum to it), so
    the averaged gradient is 1/world_size of the single-process gradient unless scaled by world_size().
    """
    return world_size()


def all_gather_cat(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `tensor` [n_r] (lengths may differ) concatenated in rank order, [sum of n_r], on the
    tensor's device; a copy of it in a single process."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
        raise TypeError(f"tensor must be a 1-D torch.Tensor, got {getattr(tensor, 'shape', type(tensor).__name__)}")
    if not is_initialized():
        return tensor.clone()
    local = tensor.detach().to(reduction_device())
    sizes = [torch.zeros((), dtype=torch.int64, device=local.device) for _ in range(world_size())]
    dist.all_gather(sizes, torch.tensor(local.numel(), device=local.device))
    padded = torch.zeros(max(int(size) for size in sizes), dtype=local.dtype, device=local.device)
    padded[:local.numel()] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part[:int(size)] for part, size in zip(parts, sizes)]).to(tensor.device)


def all_gather_object(obj: Any) -> list[Any]:
    """Python objects from every rank, in rank order ([obj] in a single process)."""
    if not is_initialized():
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def shard(items: Sequence[Any], rank: int, world: int, *, group_size: int = 1) -> list[Any]:
    """This rank's contiguous share of `items`, never splitting a group of `group_size` consecutive items.

    items: the global batch in order, e.g. prompt records (group_size=1) or samples laid out prompt by
    prompt with `group_size` = responses per prompt; every group's responses then live on one rank, so
    group-relative advantages computed locally equal the single-process ones. Groups are split as evenly
    as possible (shares differ by at most one group); every rank gets at least one group.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if len(items) % group_size:
        raise ValueError(f"len(items)={len(items)} is not a multiple of group_size={group_size}")
    num_groups = len(items) // group_size
    if num_groups < world:
        raise ValueError(f"items hold {num_groups} groups, fewer than world={world}: every rank needs at least "
                         f"one group (raise the number of prompts per step or use fewer ranks)")
    base, extra = divmod(num_groups, world)
    first = rank * base + min(rank, extra)
    count = base + (1 if rank < extra else 0)
    return list(items[first * group_size:(first + count) * group_size])


def deepspeed_config(zero_stage: int = 2, bf16: bool = True, offload_optimizer: bool = False,
                     offload_params: bool = False, grad_clip: float | None = 1.0, micro_batch: int = 1,
                     grad_accum: int = 1, *, optimizer: dict | None = None) -> dict:
    """A DeepSpeed config dict for `deepspeed.initialize(config=...)`.

    zero_stage 0-3; bf16 mixed precision (fp32 master weights); offload_optimizer: optimizer states and
    step on CPU (ZeRO >= 1); offload_params: parameters on CPU (ZeRO-3 only); grad_clip: max global
    gradient norm (None or 0: off); micro_batch: sequences per rank per forward; grad_accum: micro-batches
    per optimizer step. optimizer: DeepSpeed optimizer section, e.g. {"type": "AdamW", "params": {"lr":
    1e-6, "weight_decay": 0.0}}; with offload_optimizer DeepSpeed wants it here (it then runs its CPU Adam)
    rather than a client torch optimizer. On a machine without CUDA an Adam / AdamW section gets `"torch_adam": true`
    (unless it sets it): DeepSpeed then steps torch.optim.AdamW, the same algorithm, instead of JIT-building its
    fused_adam C++ op, or under offload_optimizer its cpu_adam op (minutes of CPU, and a compiler; there the states
    are on the CPU either way); on CUDA the section is kept as given (FusedAdam, or DeepSpeedCPUAdam under offload).
    ZeRO-3 gathers 16-bit weights on save so exports are whole.
    """
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    if offload_params and zero_stage != 3:
        raise ValueError(f"offload_params needs zero_stage=3, got zero_stage={zero_stage}")
    if offload_optimizer and zero_stage == 0:
        raise ValueError("offload_optimizer needs zero_stage >= 1, got zero_stage=0")
    for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if grad_clip is not None and grad_clip < 0:
        raise ValueError(f"grad_clip must be >= 0 or None, got {grad_clip}")
    if optimizer is not None and not (isinstance(optimizer, dict) and "type" in optimizer):
        raise ValueError(f"optimizer must be a DeepSpeed optimizer dict with a 'type' key, got {optimizer!r}")
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage >= 1:
        zero.update(overlap_comm=torch.cuda.is_available(), contiguous_gradients=True, reduce_bucket_size=int(5e8))
    if zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True, stage3_param_persistence_threshold=int(1e4),
                    stage3_prefetch_bucket_size=int(5e7))
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": float(grad_clip or 0.0),
        "bf16": {"enabled": bool(bf16)},
        "zero_optimization": zero,
        # Client torch optimizers (e.g. SGD in tests) are allowed under ZeRO.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if optimizer is not None:
        adam = str(optimizer["type"]).lower() in ("adam", "adamw")
        if adam and not torch.cuda.is_available():
            optimizer = {**optimizer, "params": {"torch_adam": True, **optimizer.get("params", {})}}
        config["optimizer"] = optimizer
    return config


def hf_deepspeed_config(ds_config: dict):
    """At ZeRO-3, a live `transformers.integrations.HfDeepSpeedConfig` so that the next
    `from_pretrained` / `from_config` creates weights already partitioned across ranks; None below ZeRO-3.

    Keep the returned object referenced until the model exists (transformers holds it by weak reference):
        dschf = hf_deepspeed_config(cfg)
        model = AutoModelForCausalLM.from_pretrained(path)   # partitioned at birth under ZeRO-3
    Needs `accelerate` installed (transformers checks for it).
    """
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage != 3:
        return None
    if importlib.util.find_spec("accelerate") is None:
        raise MissingPackageError("ZeRO-3 model creation (transformers' HfDeepSpeedConfig) needs accelerate: "
                                  "pip install 'erpo[deepspeed]' (or pip install accelerate)")
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def prepare_reference_model(model: torch.nn.Module, ds_config: dict):
    """A frozen reference model laid out for `ds_config`'s ZeRO stage.

    At ZeRO-3: a DeepSpeed engine without optimizer whose weights stay partitioned over ranks (gathered layer
    by layer in forward; on CPU between uses when the config offloads parameters), so the reference costs
    1/world_size of its weights per GPU. Create `model` under `hf_deepspeed_config(ds_config)` so it is never
    whole on one rank. Forward is then collective: every rank must call it the same number of times.
    Below ZeRO-3: `model` itself (a full replica per rank). Either way in eval mode, requires_grad off.
    """
    model.requires_grad_(False)
    if ds_config.get("zero_optimization", {}).get("stage", 0) != 3:
        return model.eval()
    import copy

    import deepspeed

    config = copy.deepcopy(ds_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config["zero_optimization"].pop("offload_optimizer", None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # DeepSpeedEngine.eval returns None
    return engine


def is_deepspeed_engine(obj: Any) -> bool:
    """True for a `deepspeed.DeepSpeedEngine` (checked without importing DeepSpeed when it is not loaded)."""
    deepspeed = sys.modules.get("deepspeed")
    return deepspeed is not None and isinstance(obj, deepspeed.DeepSpeedEngine)


def is_zero3_param(param: torch.Tensor) -> bool:
    """True when `param` is partitioned by DeepSpeed ZeRO-3; it then needs `gathered`."""
    return is_partitioned(param)


def gathered(params: Sequence[torch.nn.Parameter]):
    """Context manager that materializes ZeRO-3 partitioned `params` on every rank (read-only); a no-op context
    for ordinary tensors. Collective: every rank must enter it with the same params. erpo's one wrapper of
    DeepSpeed's `GatheredParameters(modifier_rank=None)` (the kernels gather their lm_head with their own)."""
    partitioned = [p for p in params if is_zero3_param(p)]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
