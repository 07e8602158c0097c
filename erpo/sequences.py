"""Padded prompt + response batches, the model's final hidden states, and per-token log-probs through the
fused-linear path of erpo_kernels (the [B, L, V] logits are never built)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from erpo_kernels import fused_linear_token_logprobs, logit_transforms_from_config, sample_sums
from erpo_kernels.layout import from_padded, host_to_device
from erpo_kernels.lm_head import whole_lm_head
from erpo_kernels.zero3 import find_lm_head, is_zero3_partitioned


@dataclass
class PackedBatch:
    """B sequences (prompt + response) right-padded to [B, L], and the scored rows of erpo_kernels' layout.

    `rows` [B * L] bool selects the scored rows (query or response); targets / token_kind / sample_index are
    already restricted to them, so hidden.reshape(-1, D)[rows] lines up with them row for row. `row_index` [R] int64,
    when given, holds the same rows' positions, ascending (whoever changes rows must change or drop it):
    `final_hidden` then selects them without a host read. `host_layout` [2, R] int64 in host memory, when given, holds
    token_kind and sample_index as the host built or read them: `fused_linear_erpo_loss` plans its chunks on it
    without a host read of its own.
    """
    input_ids: torch.Tensor        # [B, L]
    attention_mask: torch.Tensor   # [B, L]
    rows: torch.Tensor             # [B * L] bool
    targets: torch.Tensor          # [R]
    token_kind: torch.Tensor       # [R] 1 query, 2 response
    sample_index: torch.Tensor     # [R] in [0, B)
    rollout_logp: torch.Tensor | None = None  # [R] fp32: the rollout engine's log-probs on response rows, else 0
    row_index: torch.Tensor | None = None     # [R] int64: the positions rows selects (no host read to select them)
    host_layout: torch.Tensor | None = None   # [2, R] int64, host memory: token_kind and sample_index (no read to plan)


def to_device_together(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Integer or bool host tensors on `device` in one upload (`erpo_kernels.layout.host_to_device` of their
    concatenation as int64: no wait), each in its own shape and dtype: the same values."""
    together = host_to_device(torch.cat([t.reshape(-1).long() for t in tensors]), device)
    parts = together.split([t.numel() for t in tensors])
    return [part.reshape(t.shape).to(t.dtype) for part, t in zip(parts, tensors)]


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, device,
         response_scored: list[bool] | None = None,
         response_logp: list[list[float]] | None = None) -> PackedBatch:
    """Right-pad prompt + response token lists into a PackedBatch on `device`: built on the host from the lists,
    uploaded in one copy without a wait (`to_device_together`). A sample whose `response_scored`
    entry is False keeps its query rows but its response rows are not scored.
    `response_logp` (one log-prob per response token, from the rollout engine) becomes `rollout_logp`."""
    if len(prompt_ids) != len(response_ids) or not prompt_ids:
        raise ValueError(f"prompt_ids and response_ids must be non-empty and of equal length, got "
                         f"{len(prompt_ids)} and {len(response_ids)}")
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    width = max(lengths)
    pairs = list(zip(prompt_ids, response_ids, lengths))
    ids = torch.tensor([[*p, *r] + [pad_id] * (width - n) for p, r, n in pairs], dtype=torch.long)
    attn = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], dtype=torch.long)
    resp = torch.tensor([[0] * len(p) + [1] * len(r) + [0] * (width - n) for p, r, n in pairs], dtype=torch.long)
    sampled_logp = None if response_logp is None else torch.zeros((len(pairs), width), dtype=torch.float32)
    for i, (p, r, _) in enumerate(pairs):
        if sampled_logp is not None:  # the row at position t predicts token t + 1
            if len(response_logp[i]) != len(r):
                raise ValueError(f"sample {i}: {len(response_logp[i])} rollout log-probs for {len(r)} response tokens")
            sampled_logp[i, len(p) - 1:len(p) + len(r) - 1] = torch.tensor(response_logp[i], dtype=torch.float32)
    packed = from_padded(ids, attn, resp)
    if response_scored is not None:   # masked responses stay in the input but their rows are not scored
        masked = ~torch.tensor(response_scored, dtype=torch.bool)
        packed.token_kind[(packed.token_kind == 2) & masked[packed.sample_index]] = 0
    rows = packed.token_kind != 0
    host_layout = torch.stack((packed.token_kind[rows], packed.sample_index[rows]))  # built here: nothing to read
    input_ids, attention_mask, on_device_rows, targets, layout, row_index = to_device_together(   # one upload, no wait
        [ids, attn, rows, packed.targets[rows], host_layout, rows.nonzero().squeeze(1)], device)
    return PackedBatch(input_ids, attention_mask, on_device_rows, targets, layout[0], layout[1],
                       None if sampled_logp is None else host_to_device(sampled_logp.reshape(-1)[rows], device),
                       row_index, host_layout)


def final_hidden(model, batch: PackedBatch) -> torch.Tensor:
    """Final (post-norm) hidden states of the scored rows, [R, D]. `model` is a causal LM or a DeepSpeed engine
    around one; only the last position's logits are computed (logits_to_keep=1)."""
    return final_hidden_and_output(model, batch)[0]


def final_hidden_and_output(model, batch: PackedBatch, **forward_kwargs):
    """(final_hidden's [R, D], the model's whole output): `forward_kwargs` go to the forward, e.g.
    output_router_logits=True for an MoE model's `aux_loss`. The forward is `last_hidden_and_output`'s."""
    hidden_states, out = last_hidden_and_output(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                                **forward_kwargs)
    return scored_rows(hidden_states, batch), out


def last_hidden_and_output(model, **model_inputs):
    """(the decoder's last_hidden_state [B, L, D], the model's whole output) of one forward of `model` (a causal LM,
    a PEFT model or a DeepSpeed engine around one) on `model_inputs` (input_ids [B, L], and attention_mask,
    position_ids, output_router_logits, ... as the model takes them); only the last position's logits are computed
    (logits_to_keep=1).

    The causal LM's own forward runs (a PEFT model's adapters, a DeepSpeed engine's ZeRO-3 hooks, an MoE's router
    logits), and a forward hook on its decoder (`get_decoder()`) keeps the decoder's `last_hidden_state` [B, L, D]:
    the post-norm tensor the lm_head reads, the very tensor `output_hidden_states=True` returned as
    `hidden_states[-1]`, without every layer's hidden states held until the forward returns (L x [B, L, D] more
    peak memory under no_grad)."""
    decoder = getattr(model, "module", model).get_decoder()
    kept = []

    def keep_last_hidden(module, args, output):
        kept.append(getattr(output, "last_hidden_state", None))

    handle = decoder.register_forward_hook(keep_last_hidden)
    try:
        out = model(**model_inputs, logits_to_keep=1, use_cache=False)
    finally:
        handle.remove()
    if len(kept) != 1 or kept[0] is None:   # refused, never guessed: transformers' causal LMs run it once
        raise ValueError(f"the forward of {type(model).__name__} ran its decoder ({type(decoder).__name__}, its "
                         f"get_decoder()) {len(kept)} times, not once with a last_hidden_state: erpo reads the final "
                         "hidden states of a causal LM whose forward does, as transformers' causal LMs do")
    return kept[0], out


def scored_rows(hidden_states: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """The scored rows [R, D] of the batch's hidden states [B, L, D]."""
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    if batch.row_index is not None:  # no host read, and a backward that adds rather than a boolean index_put
        return hidden.index_select(0, batch.row_index)
    return hidden[batch.rows]


def logit_transforms(model) -> dict:
    """The model's own final-logit transform as the kernels' options {"logit_scale", "logit_softcap"}, read from its
    config (`model` a causal LM, a PEFT model or a DeepSpeed engine around one). ValueError, one line, on a transform
    `erpo_kernels.logit_transforms_from_config` does not know: it is refused, never ignored."""
    return logit_transforms_from_config(getattr(model, "module", model).config)


def scoring_precision(config, dtype: torch.dtype, device: torch.device | str, *, path: str = "fused-linear",
                      autocast: torch.dtype | None = None) -> str:
    """What determines a scored log-prob's numbers besides the weights, the tokens and the temperature, as one
    string: the weights' `dtype`, the forward's autocast dtype (None: off), the scoring `path` ("fused-linear":
    hidden @ lm_head in the kernels; "logits": the model's own logits), the device type (it picks the kernels'
    backend) and the logit transform of the model `config`. A reference cache records it, and a run that scores
    otherwise refuses the cache."""
    transforms = logit_transforms_from_config(config)
    cast = "off" if autocast is None else str(autocast).removeprefix("torch.")
    return (f"dtype={str(dtype).removeprefix('torch.')},autocast={cast},path={path},"
            f"device={torch.device(device).type},logit_scale={transforms['logit_scale']},"
            f"logit_softcap={transforms['logit_softcap']}")


def model_precision(model, **kwargs) -> str:
    """`scoring_precision` of a loaded model (its config, and its first parameter's dtype and device)."""
    param = next(model.parameters())
    return scoring_precision(getattr(model, "module", model).config, param.dtype, param.device, **kwargs)


@torch.no_grad()
def scored_token_logp(model, batch: PackedBatch, temperature: float = 1.0, autocast=None,
                      logit_options: dict | None = None) -> torch.Tensor:
    """Log-probs [R] fp32 (nats) of the scored rows' targets under `model`, without gradient: the forward under
    `autocast` (a context manager factory, e.g. accelerate's `accelerator.autocast`; None: off), then
    hidden @ lm_head with the model's logit transform, outside autocast, as the loss scores. `logit_options`: that
    transform as read once by the caller (`logit_transforms`); None: read from the model's config here."""
    with (autocast or contextlib.nullcontext)():
        hidden = final_hidden(model, batch)
    return head_token_logprobs(model, hidden, batch.targets, temperature=temperature, logit_options=logit_options)


def head_token_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                        logit_options: dict | None = None, return_entropy: bool = False, validate: bool = True):
    """Log-probs [R] fp32 (nats) of `targets` [R] (-100: unscored, 0) under `model`'s lm_head on its final hidden
    states `hidden` [R, D], with the model's logit transform and `temperature`, the [R, V] logits never built
    (`erpo_kernels.fused_linear_token_logprobs`, on the head's dtype); with `return_entropy`
    also each row's entropy [R] fp32 (nats). Differentiable in hidden and the head, on the whole head
    (`on_whole_lm_head`): under DeepSpeed ZeRO-3 as the lm_head's own forward, so the backward may run whenever;
    otherwise the head is whole inside this call only (under FSDP2 run it without gradient). `logit_options`: the
    transform as read once by the caller (`logit_transforms`); None: read from the model's config here. `validate`
    as the kernels' (False: the targets are known to lie in the vocabulary, no host read)."""
    options = logit_transforms(model) if logit_options is None else logit_options

    def score(weight, bias, hidden, targets):   # the kernels are custom ops: a caller's autocast does not reach them
        return fused_linear_token_logprobs(hidden.to(weight.dtype), weight, targets, bias=bias,
                                           temperature=temperature, return_entropy=return_entropy, validate=validate,
                                           **options)

    with on_whole_lm_head(model) as run:
        return run(score, hidden, targets)


@contextlib.contextmanager
def on_whole_lm_head(model):
    """Yield `run(compute, *inputs)`, which returns `compute(weight [V, D], bias [V] or None, *inputs)` on the whole
    lm_head of `model` (a causal LM, a PEFT model or a DeepSpeed engine around one), its gradient reaching the head
    whenever the backward runs.

    Under DeepSpeed ZeRO-3 each run is the lm_head's own forward (`call_as_forward`): DeepSpeed gathers the head for
    it, releases it after, gathers it again when the backward reaches the result and reduce-scatters the head's
    gradient (summed with the input embedding's when tied). DeepSpeed finds the result only as a tensor or a tuple
    of tensors (a dataclass it passes over, and its backward would meet an empty head), and releases the head again
    once the backward has passed the positional `inputs` that need a gradient. Otherwise the head is whole for the
    block (`whole_lm_head`): under FSDP2, run the backward inside it."""
    head = find_lm_head(model)
    if is_zero3_partitioned(head.weight):   # read inside the call, where DeepSpeed's hooks have gathered them
        def run(compute, *inputs):
            return call_as_forward(head, lambda *rows: compute(head.weight, getattr(head, "bias", None), *rows),
                                   *inputs)
        yield run
        return
    with whole_lm_head(model) as (weight, bias):
        yield lambda compute, *inputs: compute(weight, bias, *inputs)


def call_as_forward(module: torch.nn.Module, forward, *inputs: torch.Tensor):
    """`forward(*inputs)` run as `module`'s own forward: `module(*inputs)` with its forward replaced for this call, so
    that the hooks registered on the module run around it as around its forward. DeepSpeed ZeRO-3's do what a
    computation reading the module's parameters outside its forward needs: gather them before, release them after,
    and, on the outputs, gather them again when the backward reaches them (released once it has passed the inputs),
    their gradients reduce-scattered into the shards as for any use in a forward."""
    replaced = module.__dict__.get("forward")   # a forward set on the instance (a wrapper's) is put back after
    module.forward = forward
    try:
        return module(*inputs)
    finally:
        if replaced is None:
            del module.forward
        else:
            module.forward = replaced


def per_sample_sum(values: torch.Tensor, batch: PackedBatch, kind: int) -> torch.Tensor:
    """Sum of `values` [R] over the rows of token kind `kind` of each sample, [B] (fp32 sums, as float64).

    erpo_kernels' `sample_sums`, as the loss sums ell_theta(q) (the same backend rule): each sample's rows in a
    fixed order on the Triton path (CUDA), so the result does not change from run to run."""
    rows = torch.where(batch.token_kind == kind, values.float(), torch.zeros((), device=values.device))
    return sample_sums(rows, batch.sample_index, batch.input_ids.shape[0]).double()
