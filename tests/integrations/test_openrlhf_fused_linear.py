"""erpo.integrations.openrlhf's lean path (`fused_linear=True`: the actor's backbone for the final hidden states, the
prompt and action rows scored against the lm_head in erpo_kernels, the [B, T, V] logits never built) against its
logits path (`Actor.forward`'s fp32 logits divided by the temperature: OpenRLHF's own Actor where installed,
`StandInActor` elsewhere) and against float64 log-probs of the same forward's final hidden states.

Tiny Qwen2 (q/k/v bias, untied head) and Gemma 2 (tied head scaled by sqrt(D), final-logit soft-cap that the
logits pass, sliding window) built from their configs, the head scaled so that the logits spread over tens of nats,
moved far from theta0 (every parameter by a third of its spread), sampling temperature 0.7; fp32 weights, fp32
under bf16 autocast, bf16 weights; OpenRLHF 0.11's right-padded sequences and the earlier left-padded prompts, with
a tool output inside a response.

The bounds (u = 2^-24). The lean path's logits are an fp32 GEMM of the same hidden states and head the float64
oracle reads, so each row's log-prob is within (D + V + 8) u of the largest |logit| (times 2: the log-softmax's
shift), its entropy within that times the row's largest |z - mean|; the logits path's logits were rounded to bf16
(autocast's or the bf16 model's lm_head, and Gemma's soft-cap in bf16), off the float64 logits by dz_r, which moves a
log-prob by at most 2 dz_r and an entropy by at most 2 dz_r max |z - mean| (dH/dz_j = -p_j (z_j - mean)): each path
is held to its own bound, so the two agree within the logits path's rounding. ell_theta(q) sums its rows' bounds.
Every parameter's gradient of ERPOPolicyLoss (Query-KL against theta0's cached ell_theta0(q), w(q), a clipped
off-policy ratio) plus OpenRLHF's entropy bonus: to 1e-4 of its norm in fp32; under bf16 the logits path's backward
runs through bf16 d logits (2^-8 of each) and the two graphs' bf16 roundings part, so 2^-4 of the norm: a missing
temperature (1 / 0.7), soft-cap slope or term is off by more than that.
"""
import copy
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers

from erpo.integrations.openrlhf import ERPOPolicyLoss, actor_logprobs
from max_allocation import MaxAllocation
from test_openrlhf_integration import (  # noqa: F401  (openrlhf_models, actor_step: fixtures)
    GLOBAL,
    EngineStandIn,
    StandInActor,
    actor_step,
    chat_prompts,
    openrlhf_models,
    padded_batch,
    step_batch,
)

U = 2.0 ** -24
VOCAB, HIDDEN = 96, 32
TEMPERATURE = 0.7
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(final_logit_softcapping=5.0, sliding_window=16)),
}


def theta0_of(family: str) -> torch.nn.Module:
    """theta0 of `family`: fp32, seeded, sdpa attention, its head scaled by 20 (the logits spread over tens of nats;
    Gemma 2's pass its cap)."""
    config_class, model_class, settings = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**COMMON, **settings, attn_implementation="sdpa"))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


def far_from(theta0: torch.nn.Module) -> torch.nn.Module:
    """A copy of theta0 with every parameter moved by a third of its spread (seeded): prompts' log-likelihoods
    move by nats, as RL training moves them."""
    model = copy.deepcopy(theta0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (p.std() if p.numel() > 1 else 0.1) / 3)
    return model


def actor_around(kind: str, model: torch.nn.Module, *, packing: bool = False):
    """OpenRLHF's Actor around `model` (as `Actor(model)` keeps it; its packing_samples set, as a pretrain path sets
    it) or `StandInActor`, at the sampling TEMPERATURE."""
    if kind == "openrlhf":
        from openrlhf.models import Actor
        actor = Actor(model, temperature=TEMPERATURE)
    else:   # its forward does not pack: with packing only the lean path, which reads packing_samples, may run on it
        actor = StandInActor(model, TEMPERATURE)
    actor.packing_samples = packing
    return actor


@pytest.fixture(params=["openrlhf", "stand-in"])
def actor_kind(request):
    """The logits path's actor: OpenRLHF's own `Actor` (skipped without OpenRLHF) or `StandInActor`."""
    if request.param == "openrlhf":
        request.getfixturevalue("openrlhf_models")
    return request.param


def float64_rows(actor, sequences, attention_mask, autocast: bool):
    """The float64 oracle on Actor.forward's own forward (its position ids; output_hidden_states=True): (the logits
    z = transform(h @ W^T) / the actor's temperature [B, T, V] of the final hidden states h and the lm_head W in
    float64; each next token's log-prob [B, T] and each row's entropy [B, T] under z; the fp32 bound of one row's
    log-prob [B, T], (D + V + 8) u max |z| * 2; each row's largest |z - mean| [B, T], the entropy's sensitivity to
    its logits; the model's own logits / the temperature [B, T, V] fp32, the logits path's)."""
    model = actor.model
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(sequences, attention_mask=attention_mask, position_ids=position_ids, output_hidden_states=True)
    head = model.get_output_embeddings()
    z = out.hidden_states[-1].double() @ head.weight.double().t()
    cap = model.config.to_dict().get("final_logit_softcapping")
    if cap is not None:
        assert z.abs().max() > cap   # the cap bites
        z = cap * torch.tanh(z / cap)
    z = z / actor.temperature
    logp_all = z.log_softmax(-1)
    logp = logp_all.gather(2, torch.roll(sequences, -1, 1)[..., None]).squeeze(2)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    spread = (z - (logp_all.exp() * z).sum(-1, keepdim=True)).abs().amax(-1)
    fp32_bound = 2 * (HIDDEN + VOCAB + 8) * U * z.abs().amax(-1)
    return z, logp, entropy, fp32_bound, spread, out.logits.float() / actor.temperature


def scored(actor, batch, *, fused_linear: bool, autocast: bool, ref_query_logp, query_weight):
    """One micro-batch through `actor_logprobs` (with the entropy) and ERPOPolicyLoss (alpha 0.05 against
    `ref_query_logp`, w(q), an off-policy ratio that clips) plus OpenRLHF's entropy bonus (coefficient 0.01 on the
    action rows' mean entropy), backpropagated: (ActorScores, the loss, every parameter's gradient fp32)."""
    sequences, action_mask, attention_mask = batch
    actor.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        scores = actor_logprobs(actor, sequences, action_mask, attention_mask, return_entropy=True,
                                fused_linear=fused_linear)
    old = (scores.action_log_probs.detach() - 0.25 * torch.linspace(-1, 1, action_mask.shape[1])) * action_mask
    advantages = (torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * action_mask).contiguous()
    loss, *_ = ERPOPolicyLoss(qkl_coef=0.05)(scores.action_log_probs, old, advantages, action_mask=action_mask,
                                             query_logp=scores.query_logp, ref_query_logp=ref_query_logp,
                                             query_weight=query_weight, **GLOBAL)
    entropy = scores.output.entropy[:, -action_mask.shape[1]:]
    loss = loss - 0.01 * (entropy * action_mask).sum() / action_mask.sum()
    loss.backward()
    return scores, loss.detach(), {name: p.grad.float().clone() for name, p in actor.named_parameters()}


def per_prompt(values, attention_mask, action_mask):
    """[B, T] per-row values -> [B] sums over each sample's prompt rows (tokens 2..P), as `actor_rows` takes them."""
    from erpo.integrations.openrlhf import actor_rows
    _, kind, _ = actor_rows(torch.zeros_like(attention_mask), action_mask, attention_mask)
    return torch.where(kind == 1, values, 0).sum(1)


def action_rows(values, action_mask):
    """[B, T] per-row values -> their last A columns, action-aligned [B, A] as Actor.forward aligns them."""
    width = values.shape[1]
    return values[:, width - 1 - action_mask.shape[1]:width - 1]


PRECISIONS = {"fp32": (torch.float32, False), "fp32-bf16-autocast": (torch.float32, True),
              "bf16": (torch.bfloat16, False)}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_lean_path_is_the_logits_path(actor_kind, family, precision):
    """Far from theta0, at temperature 0.7, each path's action log-probs, ell_theta(q) and action entropies within
    its bound of the float64 oracle (module docstring), and every parameter's gradient of the ERPO loss with the
    entropy bonus equal on both paths (1e-4 of its norm in fp32, 2^-4 under bf16)."""
    dtype, autocast = PRECISIONS[precision]
    theta0 = theta0_of(family)
    ref_query_logp = actor_logprobs(actor_around(actor_kind, theta0), *padded_batch("right")).query_logp.detach()
    model = far_from(theta0).to(dtype)
    actor = actor_around(actor_kind, model)
    for layout in ("right", "left"):
        batch = padded_batch(layout)
        sequences, action_mask, attention_mask = batch
        weight = torch.tensor([0.6, 1.8, 1.2, 0.9])
        lean, _, lean_grads = scored(actor, batch, fused_linear=True, autocast=autocast,
                                     ref_query_logp=ref_query_logp, query_weight=weight)
        logits, _, logits_grads = scored(actor, batch, fused_linear=False, autocast=autocast,
                                         ref_query_logp=ref_query_logp, query_weight=weight)
        exact_z, exact_logp, exact_entropy, fp32_bound, spread, their_logits = float64_rows(
            actor, sequences, attention_mask, autocast)
        dz = (their_logits.double() - exact_z).abs().amax(-1)   # the logits path's rounding, per row
        bounds = {True: (fp32_bound, fp32_bound * (1 + spread)),
                  False: (2 * dz + fp32_bound, 2 * dz * spread + fp32_bound * (1 + spread))}
        drift = per_prompt(exact_logp, attention_mask, action_mask) - ref_query_logp.double()
        assert drift.abs().max() > 2.0   # far from theta0: the Query-KL's gradient is not small
        for fused, scores in ((True, lean), (False, logits)):
            logp_bound, entropy_bound = bounds[fused]
            mask = action_mask
            assert ((scores.action_log_probs.detach().double() - action_rows(exact_logp, mask)).abs()
                    <= action_rows(logp_bound, mask))[mask].all(), (fused, layout)
            assert (scores.query_logp.detach().double() - per_prompt(exact_logp, attention_mask, mask)).abs().le(
                per_prompt(logp_bound, attention_mask, mask)).all(), (fused, layout)
            entropy = scores.output.entropy[:, -mask.shape[1]:].detach().double()
            assert ((entropy - action_rows(exact_entropy, mask)).abs()
                    <= action_rows(entropy_bound, mask))[mask].all(), (fused, layout)
        assert (lean.action_log_probs[~action_mask] == 0).all() and lean.prompt_ids == logits.prompt_ids
        tol = 1e-4 if precision == "fp32" else 2.0 ** -4
        for name, grad in logits_grads.items():
            assert grad.norm() > 0, name
            assert (lean_grads[name] - grad).norm() <= tol * grad.norm(), (name, layout)



def flash_attn_padding_stand_in() -> types.ModuleType:
    """What OpenRLHF's ring_attn_utils takes of flash-attn (absent on a CPU machine): bert_padding's unpad_input,
    pad_input and index_first_axis in torch, as flash-attn 2 defines them (the real tokens of a [B, T, ...] batch in
    row-major order, their flat indices, cu_seqlens; and back, zeros where padding was), and einops' rearrange."""
    import einops

    def index_first_axis(tensor, indices):
        return tensor[indices]

    def unpad_input(hidden_states, attention_mask):
        seqlens = attention_mask.sum(-1, dtype=torch.int32)
        indices = attention_mask.flatten().nonzero().flatten()
        cu_seqlens = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
        flat = einops.rearrange(hidden_states, "b s ... -> (b s) ...")
        return index_first_axis(flat, indices), indices, cu_seqlens, int(seqlens.max()), seqlens

    def pad_input(hidden_states, indices, batch, seqlen):
        padded = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:]).index_put((indices,), hidden_states)
        return einops.rearrange(padded, "(b s) ... -> b s ...", b=batch)

    padding = types.ModuleType("flash_attn.bert_padding")
    padding.index_first_axis, padding.unpad_input, padding.pad_input = index_first_axis, unpad_input, pad_input
    padding.rearrange = einops.rearrange
    return padding


@pytest.fixture
def openrlhf_packing(request, monkeypatch):
    """OpenRLHF's Actor.forward with packing_samples on the CPU: its own ring_attn_utils (unpad_and_slice_tensor,
    gather_and_pad_tensor; OpenRLHF 0.11.2's file) loaded with `flash_attn_padding_stand_in` in flash-attn's place,
    and the Actor module's names bound to them for the test."""
    request.getfixturevalue("openrlhf_models")
    import openrlhf.models.actor as actor_module
    stand_ins = {"flash_attn": types.ModuleType("flash_attn"), "flash_attn.utils": types.ModuleType("flash_attn.utils"),
                 "flash_attn.bert_padding": flash_attn_padding_stand_in(),
                 "flash_attn.utils.distributed": types.ModuleType("flash_attn.utils.distributed")}
    stand_ins["flash_attn.utils.distributed"].all_gather = None   # ring attention only, which is not run
    path = Path(actor_module.__file__).parent / "ring_attn_utils.py"
    spec = importlib.util.spec_from_file_location("openrlhf_ring_attn_utils_on_cpu", path)
    ring = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        for name, module in stand_ins.items():
            patch.setitem(sys.modules, name, module)
        spec.loader.exec_module(ring)
    monkeypatch.setattr(actor_module, "unpad_and_slice_tensor", ring.unpad_and_slice_tensor)
    monkeypatch.setattr(actor_module, "gather_and_pad_tensor", ring.gather_and_pad_tensor)


def packed_and_padded(actor, batch, *, fused_linear: bool):
    """(action log-probs [B, A], ell_theta(q) [B], action entropies [B, A], every trainable parameter's gradient of a
    seeded weighted sum of the three) of `actor_logprobs` on `batch`, fp32."""
    sequences, action_mask, attention_mask = batch
    actor.zero_grad(set_to_none=True)
    scores = actor_logprobs(actor, sequences, action_mask, attention_mask, return_entropy=True,
                            fused_linear=fused_linear)
    entropy = scores.output.entropy[:, -action_mask.shape[1]:] * action_mask
    gen = torch.Generator().manual_seed(3)
    ((scores.query_logp * torch.randn(scores.query_logp.shape, generator=gen)).sum()
     + (scores.action_log_probs * torch.randn(action_mask.shape, generator=gen)).sum()
     + (entropy * torch.randn(action_mask.shape, generator=gen)).sum()).backward()
    grads = {name: p.grad.clone() for name, p in actor.named_parameters() if p.requires_grad}
    return scores.action_log_probs.detach(), scores.query_logp.detach(), entropy.detach(), grads


def assert_same_scores(ours, theirs, what):
    """Two `packed_and_padded` results equal to fp32 rounding (gradients to 1e-4 of their largest entry)."""
    for mine, reference in zip(ours[:3], theirs[:3]):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=2e-5, msg=what)
    for name, grad in theirs[3].items():
        scale = grad.abs().max()
        assert scale > 0, name
        torch.testing.assert_close(ours[3][name] / scale, grad / scale, rtol=1e-4, atol=1e-5, msg=f"{what}: {name}")


@pytest.mark.parametrize("layout", ["right", "left"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packing_samples_is_the_padded_forward(actor_kind, family, layout, request):
    """packing_samples=True on the lean path (Actor.forward's unpadding: the real tokens back to back in one row,
    positions restarting at each sample, no mask) equals the padded forward (packing_samples=False) on the same
    actor: action log-probs, ell_theta(q), action entropies and every parameter's gradient, to fp32 rounding. The
    comparison means something on the CPU: transformers 5.x builds a block-diagonal mask from packed position ids
    when no attention mask is passed (`masking_utils.find_packed_sequence_indices`), so sdpa keeps each sample to
    itself, and every sample but the first would differ if it attended across (`test_packing_is_per_sample`). With
    OpenRLHF installed, the lean path packed also equals OpenRLHF's own packed Actor.forward (its unpad_and_slice_tensor
    and gather_and_pad_tensor, flash-attn's padding helpers in torch), also with an action row on padding (0 there on
    both paths, as Actor.forward's own action log-probs: no padding is packed)."""
    model = far_from(theta0_of(family))
    batch = padded_batch(layout)
    padded = packed_and_padded(actor_around(actor_kind, model), batch, fused_linear=True)
    packed = packed_and_padded(actor_around(actor_kind, model, packing=True), batch, fused_linear=True)
    assert_same_scores(packed, padded, "lean packed vs lean padded")
    if actor_kind == "openrlhf":
        request.getfixturevalue("openrlhf_packing")
        theirs = packed_and_padded(actor_around(actor_kind, model, packing=True), batch, fused_linear=False)
        assert_same_scores(packed, theirs, "lean packed vs Actor.forward packed")
        sequences, action_mask, attention_mask = batch   # an action row on padding: 0 packed, as Actor.forward's
        action_mask = action_mask.clone()
        action_mask[2, -1] = True
        assert attention_mask[2, -2] == 0
        packing = actor_around(actor_kind, model, packing=True)
        on_padding = (sequences, action_mask, attention_mask)
        lean, ours = (packed_and_padded(packing, on_padding, fused_linear=fused) for fused in (True, False))
        assert_same_scores(lean, ours, "an action row on padding, packed")
        with torch.no_grad():
            theirs = packing(sequences, action_mask, attention_mask=attention_mask)   # Actor.forward's own
        torch.testing.assert_close(lean[0], theirs, rtol=1e-5, atol=2e-5)
        assert lean[0][2, -1] == 0


def test_packing_is_per_sample():
    """What makes `test_packing_samples_is_the_padded_forward` able to fail: the samples packed in one row with
    positions counted on through the row (no restart: one sequence to transformers) score otherwise than with the
    positions restarting at each sample, which match each sample's forward alone."""
    model = far_from(theta0_of("qwen2"))
    sequences, _, attention_mask = padded_batch("right")
    real = attention_mask.bool()
    lengths = attention_mask.sum(1).tolist()
    ids = sequences[real][None]
    restarting = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        per_sample = model(ids, position_ids=restarting).logits[0]
        one_sequence = model(ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
        alone = torch.cat([model(sequences[b, :n][None]).logits[0] for b, n in enumerate(lengths)])
    torch.testing.assert_close(per_sample, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(one_sequence[lengths[0]:], alone[lengths[0]:], atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cache_on_the_lean_path(actor_kind, tiny, tmp_path, dtype):
    """The reference cache scored on the lean path (`load_or_build_query_reference(..., fused_linear=True)`, the
    tiny Qwen2 and the chat prompts of OpenRLHF's PromptDataset, one prompt a forward) holds each prompt's
    ell_theta0(q) within the lean path's fp32 bound of the float64 oracle (module docstring), as the logits path's
    cache does within its own, and the two caches agree to 1e-5 in fp32. A cache is keyed by its path (the
    precision's `path=openrlhf-actor` or `path=openrlhf-fused-linear`): read on the other path it is refused in one
    line naming both, never read as ell_theta0(q) of the other rounding; and a step on the lean path at theta0 against
    its cache has a Query-KL of 0."""
    from erpo.integrations.openrlhf_reference import load_or_build_query_reference, prompt_token_ids
    tiny_path, tokenizer = tiny
    prompts = chat_prompts(tokenizer)
    if actor_kind == "openrlhf":
        from test_openrlhf_integration import openrlhf_actor
        actor = openrlhf_actor(sys.modules["openrlhf.models"], tiny_path, dtype)
    else:
        actor = StandInActor(tiny_path).to(dtype)
    paths = {fused: str(tmp_path / f"{'lean' if fused else 'logits'}.json") for fused in (True, False)}
    caches = {fused: load_or_build_query_reference(actor, tokenizer, prompts, path=paths[fused], model_path=tiny_path,
                                                   batch_size=1, fused_linear=fused) for fused in (True, False)}
    ids = prompt_token_ids(tokenizer, prompts)
    for prompt in ids:
        sequence, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
        exact_z, exact_logp, _, fp32_bound, _, their_logits = float64_rows(actor, sequence, mask, autocast=False)
        dz = (their_logits.double() - exact_z).abs().amax(-1)
        exact, rows = exact_logp[0, :-1].sum(), slice(0, len(prompt) - 1)   # tokens 2..P
        lean, logits = (caches[fused].lookup([prompt])[0].double() for fused in (True, False))
        assert (lean - exact).abs() <= fp32_bound[0, rows].sum()
        assert (logits - exact).abs() <= (2 * dz + fp32_bound)[0, rows].sum()
        if dtype == torch.float32:
            torch.testing.assert_close(lean, logits, rtol=1e-5, atol=1e-5)
    for fused in (True, False):
        with pytest.raises(ValueError, match=r"does not match this run: precision: cache built with .*path=openrlhf-"
                           + ("actor," if fused else "fused-linear,") + r".*training scores with .*path=openrlhf-"
                           + ("fused-linear," if fused else "actor,")) as error:
            load_or_build_query_reference(actor, tokenizer, prompts, path=paths[not fused], model_path=tiny_path,
                                          fused_linear=fused)
        assert "\n" not in str(error.value)
    # the step at theta0 on the lean path, against the lean cache (scored 4 prompts a forward this time)
    sequences, action_mask, attention_mask = step_batch(tokenizer, prompts)
    scores = actor_logprobs(actor, sequences, action_mask, attention_mask, fused_linear=True)
    ref_query_logp, _ = caches[True].lookup(scores.prompt_ids)
    torch.testing.assert_close(scores.query_logp.detach(), ref_query_logp, rtol=1e-6, atol=1e-5)


def test_what_the_lean_path_cannot_score_is_refused_in_one_line(tiny):
    """Where the lean path cannot be right it refuses in one line, naming the setting and the way out: an lm_head
    that is not a plain Linear (a LoRA adapter on it; DeepSpeed AutoTP's shard), a vision-language actor's inputs,
    ring attention. (An lm_head DeepSpeed ZeRO-3 partitions is scored: tests/distributed/test_openrlhf_zero3.py.)"""
    peft = pytest.importorskip("peft", exc_type=ModuleNotFoundError)
    tiny_path, tokenizer = tiny
    batch = step_batch(tokenizer, chat_prompts(tokenizer))

    def vlm_actor():   # what OpenRLHF's Actor marks a vision-language model with
        actor = StandInActor(tiny_path).float()
        actor.is_vlm = True
        return actor

    def lora_head_actor():
        config = peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
        return StandInActor(peft.get_peft_model(StandInActor(tiny_path).float().model, config))

    cases = [
        (lambda: actor_logprobs(lora_head_actor(), *batch, fused_linear=True),
         r"^fused_linear=True needs the actor's lm_head to be a torch.nn.Linear .*, not a Linear .*fused_linear=False"),
        (lambda: actor_logprobs(vlm_actor(), *batch, fused_linear=True, pixel_values=torch.zeros(1)),
         r"^fused_linear=True does not score a vision-language actor"),
        (lambda: actor_logprobs(StandInActor(tiny_path).float(), *batch, fused_linear=True, ring_attn_group=object()),
         r"^ring attention \(ds.ring_attn_size > 1\) is not supported"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            make()
        assert "\n" not in str(error.value)


def test_a_peft_actor_on_the_lean_path():
    """OpenRLHF's LoRA actor (`Actor.model` a PEFT model: lora_rank > 0) on the lean path: action log-probs,
    ell_theta(q) and the gradients of the adapters (the only trainable parameters) equal the logits path's to fp32
    rounding, the adapters active (initialized off zero) and the frozen weights without a gradient."""
    peft = pytest.importorskip("peft", exc_type=ModuleNotFoundError)
    base = far_from(theta0_of("qwen2"))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    actor = StandInActor(peft.get_peft_model(base, config), TEMPERATURE)
    actor.packing_samples = False
    batch = padded_batch("right")
    lean, theirs = (packed_and_padded(actor, batch, fused_linear=fused) for fused in (True, False))
    assert_same_scores(lean, theirs, "lean vs logits, LoRA")
    trainable = {name for name, p in actor.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    with actor.model.disable_adapter(), torch.no_grad():   # the adapters move the scores: the test sees them
        without = actor_logprobs(actor, *batch, fused_linear=True).action_log_probs
    assert not torch.allclose(without, lean[0], atol=1e-3)


def test_old_log_probs_on_the_lean_path_make_the_first_ratio_one(actor_kind):
    """OpenRLHF's old log-probs come from Actor.forward (PolicyModelActor.forward, the logits path). The lean path's
    log-probs differ from them by the logits path's bf16 rounding, so a step on the lean path against them is not on
    policy at its first mini-batch (ppo_kl != 0, ratios off 1); against old log-probs scored on the lean path too
    (docs/integrations.md: the third change) the ratio is 1 exactly, ppo_kl and clip_ratio 0. bf16 weights."""
    actor = actor_around(actor_kind, far_from(theta0_of("gemma2")).to(torch.bfloat16))
    sequences, action_mask, attention_mask = padded_batch("right")
    advantages = (torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * action_mask).contiguous()
    with torch.no_grad():
        actor.eval()
        old = {fused: actor_logprobs(actor, sequences, action_mask, attention_mask, fused_linear=fused).action_log_probs
               for fused in (True, False)}
        actor.train()
    step = actor_logprobs(actor, sequences, action_mask, attention_mask, fused_linear=True).action_log_probs
    loss = ERPOPolicyLoss(qkl_coef=0.0, clip_eps_low=0.01, clip_eps_high=0.01)
    _, clip_ratio, ppo_kl, *_ = loss(step, old[True], advantages, action_mask=action_mask)
    assert torch.equal(step.detach(), old[True]) and clip_ratio == 0 and ppo_kl == 0
    _, clip_ratio, ppo_kl, *_ = loss(step, old[False], advantages, action_mask=action_mask)
    assert ppo_kl != 0 and (step.detach() - old[False])[action_mask].abs().max() > 1e-3


def test_the_lean_path_never_builds_the_logits():
    """The largest tensor `actor_logprobs` and its backward create outside erpo_kernels' op (MaxAllocation sees the
    custom op `erpo::fused_linear_logp_entropy` as one op, its outputs [R]; its chunked workspace is the kernel tier's
    to test, and bench.openrlhf_memory measures the whole step's peak memory): on the logits path at least the logits
    [B, T, V]; on the lean path under an eighth of them (the model's own logits are the last position's: its forward
    runs with logits_to_keep=1; the head [V, D] and its gradient, the MLP's [B, T, 32]: B T > 8 D here)."""
    config_class, model_class, _ = FAMILIES["qwen2"]
    torch.manual_seed(0)
    model = model_class(config_class(**dict(COMMON, vocab_size=512, hidden_size=16, intermediate_size=32, head_dim=4),
                                     attn_implementation="sdpa"))
    actor = actor_around("stand-in", model)
    gen = torch.Generator().manual_seed(0)
    num, length = 4, 48
    sequences = torch.randint(3, 512, (num, length), generator=gen)
    attention_mask = torch.ones(num, length, dtype=torch.long)
    action_mask = torch.zeros(num, length - 1, dtype=torch.bool)
    action_mask[:, 20:] = True
    largest = {}
    for fused in (False, True):
        with MaxAllocation() as recorder:
            scores = actor_logprobs(actor, sequences, action_mask, attention_mask, return_entropy=True,
                                    fused_linear=fused)
            (scores.query_logp.sum() + scores.action_log_probs.sum()).backward()
        largest[fused] = recorder.largest
    logits = num * length * 512
    assert largest[False] >= logits and largest[True] < logits // 8, largest
