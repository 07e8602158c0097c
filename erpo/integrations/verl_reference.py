"""ell_theta0(q) of verl's training prompts scored by the actor's own engine, on the actor's devices.

verl's driver holds no GPU; the actor workers do. Their `compute_log_prob` (what verl's trainer calls for the old
log-probs) runs the engine's forward without gradient (`TrainingWorker.infer_batch`: FSDP, the actor's mixed
precision and attention kernel, remove-padding, logits / temperature and verl's own cross entropy, or its fused
log-prob kernels with `use_fused_kernels`) on a batch of jagged token ids, sharded over the dp ranks as verl shards
any batch, and returns the log-probs of every position: row j of a sequence scores its token j + 1. Sent alone, a
prompt of P tokens gets rows 0 .. P - 2 scoring its tokens 2 .. P: the rows `erpo_ppo_loss` sums into ell_theta(q)
from prompt + response (`actor_rows`' query rows), scored by the same forward, so the Query-KL at theta0 is 0 up to
how the forward's rounding depends on what else is in the pack (tests/integrations/test_verl_integration.py measures
it). The first token is never scored, as in the loss.
"""
from __future__ import annotations

import logging

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from erpo.integrations.verl import check_fused_backend, check_fused_logits, fused_kernels_backend
from erpo.progress import progress
from erpo.sequences import scoring_precision
from erpo_kernels import sample_sums

ENGINE_PATH = "verl-engine"   # the scoring path a cache scored here records (`engine_precision`)
log = logging.getLogger("erpo")


def engine_precision(model_config, param_dtype: torch.dtype, device_type: str) -> str:
    """`scoring_precision` of ell_theta0(q) scored by verl's actor engine, with what else picks the forward's kernels:
    the actor's FSDP mixed-precision `param_dtype` (its forward under autocast in that dtype; fp32: no autocast),
    the path "verl-engine", the workers' `device_type` (verl's `trainer.device`), and of `model_config` (verl's
    `HFModelConfig` of `actor_rollout_ref.model`) the logit transform of its hf_config, the attention kernel,
    remove-padding (packed or padded forwards) and `use_liger` (verl 0.9.1's FSDP engine then swaps the model's
    RMSNorm, rotary embedding and SwiGLU MLP for Liger's Triton kernels, its fused cross entropy off: other kernels,
    other rounding). The attention kernel is the one verl 0.9.1's model config resolves and its FSDP engine builds
    the model with (`hf_config._attn_implementation`: `override_config.attn_implementation`, flash_attention_2 when
    unset), and verl's fused log-prob kernels (`fused_kernels_backend`: "off", or the backend that turns the hidden
    states into log-probs without the [T, V] logits; its torch backend keeps the log-probs of bf16 logits in fp32 where
    the logits path's CPU cross entropy rounds them to bf16). A cache records it; a run whose actor scores otherwise
    refuses the cache. Refused here, where every way to the cache passes (the `erpo` mode and `set_loss_fn` users):
    fused kernels of a backend the tests do not run (`check_fused_backend`) and on a model whose final-logit transform
    verl's fused forward drops (`check_fused_logits`).
    Not recorded, as they pick no other kernel, only which tokens share one (as the micro-batch size and the dp
    ranks do, in which the cache's calls already differ from the loss's): Ulysses sequence parallelism
    (`ulysses_sequence_parallel_size`: each rank's slice of the packed sequence, attention over the whole sequence
    for a share of the heads, in the same flash-attn kernel) and `model.tiled_mlp` (the MLP over row shards; which
    verl 0.9.1's FSDP engine does not apply: it calls `apply_monkey_patch` without `use_tiled_mlp`)."""
    backend = fused_kernels_backend(model_config)
    check_fused_backend(backend, tested="ell_theta0(q)", choices="impl_backend=torch or use_fused_kernels=false")
    check_fused_logits(backend, model_config.hf_config)
    autocast = None if param_dtype == torch.float32 else param_dtype
    scoring = scoring_precision(model_config.hf_config, param_dtype, device_type, path=ENGINE_PATH, autocast=autocast)
    return (f"{scoring},attention={model_config.hf_config._attn_implementation},"
            f"remove_padding={str(bool(model_config.use_remove_padding)).lower()},"
            f"liger={str(bool(model_config.use_liger)).lower()},fused_kernels={backend}")


def prompt_calls(lengths: list[int], *, multiple: int, tokens_per_call: int) -> list[list[int]]:
    """The prompts (indices into `lengths`, tokens each) of each `compute_log_prob` call: longest first, so that
    a call's prompts (and the engine's micro-batches) are of similar lengths, at most `tokens_per_call` tokens a
    call once padded (a longer prompt goes alone), each call padded to a multiple of `multiple` sequences with
    copies of its shortest prompt (verl splits a batch into equal parts per dp rank, and each rank's part into
    micro-batches of a fixed size), then dealt round-robin so that each of `multiple`'s consecutive parts gets
    prompts of every length in the call."""
    if multiple < 1 or tokens_per_call < 1:
        raise ValueError(f"multiple and tokens_per_call must be >= 1, got {multiple} and {tokens_per_call}")
    calls, current = [], []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        padded = -(-(len(current) + 1) // multiple) * multiple     # the call's sequences with this one, padded
        if current and padded * lengths[current[0]] > tokens_per_call:   # its first (longest) bounds each one's tokens
            calls.append(current)
            current = []
        current.append(index)
    if current:
        calls.append(current)
    padded_calls = [call + [call[-1]] * (-len(call) % multiple) for call in calls]
    return [[index for part in range(multiple) for index in call[part::multiple]] for call in padded_calls]


def prompts_batch(prompts: list[list[int]], temperature: float) -> TensorDict:
    """The TensorDict `compute_log_prob` takes for `prompts` alone, the fields verl 0.9.1's own
    `RayPPOTrainer._compute_old_log_prob` sends the worker group as a plain TensorDict (`left_right_2_no_padding`'s):
    jagged `input_ids`, `position_ids` (0 .. P - 1, a text model's) and `loss_mask` (the engine counts the batch's
    tokens by it), with the rollout `temperature`, no entropy and no loss (`compute_loss=False`: the actor's loss
    function is not called)."""
    def jagged(rows):
        return torch.nested.as_nested_tensor([torch.tensor(row, dtype=torch.long) for row in rows],
                                             layout=torch.jagged)
    data = TensorDict(input_ids=jagged(prompts), position_ids=jagged([range(len(p)) for p in prompts]),
                      loss_mask=jagged([[1] * len(p) for p in prompts]), batch_size=[len(prompts)])
    tu.assign_non_tensor(data, temperature=temperature, calculate_entropy=False, compute_loss=False)
    return data


def engine_query_logp(worker_group, prompts: list[list[int]], *, temperature: float, multiple: int,
                      tokens_per_call: int, show_progress: bool = True) -> list[float]:
    """ell_theta0(q) (nats) of each of `prompts` (token ids, as they reach the loss) under the weights the actor
    `worker_group` (verl's actor RayWorkerGroup) holds now, scored by its engine (`compute_log_prob`) at the rollout
    `temperature`, in calls of `prompt_calls` (`multiple`, `tokens_per_call`); each prompt's rows summed as the loss
    sums ell_theta(q) (erpo_kernels' `sample_sums`). A log line says what is scored, a progress line counts the
    prompts (`erpo.progress`)."""
    ell = [0.0] * len(prompts)
    calls = prompt_calls([len(p) for p in prompts], multiple=multiple, tokens_per_call=tokens_per_call)
    log.info(f"reference cache: scoring ell_theta0(q) of {len(prompts)} prompts ({sum(map(len, prompts))} tokens) "
             f"on the actor's engine, in {len(calls)} compute_log_prob calls")
    with progress(len(prompts), "reference cache ell_theta0(q) on the actor's engine", "prompt",
                  enabled=show_progress) as shown:
        for call in calls:
            log_probs = worker_group.compute_log_prob(prompts_batch([prompts[i] for i in call], temperature))
            log_probs = log_probs["log_probs"]
            lengths = log_probs.offsets().diff()
            if lengths.tolist() != [len(prompts[i]) for i in call]:
                raise ValueError("the actor's compute_log_prob returned sequences of other lengths than the prompts "
                                 "sent, or in another order: this verl release is not the one erpo is tested with")
            sample = torch.repeat_interleave(torch.arange(len(call)), lengths)
            position = torch.arange(len(sample)) - (log_probs.offsets()[:-1])[sample]
            query_rows = position < lengths[sample] - 1      # the last row scores what follows the prompt
            sums = sample_sums(torch.where(query_rows, log_probs.values().float(), 0.0), sample, len(call))
            for index, value in zip(call, sums.double().tolist()):
                ell[index] = value                          # a padding copy writes its prompt's own value again
            shown.update(len(set(call)))
    return ell
