"""verl's real FSDP model engine on a CPU, for tests/integrations/test_verl_integration.py and bench/verl_step_time.py.

verl 0.9 knows no CPU platform: without an accelerator it falls back to 'nvidia' and fails in torch.cuda. A small
platform (device "cpu", backend gloo, no-op device calls), set as verl's platform when this module is imported, lets
`FSDPEngineWithLMHead` (FSDP2, gloo, world size 1, fp32) build and train a tiny Qwen2 exactly as a worker does on a
GPU. verl chooses its platform once per process, and its modules keep the device name of that choice from their
import on: import this module before anything imports verl (the tests do, through
`pytest.importorskip("bench.verl_engine")`); imported after verl chose another platform, it stops with that advice.
`actor_batch` builds the TensorDict verl's actor receives (left-right padded rollout, then `left_right_2_no_padding`),
with old / reference / rollout log-probs and advantages.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import socket
import unittest.mock

import torch

# `import verl` loads verl's plugins, and erpo's own (erpo.integrations.verl_trainer) imports verl's engine modules,
# which ask verl for its platform, 'nvidia' on a CPU, and keep device_name "cuda": so verl is first imported here
# with its plugins off (tests import what they use). Only for that import: a verl launched later in a child process
# inherits the environment, and loads erpo's trainer mode through that plugin.
_plugins = os.environ.get("VERL_USE_EXTERNAL_PLUGINS")
os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"
try:
    from tensordict import TensorDict
    from verl.plugin.platform import PlatformBase, platform_manager, set_platform
finally:
    if _plugins is None:
        del os.environ["VERL_USE_EXTERNAL_PLUGINS"]
    else:
        os.environ["VERL_USE_EXTERNAL_PLUGINS"] = _plugins

# verl's workers log the device's peak memory after a batch (`TrainingWorker._postprocess_output`) through the
# platform's device module, torch.cpu here, which keeps no such counters: 0. (verl recognizes torch.cpu by identity
# elsewhere, so the module itself stays.)
for counter in ("max_memory_allocated", "max_memory_reserved"):
    if not hasattr(torch.cpu, counter):
        setattr(torch.cpu, counter, lambda device=None: 0)


class CPUPlatform(PlatformBase):
    """verl's platform interface on the host CPU: tensors stay on "cpu", collectives go through gloo."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return "cpu"                                  # `tensor.to(get_device_id())` keeps tensors on the CPU

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


# verl's choice is `platform_manager._current_platform`, None until a module asks for it (`get_platform()` would
# make the choice): another platform already chosen is baked into verl's modules, past repair.
_chosen = platform_manager._current_platform
if _chosen is None:
    set_platform(CPUPlatform())
elif _chosen.device_name != "cpu":
    raise RuntimeError(f"bench.verl_engine: verl already chose its {_chosen.device_name!r} platform in this process "
                       "(`import verl` with its plugins on does): import bench.verl_engine before verl")


def init_process_group() -> None:
    """A gloo process group of world size 1 (once per process), on a free local port named in its init_method: no
    launcher variables (MASTER_ADDR, RANK, ...) are set, which verl's engine does not read, and which the processes
    that the caller launches later would inherit."""
    if torch.distributed.is_initialized():
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def build_engine(model_dir: str, *, use_remove_padding: bool = True, use_dynamic_bsz: bool = False,
                 micro_batch_size: int = 2, max_token_len: int = 64, lr: float = 1e-3, param_dtype: str = "fp32",
                 attn_implementation: str = "sdpa", fused_kernels: str | None = None):
    """verl's `FSDPEngineWithLMHead` around the HF model saved in `model_dir` (fp32 master weights; `param_dtype`
    "bf16": verl's mixed precision, the forward under bf16 autocast), as verl's actor worker configures it
    (remove-padding, dynamic batch size, micro-batch size, token budget: the same for updates and for
    `compute_log_prob`, verl's `rollout.log_prob_*`), initialized. `attn_implementation`: verl's
    `actor_rollout_ref.model.override_config.attn_implementation` (sdpa or eager: no flash-attn on a CPU).
    `fused_kernels`: verl's `actor_rollout_ref.model.use_fused_kernels=true` with that
    `fused_kernel_options.impl_backend` ("torch", "liger"; None: off). verl then replaces the forward of the model's
    class, for every model of that class in the process (`patch_forward_with_backends`); here the replacement is
    moved onto this engine's model (`confine_forward_patch`), so that the other engines and HF models of the same
    class in a test process keep their own forward, as a verl worker holds the actor's model alone."""
    from erpo.process_state import variables_as_found

    with variables_as_found(["TORCH_CUDA_ARCH_LIST"]):   # as erpo.integrations.verl_trainer imports verl's engine
        from verl.models.transformers import monkey_patch
        from verl.trainer.config import CheckpointConfig
        from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    init_process_group()
    fused = {} if fused_kernels is None else dict(use_fused_kernels=True,
                                                   fused_kernel_options={"impl_backend": fused_kernels})
    model = HFModelConfig(path=model_dir, use_remove_padding=use_remove_padding, enable_gradient_checkpointing=False,
                          override_config={"attn_implementation": attn_implementation}, **fused)
    engine = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", dtype="float32", use_torch_compile=False,
                              use_dynamic_bsz=use_dynamic_bsz, micro_batch_size_per_gpu=micro_batch_size,
                              max_token_len_per_gpu=max_token_len, use_remove_padding=use_remove_padding,
                              infer_micro_batch_size_per_gpu=micro_batch_size,
                              infer_max_token_len_per_gpu=max_token_len,
                              mixed_precision={"param_dtype": param_dtype, "reduce_dtype": "fp32",
                                               "buffer_dtype": "fp32"})
    engine.use_fused_kernels = model.use_fused_kernels   # as verl's TrainingWorker copies it from the model config
    optim = FSDPOptimizerConfig(lr=lr, clip_grad=1e9, total_training_steps=10, weight_decay=0.0)
    built = FSDPEngineWithLMHead(model_config=model, engine_config=engine, optimizer_config=optim,
                                 checkpoint_config=CheckpointConfig())
    # verl 0.9.1 patches TRL's AutoModelForCausalLMWithValueHead whenever TRL is importable, and TRL >= 1.0 no
    # longer has that class: the engine's model build (`apply_monkey_patch`, in `initialize` only) would fail with an
    # ImportError. The patch concerns value heads (critics) only, so the actor is built as without TRL; verl's own
    # check is back for whatever runs after.
    with unittest.mock.patch.object(monkey_patch, "is_trl_available", lambda: False):
        with confine_forward_patch(model.hf_config) as confine:
            built.initialize()
            confine(built.module)
    return built


@contextlib.contextmanager
def confine_forward_patch(hf_config):
    """Around the build of a model of `hf_config`'s class: whatever forward verl sets on that class (its fused-kernel
    forward) is put back to the class's own on leaving, and the yielded `confine(module)` first sets it on `module`
    alone (an instance attribute, which `module(...)` calls)."""
    import transformers
    model_class = getattr(transformers, hf_config.architectures[0])
    own = model_class.__dict__["forward"]

    def confine(module):
        patched = model_class.__dict__["forward"]
        if patched is not own:
            module.forward = patched.__get__(module)

    try:
        yield confine
    finally:
        model_class.forward = own


def hf_token_logp(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] log p(token t + 1 | ..t) of a padded batch under an HF causal LM (0 in the last column), no grad."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits.float()
    logp = torch.zeros(input_ids.shape, dtype=torch.float32)
    logp[:, :-1] = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logp


def actor_batch(model, prompts: list[list[int]], responses: list[list[int]], *, pad_id: int, seed: int = 0,
                tool_span: tuple[int, int, int] | None = (0, 1, 3), nested: bool = False,
                with_ref: bool = True, with_is: bool = True) -> TensorDict:
    """The TensorDict verl's actor receives for an update (as `ray_trainer._update_actor` builds it): prompts
    left-padded [B, P], responses right-padded [B, R], response_mask 0 after each response and on
    `tool_span` = (sample, start, stop) (a tool output), old / reference log-probs = `model`'s own plus noise (so
    ratios leave the clip range on both sides), per-sample advantages broadcast over the response, rollout
    importance-sampling weights; then `left_right_2_no_padding`. `nested`: prompts, responses and the response-aligned
    fields jagged, as verl's v1 trainer keeps them."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    num, width, length = len(prompts), max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.full((num, width), pad_id)
    response_ids = torch.full((num, length), pad_id)
    attention = torch.zeros((num, width + length), dtype=torch.long)
    response_mask = torch.zeros((num, length), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[i, width - len(p):] = torch.tensor(p)
        response_ids[i, :len(r)] = torch.tensor(r)
        attention[i, width - len(p):width + len(r)] = 1
        response_mask[i, :len(r)] = 1
    if tool_span is not None:
        response_mask[tool_span[0], tool_span[1]:tool_span[2]] = 0
    input_ids = torch.cat([prompt_ids, response_ids], 1)
    current = hf_token_logp(model, input_ids, attention)[:, width - 1:width + length - 1]
    advantages = torch.randn(num, generator=g)[:, None] * response_mask
    fields = dict(prompts=prompt_ids, responses=response_ids, input_ids=input_ids, attention_mask=attention,
                  position_ids=(attention.cumsum(1) - 1).clamp(min=0), response_mask=response_mask,
                  advantages=advantages, old_log_probs=current + 0.5 * torch.randn(num, length, generator=g))
    if with_ref:
        fields["ref_log_prob"] = current + 0.3 * torch.randn(num, length, generator=g)
    if with_is:
        fields["rollout_is_weights"] = torch.rand(num, length, generator=g) * 1.5 + 0.25
    data = left_right_2_no_padding(TensorDict(fields, batch_size=num))
    if nested:   # each response-aligned field cut to its response's length, as the v1 trainer's response_to_nested
        def jagged(tensor, lengths):
            return torch.nested.as_nested_tensor([row[:n] for row, n in zip(tensor, lengths)], layout=torch.jagged)
        response_lens = [len(r) for r in responses]
        for name in ("advantages", "old_log_probs", "ref_log_prob", "rollout_is_weights", "response_mask",
                     "responses"):
            if name in data.keys():  # noqa: SIM118 (a TensorDict)
                data[name] = jagged(data[name], response_lens)
        data["prompts"] = torch.nested.as_nested_tensor([p[width - len(q):] for p, q in zip(prompt_ids, prompts)],
                                                        layout=torch.jagged)
        del data["max_response_len"]   # the v1 trainer sets none: ppo_loss pads to the micro-batch's longest
    tu.assign_non_tensor(data, global_batch_size=num, temperature=1.0)
    return data


def set_engine_keys(engine, data: TensorDict, *, calculate_entropy: bool) -> TensorDict:
    """The non-tensor keys `TrainingWorker.train_batch` injects from the engine's config."""
    from verl.utils import tensordict_utils as tu
    config = engine.engine_config
    tu.assign_non_tensor(data, calculate_entropy=calculate_entropy, use_remove_padding=config.use_remove_padding,
                         use_dynamic_bsz=config.use_dynamic_bsz, max_token_len_per_gpu=config.max_token_len_per_gpu,
                         micro_batch_size_per_gpu=config.micro_batch_size_per_gpu,
                         use_fused_kernels=config.use_fused_kernels)
    return data


def loss_and_grads(engine, data: TensorDict, loss_fn) -> tuple[dict, dict]:
    """verl's forward + backward over the micro-batches of `data` with `loss_fn`, no optimizer step: (the engine's
    outputs: per-micro-batch losses and metrics, {parameter name: full gradient})."""
    with engine.train_mode():
        engine.optimizer_zero_grad()
        outputs = engine.forward_backward_batch(data.clone(), loss_fn, forward_only=False)
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for name, p in engine.module.named_parameters() if p.grad is not None}
        engine.optimizer_zero_grad()
    return outputs, grads


def sent(data):
    """`data` as a Ray actor receives it: serialized and read back (pickle, as Ray's object store does)."""
    return pickle.loads(pickle.dumps(data))


class EngineWorkerGroup:
    """verl's actor worker group around `engine`, in this process, for what erpo asks of it: `compute_log_prob`
    shards a TensorDict into `world_size` equal parts as verl's dispatch does (`BatchData.chunk`), runs verl's own
    `ActorRolloutRefWorker.compute_log_prob` (a worker built around the engine, without Ray) on each part, each
    way through a pickle round trip as Ray's object store serializes it (which also unlocks the parts `chunk`
    leaves locked), and joins the outputs in rank order as verl's collect does (`BatchData.concat`). Every part runs
    on the one engine (dp = 1 inside it). `calls` records the size of each batch it was sent; `set_loss_fn` records
    the loss functions set."""

    def __init__(self, engine, world_size: int = 1):
        from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
        actor = object.__new__(TrainingWorker)   # the attributes its infer_batch reads (TrainingWorker.__init__'s)
        actor.engine, actor.model_config, actor.engine_config = engine, engine.model_config, engine.engine_config
        actor.loss_fn, actor.flops_counter, actor.device_name = None, None, "cpu"
        self.worker = object.__new__(ActorRolloutRefWorker)
        self.worker.actor, self.worker.enable_routing_replay, self.worker.profiler = actor, False, None
        self.world_size = world_size
        self.calls: list[int] = []
        self.loss_fns: list = []

    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        from verl.protocol import BatchData
        self.calls.append(len(data))
        parts = BatchData(data).chunk(chunks=self.world_size)
        return BatchData([sent(self.worker.compute_log_prob(sent(part))) for part in parts]).concat()

    def set_loss_fn(self, loss_fn) -> None:
        self.loss_fns.append(loss_fn)
