"""erpo.models.lora on the tiny model: adapters, the adapter-free reference, merged weights (vLLM sync, export),
eval."""
import dataclasses
import json
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import fake_vllm
from erpo.cli.args import shipped_config
from erpo.cli.eval import OPTION_NAMES
from erpo.config import Config, LoraConfig, apply_overrides, load_config, resolve
from erpo.eval.evaluate import evaluate
from erpo.eval.model_specs import parse_models, resolve_model
from erpo.eval.problem_sets import load_benchmark
from erpo.eval.sampling import build_engine
from erpo.models import lora as L
from erpo.models.loading import load_causal_lm
from erpo.models.tiny import build_model, build_tokenizer
from erpo.rollout.hf import HFRollout
from erpo.rollout.vllm import VLLMRollout
from erpo.sequences import final_hidden, pack, scored_token_logp
from erpo_kernels import fused_linear_erpo_loss
from erpo_kernels.lm_head import whole_lm_head

RANK = 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer):
    """theta0 on disk, as the trainer loads it."""
    path = tmp_path_factory.mktemp("theta0")
    build_model(tokenizer, seed=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def load_base(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def adapted(path, lora=LoraConfig(rank=RANK), *, trained=True):
    """theta0 with LoRA adapters; `trained`: B moved off zero, as after some updates (else exactly theta0)."""
    model = L.apply_lora(load_base(path), lora)
    if trained:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.2)
    return model


def some_batch(tokenizer):
    prompts = [tokenizer.encode(p) for p in ("1+2=", "7*3=", "10-4=")]
    responses = [tokenizer.encode(r) for r in ("3<|im_end|>", "21", "6 ok")]
    return pack(prompts, responses, tokenizer.pad_token_id, "cpu")


def test_only_adapter_parameters_are_trainable(base_dir):
    base = load_base(base_dir)
    model = adapted(base_dir, trained=False)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # r (in + out) per adapted projection: every attention and MLP projection of every layer by default
    expected = sum(RANK * (m.in_features + m.out_features) for n, m in base.named_modules()
                   if n.split(".")[-1] in LoraConfig().target_modules)
    assert sum(p.numel() for p in trainable.values()) == expected > 0
    frozen = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
              for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen.keys() == dict(base.named_parameters()).keys()
    assert all(torch.equal(frozen[n], p) for n, p in base.named_parameters())


def test_fresh_adapters_are_theta0(base_dir, tokenizer):
    """B starts at zero: the adapted model's log-probs are theta0's, bit for bit (the reference cache's premise)."""
    batch = some_batch(tokenizer)
    assert torch.equal(scored_token_logp(adapted(base_dir, trained=False), batch),
                       scored_token_logp(load_base(base_dir), batch))


@pytest.mark.parametrize("targets, culprit", [(["lm_head"], "lm_head, the output layer"),
                                              (["q_proj", "embed_tokens"], "embed_tokens, the input embedding tied")])
def test_output_layer_adapters_are_refused(base_dir, targets, culprit):
    with pytest.raises(ValueError, match=culprit) as info:
        L.apply_lora(load_base(base_dir), LoraConfig(rank=RANK, target_modules=targets))
    assert "\n" not in str(info.value) and "remove it" in str(info.value)


def test_unknown_target_module_is_one_line(base_dir):
    with pytest.raises(ValueError, match=r"model.lora.target_modules \['attn'\]: Target modules \{'attn'\} not found"):
        L.apply_lora(load_base(base_dir), LoraConfig(rank=RANK, target_modules=["attn"]))


def test_all_linear_adapts_every_projection_but_the_head(base_dir):
    model = adapted(base_dir, LoraConfig(rank=RANK, target_modules=["all-linear"]), trained=False)
    default = adapted(base_dir, trained=False)
    assert {n for n, _ in model.named_parameters() if "lora_" in n} == \
           {n for n, _ in default.named_parameters() if "lora_" in n}


def test_policy_kl_against_disabled_adapters_equals_a_frozen_base(base_dir, tokenizer):
    """GRPO's Policy-KL: the reference read from the same model with its adapters switched off equals the one from a
    separately loaded frozen theta0, and so do the loss, its KL metric and the adapters' gradients."""
    batch = some_batch(tokenizer)
    model = adapted(base_dir)
    with L.reference_model(model) as reference:
        ref_logp = scored_token_logp(reference, batch)
    frozen_logp = scored_token_logp(load_base(base_dir), batch)
    torch.testing.assert_close(ref_logp, frozen_logp, rtol=0, atol=1e-6)
    assert not torch.allclose(scored_token_logp(model, batch), ref_logp, atol=1e-3)   # the adapters act again

    def policy_loss(reference_logp):
        model.zero_grad()
        hidden = final_hidden(model, batch)
        with whole_lm_head(model) as (weight, bias):
            out = fused_linear_erpo_loss(hidden, weight, batch.targets, batch.token_kind, batch.sample_index,
                                         bias=bias, advantages=torch.tensor([1.0, -0.5, 0.2]), ref_logp=reference_logp,
                                         policy_kl_coef=0.01, qkl_coef=0.0)
        out.loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        return out, grads

    out_disabled, grads_disabled = policy_loss(ref_logp)
    out_frozen, grads_frozen = policy_loss(frozen_logp)
    assert float(out_frozen.metrics["policy_kl"]) > 1e-4
    torch.testing.assert_close(out_disabled.metrics["policy_kl"], out_frozen.metrics["policy_kl"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out_disabled.loss, out_frozen.loss, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads_disabled, grads_frozen):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_reference_model_needs_adapters(base_dir):
    with pytest.raises(TypeError, match="LoRA adapters"):
        with L.reference_model(load_base(base_dir)):
            pass


def test_inference_weights_are_the_merged_model_and_leave_it_unchanged(base_dir, tokenizer):
    model = adapted(base_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = {name: tensor.clone() for name, tensor in L.inference_weights(model)}
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())   # not merged in place
    merged = load_base(base_dir)
    assert weights.keys() == dict(merged.named_parameters()).keys()          # the plain model's names
    merged.load_state_dict(weights, strict=False)
    reference = adapted(base_dir)                                             # same seed: same adapters
    reference.load_state_dict(model.state_dict())
    expected = reference.merge_and_unload()                                   # PEFT's own in-place merge
    assert all(torch.equal(weights[n], p) for n, p in expected.named_parameters())
    ids = some_batch(tokenizer).input_ids
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    plain = load_base(base_dir)
    assert all(torch.equal(t, dict(plain.named_parameters())[n]) for n, t in L.inference_weights(plain))


def test_merged_export_logits_equal_the_adapted_model(base_dir, tokenizer, tmp_path):
    model = adapted(base_dir)
    L.export_merged(model, tokenizer, tmp_path / "merged")
    L.export_adapter(model, tokenizer, tmp_path / "adapter")
    assert (tmp_path / "merged" / "config.json").is_file() and not L.is_adapter_dir(tmp_path / "merged")
    assert L.is_adapter_dir(tmp_path / "adapter") and not (tmp_path / "adapter" / "config.json").exists()
    adapter_config = json.loads((tmp_path / "adapter" / L.ADAPTER_CONFIG).read_text())
    assert adapter_config["r"] == RANK and adapter_config["base_model_name_or_path"] == base_dir
    ids = some_batch(tokenizer).input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        for path in (tmp_path / "merged", tmp_path / "adapter"):
            loaded = load_causal_lm(str(path), dtype=torch.float32, device="cpu")
            assert not L.is_lora_model(loaded)
            torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-5)


def test_hf_rollout_samples_from_the_adapted_model(base_dir, tokenizer):
    """HF generate on the PEFT model: the sampling log-probs are the adapted model's, not theta0's."""
    model = adapted(base_dir)
    prompts = [tokenizer.encode("2+2="), tokenizer.encode("9-3=")]
    out = HFRollout(model, tokenizer).generate(prompts, n=2, temperature=1.0, max_new_tokens=4, seed=3)
    batch = pack(out.prompt_ids, out.response_ids, tokenizer.pad_token_id, "cpu", response_logp=out.response_logp)
    response = batch.token_kind == 2
    sampled = batch.rollout_logp[response]
    torch.testing.assert_close(scored_token_logp(model, batch)[response], sampled, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(scored_token_logp(load_base(base_dir), batch)[response], sampled, atol=1e-2)


def test_vllm_sync_loads_merged_weights(base_dir, monkeypatch, no_launcher_variables):
    fake_vllm.install(monkeypatch)
    model = adapted(base_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = VLLMRollout(base_dir)
    engine.sync_weights(model)
    loaded = engine.llm.model.loaded
    assert loaded.keys() == dict(load_base(base_dir).named_parameters()).keys()
    assert all(torch.equal(loaded[n], t) for n, t in L.inference_weights(model))
    assert not torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"],
                           before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert engine.llm.call_names()[-1] == "reset_prefix_cache"


def test_held_parameters_line(base_dir):
    model = adapted(base_dir, trained=False)
    held = sum(p.numel() for p in model.parameters())
    base = sum(p.numel() for p in load_base(base_dir).parameters())
    adapters = held - base
    line = L.held_parameters_line(model, reference_needed=True)
    assert f"{adapters / 1e6:,.2f}M trainable" in line and f"held: {held / 1e6:,.2f}M" in line
    assert f"a frozen copy would hold {(held + base) / 1e6:,.2f}M" in line
    assert "no reference model is needed" in L.held_parameters_line(model, reference_needed=False)


def test_eval_accepts_an_adapter_dir(base_dir, tokenizer, tmp_path):
    model = adapted(base_dir)
    adapter_dir = L.export_adapter(model, tokenizer, tmp_path / "adapter")
    spec = resolve_model(f"lora={adapter_dir}")
    assert (spec.label, spec.path) == ("lora", adapter_dir)
    engine, eval_tokenizer = build_engine(adapter_dir, engine="auto", device="cpu", dtype="float32", seed=0,
                                          batch_size=4)
    assert isinstance(engine, HFRollout) and eval_tokenizer.get_vocab() == tokenizer.get_vocab()
    ids = some_batch(tokenizer).input_ids
    with torch.no_grad():
        torch.testing.assert_close(engine.model(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"is a LoRA adapter, which engine=vllm does not load: .* or engine=hf$"):
        build_engine(adapter_dir, engine="vllm", device="cpu", dtype="float32", seed=0, batch_size=4)
    with pytest.raises(ValueError, match=r"^--model \S+ is a LoRA adapter, which --engine vllm does not load: .* or "
                                         r"--engine hf$"):   # as erpo eval's user spelled them
        build_engine(adapter_dir, engine="vllm", device="cpu", dtype="float32", seed=0, batch_size=4,
                     names=OPTION_NAMES)


def test_eval_cache_refuses_samples_of_an_adapter_with_another_alpha(base_dir, tokenizer, tmp_path, monkeypatch):
    """An adapter whose adapter_config.json changed in place (another lora_alpha, the same weights: another model) gets
    another sample-cache identity: `erpo eval` refuses the cached samples rather than serve them as its own; the
    unchanged adapter evaluated again reuses them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))   # the weight digests erpo.models.fingerprint keeps
    adapter_dir = L.export_adapter(adapted(base_dir), tokenizer, tmp_path / "adapter")
    models, benches = parse_models([f"lora={adapter_dir}"]), [load_benchmark("synthetic#n=2")]
    kwargs = dict(output_dir=str(tmp_path / "eval"), temperatures=[1.0], k=2, max_new_tokens=3, progress=False)
    evaluate(models, benches, **kwargs)
    samples = tmp_path / "eval" / "samples" / "lora" / "synthetic" / "temp-1.jsonl"
    sampled = samples.read_bytes()
    evaluate(models, benches, **kwargs)
    assert samples.read_bytes() == sampled                          # the same adapter: nothing sampled again
    config_file = tmp_path / "adapter" / L.ADAPTER_CONFIG
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "lora_alpha": 2 * config["lora_alpha"]}))
    with pytest.raises(ValueError, match=r"made with different settings \(model_weights\)"):
        evaluate(models, benches, **kwargs)


def test_lora_config_keys():
    assert Config().model.lora.rank == 0                                      # off by default
    cfg = resolve(apply_overrides(Config(), ["model.lora.rank=16", "model.lora.target_modules=[q_proj,v_proj]"]))
    assert (cfg.model.lora.rank, cfg.model.lora.target_modules) == (16, ["q_proj", "v_proj"])
    for override, match in (("model.lora.rank=-1", "model.lora.rank must be >= 0"),
                            ("model.lora.dropout=1.0", "0 <= dropout < 1"),
                            ("model.lora.alpha=0", "alpha > 0"),
                            ("model.lora.target_modules=[]", "target_modules is empty")):
        with pytest.raises(ValueError, match=match):
            resolve(apply_overrides(Config(), [override]))


def test_shipped_lora_config_is_the_paper_recipe_with_adapters():
    lora = resolve(load_config(shipped_config("qwen25_math_7b_erpo_lora")))
    full = resolve(load_config(shipped_config("qwen25_math_7b_erpo")))
    assert lora.model.lora.rank > 0 and lora.model.lora.export_merged
    assert dataclasses.replace(lora.model, lora=full.model.lora) == full.model
    for section in ("data", "reward", "algorithm", "reference"):
        assert getattr(lora, section) == getattr(full, section), section
    # one GPU: a smaller share of it for vLLM, no ZeRO partitioning, LoRA's learning rate
    assert dataclasses.replace(lora.rollout, gpu_memory_utilization=full.rollout.gpu_memory_utilization) == full.rollout
    assert dataclasses.replace(lora.trainer, zero_stage=full.trainer.zero_stage, lr=full.trainer.lr) == full.trainer


def test_missing_peft_gives_install_hint(base_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"erpo\[lora\]"):
        L.apply_lora(load_base(base_dir), LoraConfig(rank=RANK))
    assert not L.is_lora_model(load_base(base_dir))
