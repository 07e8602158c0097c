"""vLLM rollout engine (GPU): one vLLM engine per training rank, colocated with the trainer.

Optional dependency: `pip install "erpo[vllm]"`; vLLM is imported when a `VLLMRollout` is created, never at
package import. Only vLLM's public Python API is used: `vllm.LLM`, `vllm.SamplingParams`,
`LLM.generate`, `LLM.get_tokenizer`, `LLM.reset_prefix_cache`, `LLM.sleep` / `LLM.wake_up`, and for weight updates
`LLM.apply_model` (vLLM's public way to reach the in-process model) or, in versions without it, the
attribute chain `llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights` (the path TRL's
colocate mode uses). Checked against vLLM 0.10.2 and 0.33.0 (setup.py bounds the extra to that range).
vLLM's weight-transfer engines (`vllm.distributed.weight_transfer`, `init_weight_transfer_engine` /
`update_weights`) are not used: they move weights between processes (NCCL, CUDA IPC), need a
`WeightTransferConfig` at engine creation, and their protocol changed between 0.22, 0.29 and 0.32; here the
model lives in the trainer's own process.

Layouts (the trainer is launched with torchrun or deepspeed, one process per GPU):
- tensor_parallel_size=1: every rank runs its own engine on its own prompts
  (`distributed_executor_backend="external_launcher"`: vLLM reuses the launcher's process group).
- tensor_parallel_size=k > 1: consecutive groups of k ranks share one engine sharded over their k GPUs;
  each rank contributes its prompts, the group generates them all (same seed, same requests on every member,
  as vLLM requires), and every rank keeps its own samples.
- colocated=False (evaluation): one process drives an engine whose tensor_parallel_size workers vLLM starts
  itself (its default executor), for models too large for one GPU.
"""
from __future__ import annotations

import hashlib
import importlib
from collections.abc import Mapping
from typing import Any

import torch

from erpo import distributed as D
from erpo.config import check_vllm_temperature
from erpo.errors import MissingPackageError, setting_name, setting_value
from erpo.models.lora import inference_weights
from erpo.rollout.engine import RolloutBatch, RolloutEngine


def import_vllm():
    """The `vllm` module, or a MissingPackageError (an ImportError, one line on the command line) saying how to
    install it."""
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise MissingPackageError("rollout.engine 'vllm' needs vLLM on a CUDA machine: pip install 'erpo[vllm]' "
                                  f"(import failed: {exc})") from exc


def request_seed(seed: int, dp_rank: int, prompt: int) -> int:
    """The seed of one request (one prompt's n samples) of a `generate` seeded with `seed`, in [0, 2**62): a hash
    of (seed, data-parallel rank, prompt), the same on every run. vLLM seeds sample j with request seed + j, so
    seeds drawn this way share no sample seed with another call's or rank's (a collision needs two hashes within n
    of each other: about requests**2 * n / 2**62), where consecutive base seeds with linear offsets did: erpo
    train's rollout steps are 1009 apart, and step s + 1 reused the random draws of step s's later samples on
    other prompts."""
    digest = hashlib.blake2b(f"{seed},{dp_rank},{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def tp_all_gather_object(obj: Any) -> list[Any]:
    """Objects from every rank of this rank's vLLM tensor-parallel group, in group order."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    gathered: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, obj, group=group.device_group)
    return gathered


class VLLMRollout(RolloutEngine):
    """Sampling with vLLM; returns the sampled tokens' log-probs after temperature / top-p.

    model_path: an HF directory (or hub name) with the *initial* policy; the trainer must export its model
    there first (`erpo.models.export.export_hf`) when it starts from weights that are not on disk.
    tensor_parallel_size: GPUs per engine (colocated: must divide the world size). colocated: the engine lives
    in the launcher's processes (external_launcher, the training layouts above); False lets vLLM start its own
    workers for one calling process (evaluation). gpu_memory_utilization: fraction of
    each GPU vLLM may take (weights + KV cache), leave the rest to training: in (0, 1], as the caller checked it
    (`erpo.config.check_gpu_memory_utilization`). names: how the caller's user spells these keywords, which the
    errors use (`erpo eval`: {"gpu_memory_utilization": "--gpu-memory-utilization", ...}; a training run: the config
    keys, `rollout.gpu_memory_utilization`); a keyword absent names itself (`erpo.errors.setting_name`).
    enable_sleep_mode/sleep_level: `sleep()` frees the KV cache (level 1 also offloads weights to CPU; level 2, the
    default, discards them and
    the next `sync_weights` reloads them: the trainer overwrites every weight after each update anyway, so
    moving them back from CPU first would be wasted traffic). logprobs_mode "processed_logprobs" (vLLM >= 0.10.2)
    makes the returned
    log-probs those of the distribution actually sampled from (after temperature), as the loss's old_logp
    needs; they are renormalized over the top-p nucleus when top_p < 1 (erpo.config refuses top_p < 1 with the
    importance-sampling correction for that reason). llm_kwargs: any further `vllm.LLM` arguments
    (max_model_len, enforce_eager, ...).

    Create the engine before the trainer allocates GPU memory (DeepSpeed, optimizer states): vLLM reserves
    gpu_memory_utilization x total memory up front, and the constructor raises a ValueError naming that setting
    (through `names`) when less than that is free.
    """

    seeding = "vllm-2"   # `request_seed`'s hash of (seed, rank, prompt); 1 was linear offsets of the seed

    def __init__(self, model_path: str, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 dtype: str = "bfloat16", seed: int = 0, enable_prefix_caching: bool = True,
                 enable_sleep_mode: bool = False, sleep_level: int = 2,
                 logprobs_mode: str | None = "processed_logprobs", colocated: bool = True,
                 llm_kwargs: dict | None = None, names: Mapping[str, str] | None = None):
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
                or tensor_parallel_size < 1:
            raise ValueError(f"{setting_name(names, 'tensor_parallel_size')} must be an int >= 1, "
                             f"got {tensor_parallel_size!r}")
        if colocated and D.world_size() % tensor_parallel_size:
            raise ValueError(f"{setting_value(names, 'tensor_parallel_size', tensor_parallel_size)} must divide the "
                             f"world size {D.world_size()}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level!r}")
        vllm = import_vllm()
        check_free_gpu_memory(gpu_memory_utilization, setting_name(names, "gpu_memory_utilization"))
        self.sampling_params_cls = vllm.SamplingParams
        self.tensor_parallel_size = tensor_parallel_size
        self.colocated = colocated
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = sleep_level
        self.dp_rank = D.rank() // tensor_parallel_size if colocated else 0
        kwargs: dict[str, Any] = dict(model=model_path, tensor_parallel_size=tensor_parallel_size,
                                      gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                                      seed=seed + self.dp_rank, enable_prefix_caching=enable_prefix_caching,
                                      enable_sleep_mode=enable_sleep_mode)
        if logprobs_mode is not None:
            kwargs["logprobs_mode"] = logprobs_mode
        if colocated:
            # In-process engine (as TRL's colocate mode): vLLM joins the launcher's torch.distributed world, and
            # the model stays reachable for in-place weight updates. A single process gets a world of 1.
            D.set_launcher_env()
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(llm_kwargs or {})
        self.llm = vllm.LLM(**kwargs)
        self.eos_token_id = getattr(self.llm.get_tokenizer(), "eos_token_id", None)   # None: no tokenizer loaded
        self.asleep: set[str] = set()      # parts of the engine currently released: "weights", "kv_cache"
        self.weights_discarded = False     # level-2 sleep: weights must be synced before generating

    # -- generation
    def generate(self, prompt_ids, *, n, temperature, top_p=1.0, max_new_tokens, seed=None) -> RolloutBatch:
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("prompt_ids must be a non-empty list of non-empty token lists")
        if n <= 0 or max_new_tokens <= 0 or not 0 < top_p <= 1:
            raise ValueError(f"need n > 0, max_new_tokens > 0, 0 < top_p <= 1; got n={n}, "
                             f"max_new_tokens={max_new_tokens}, top_p={top_p}")
        check_vllm_temperature(temperature)
        if self.weights_discarded:
            raise RuntimeError("VLLMRollout: weights were discarded by sleep(level=2); call sync_weights(model) "
                               "before generate")
        self.wake_up()
        local = [list(map(int, p)) for p in prompt_ids]
        if self.colocated and self.tensor_parallel_size > 1:
            # vLLM needs identical requests on every member: all prompts, and the first member's seed.
            per_rank = tp_all_gather_object((local, seed))
            member = D.rank() % self.tensor_parallel_size
            offset = sum(len(share) for share, _ in per_rank[:member])
            prompts = [p for share, _ in per_rank for p in share]
            seed = per_rank[0][1]
        else:
            offset, prompts = 0, local
        params = [self.sampling_params(i, n, temperature, top_p, max_new_tokens, seed) for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params,
                                    use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        batch = RolloutBatch([], [], [], [], [])
        for i in range(offset, offset + len(local)):
            completions = sorted(outputs[i].outputs, key=lambda c: c.index)
            if len(completions) != n:
                raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {i}, expected n={n}")
            for completion in completions:
                tokens = list(completion.token_ids)
                batch.prompt_index.append(i - offset)
                batch.prompt_ids.append(prompts[i])
                batch.response_ids.append(tokens)
                batch.response_logp.append(sampled_logprobs(tokens, completion.logprobs))
                batch.truncated.append(ran_out(completion, self.eos_token_id))
        return batch

    def sampling_params(self, prompt: int, n: int, temperature: float, top_p: float, max_new_tokens: int,
                        seed: int | None):
        """`vllm.SamplingParams` for one prompt: n samples, log-prob of each sampled token (logprobs=0)."""
        return self.sampling_params_cls(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                        logprobs=0, seed=None if seed is None else request_seed(seed, self.dp_rank,
                                                                                                 prompt))

    # -- weights
    def model_loader(self):
        """`load_weights(iterable of (hf_name, tensor))` of the in-process vLLM model: through the public
        `LLM.apply_model` where this vLLM has it, else through the executor's attribute chain."""
        if hasattr(self.llm, "apply_model"):
            return lambda weights: self.llm.apply_model(lambda model: model.load_weights(weights))
        try:
            return self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights
        except AttributeError:
            raise RuntimeError("this vLLM version exposes neither LLM.apply_model nor llm_engine.model_executor."
                               "driver_worker.model_runner.model; cannot update weights in place") from None

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        """Copy the trainer's current parameters into vLLM, one parameter at a time (gathered from the
        ZeRO-3 shards when partitioned: collective, every rank calls it), then reset the prefix cache
        (cached KV of the old weights is stale). A LoRA model's adapters are merged on the way
        (`erpo.models.lora.inference_weights`): vLLM holds the plain model. Wakes the weights first if the engine
        sleeps."""
        if "weights" in self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")
        load_weights = self.model_loader()
        for name, weight in inference_weights(model):
            load_weights([(name, weight)])
        self.weights_discarded = False
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update (requests still hold "
                               "cached blocks); its cached KV of the old weights would be reused")

    # -- memory
    def sleep(self) -> None:
        """Free the KV cache (and offload or discard weights, per sleep_level) while the trainer updates;
        a no-op unless enable_sleep_mode."""
        if not self.enable_sleep_mode or self.asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self.asleep = {"weights", "kv_cache"}
        self.weights_discarded = self.sleep_level == 2

    def wake_up(self) -> None:
        """Re-allocate whatever `sleep` released (generate calls it itself)."""
        if not self.asleep:
            return
        self.llm.wake_up(tags=sorted(self.asleep))
        self.asleep.clear()


def check_free_gpu_memory(gpu_memory_utilization: float, setting: str) -> None:
    """ValueError naming `setting` (how its user gave gpu_memory_utilization) when this rank's GPU has less free
    memory than vLLM will reserve (gpu_memory_utilization x total); a no-op without CUDA."""
    if not torch.cuda.is_available():
        return
    free, total = torch.cuda.mem_get_info()
    if gpu_memory_utilization * total > free:
        raise ValueError(f"{setting}={gpu_memory_utilization} asks vLLM for "
                         f"{gpu_memory_utilization * total / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB of "
                         f"{total / 2**30:.1f} GiB are free (other processes, or the trainer's own allocations "
                         f"before the engine, hold the rest): set {setting} <= {int(free / total * 100) / 100:.2f}")


def ran_out(completion: Any, eos_token_id: int | None) -> bool:
    """Whether a vLLM completion reached max_tokens without ending in EOS (a truncated response, as HFRollout and
    TRL's `mask_truncated_completions` count them). vLLM says finish_reason "length", but versions that check the
    length before the EOS (0.10's `check_stop`) also say it for a response whose EOS is its last allowed token."""
    ends_in_eos = bool(completion.token_ids) and completion.token_ids[-1] == eos_token_id
    return completion.finish_reason == "length" and not ends_in_eos


def sampled_logprobs(tokens: list[int], logprobs: Any) -> list[float]:
    """Log-prob of each sampled token from vLLM's per-position {token_id: Logprob} dicts (logprobs=0)."""
    if logprobs is None or len(logprobs) != len(tokens):
        raise RuntimeError("vLLM did not return one log-prob entry per generated token (SamplingParams(logprobs=0))")
    values = []
    for token, entry in zip(tokens, logprobs):
        if token not in entry:
            raise RuntimeError(f"vLLM log-probs lack the sampled token {token}")
        values.append(float(entry[token].logprob))
    return values
