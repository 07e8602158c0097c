"""erpo.sequences' final hidden states: kept by a hook on the decoder, the same bits (and gradients) as the
forward's `output_hidden_states=True` gave as `hidden_states[-1]`, across the families the tests build, through a
PEFT wrapper, without every layer's hidden states asked for or held."""
import gc

import pytest
import torch
import transformers

from erpo.config import LoraConfig
from erpo.models.lora import AdaptersDisabled, apply_lora
from erpo.sequences import final_hidden, final_hidden_and_output, pack, scored_rows
from family_models import tiny_lm

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
PLAIN = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
         "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}
FAMILIES = ("qwen2", "llama", "gemma2", "gemma3", "qwen3_moe", "granite")


def model_of(family: str, layers: int = 2):
    """A tiny fp32 causal LM of `family` in train mode (no dropout in these configs): Qwen2 / Llama from a config
    here at `layers` layers, the others `family_models.tiny_lm`'s (one layer, a logit transform or an MoE)."""
    if family in PLAIN:
        config_class, model_class = PLAIN[family]
        torch.manual_seed(0)
        return model_class(config_class(**SMALL, num_hidden_layers=layers))
    return tiny_lm(family).train()


def some_batch(seed: int = 0):
    """Three prompt + response samples of unequal lengths, right-padded (erpo's layout)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (7, 3, 5)]
    responses = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (4, 6, 1)]
    return pack(prompts, responses, 0, "cpu")


def every_layers_way(model, batch, **forward_kwargs):
    """main's way up to this change: the forward with output_hidden_states=True, its hidden_states[-1]."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True,
                logits_to_keep=1, use_cache=False, **forward_kwargs)
    return scored_rows(out.hidden_states[-1], batch), out


def hidden_and_gradients(scorer, model, batch, autocast: bool, **forward_kwargs):
    """(the scored rows' final hidden states [R, D], every decoder parameter's gradient of a fixed weighting of them,
    the MoE aux_loss or None), the forward under bf16 autocast when `autocast`."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden, out = scorer(model, batch, **forward_kwargs)
    probe = torch.linspace(-1.0, 1.0, hidden.numel()).reshape(hidden.shape)
    (hidden.float() * probe).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.get_decoder().named_parameters()}   # .clone() of None fails
    return hidden.detach(), grads, getattr(out, "aux_loss", None)


@pytest.mark.parametrize("precision", ["fp32-autocast", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bits_and_gradients_equal_the_hidden_states_of_every_layer(family, precision):
    """The kept hidden states equal hidden_states[-1] bit for bit, with and without gradient, and every decoder
    parameter's gradient through them is the same too (so are an MoE's router aux_loss and its gradient)."""
    model = model_of(family)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    autocast, batch = precision == "fp32-autocast", some_batch()
    extra = dict(output_router_logits=True) if family == "qwen3_moe" else {}
    ours = hidden_and_gradients(final_hidden_and_output, model, batch, autocast, **extra)
    theirs = hidden_and_gradients(every_layers_way, model, batch, autocast, **extra)
    assert ours[0].shape == (batch.targets.shape[0], model.config.hidden_size)
    assert torch.equal(ours[0], theirs[0])
    assert all(torch.equal(ours[1][name], theirs[1][name]) for name in ours[1])
    if family == "qwen3_moe":
        assert ours[2] is not None and torch.equal(ours[2], theirs[2])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert torch.equal(final_hidden(model, batch), every_layers_way(model, batch)[0])


def test_through_a_peft_wrapper_the_adapters_run_and_the_reference_view_switches_them_off():
    """Through LoRA adapters (moved off zero) the same bits as hidden_states[-1], which differ from the base's; the
    trainer's adapter-free reference (`AdaptersDisabled`) gives the base's."""
    model = apply_lora(model_of("qwen2"), LoraConfig(rank=4))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    batch = some_batch()
    with torch.no_grad():
        ours = final_hidden(model, batch)
        assert torch.equal(ours, every_layers_way(model, batch)[0])
        reference = final_hidden(AdaptersDisabled(model), batch)
        with model.disable_adapter():
            assert torch.equal(reference, every_layers_way(model, batch)[0])
        assert not torch.equal(ours, reference)


def bdl_storages(batch, hidden_size: int) -> int:
    """How many distinct storages back the live tensors of shape [B, L, D] (the hidden states' shape)."""
    shape = (*batch.input_ids.shape, hidden_size)
    return len({obj.untyped_storage().data_ptr() for obj in gc.get_objects()
                if type(obj) is torch.Tensor and obj.shape == shape})


def test_the_forward_neither_asks_for_nor_holds_every_layers_hidden_states():
    """The forward is not asked for output_hidden_states and returns none; under no_grad, when the lm_head runs one
    [B, L, D] tensor is alive (the final hidden states), where asking for them held layers + 1 (the embedding's and
    every layer's output, the last one post-norm)."""
    layers, batch = 4, some_batch()
    model = model_of("qwen2", layers=layers).eval()
    forward_kwargs, alive_at_head = [], []
    model.register_forward_pre_hook(lambda module, args, kwargs: forward_kwargs.append(set(kwargs)), with_kwargs=True)
    model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: alive_at_head.append(bdl_storages(batch, model.config.hidden_size)))
    with torch.no_grad():
        _, out = final_hidden_and_output(model, batch)
        assert "output_hidden_states" not in forward_kwargs[-1] and out.hidden_states is None
        every_layers_way(model, batch)
    assert alive_at_head == [1, layers + 1]


class DecoderElsewhere(torch.nn.Module):
    """A causal LM whose get_decoder() is a module its forward never runs."""

    def __init__(self, model):
        super().__init__()
        self.model, self.unused = model, torch.nn.Identity()

    def get_decoder(self):
        return self.unused

    def forward(self, **kwargs):
        return self.model(**kwargs)


def test_a_forward_that_does_not_run_its_decoder_is_refused():
    with pytest.raises(ValueError, match=r"DecoderElsewhere ran its decoder \(Identity, its get_decoder\(\)\) 0 times"):
        final_hidden(DecoderElsewhere(model_of("qwen2")), some_batch())
