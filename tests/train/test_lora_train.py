"""`erpo train` with LoRA adapters (model.lora.rank > 0) on a very small tiny-model run, plain torch updater:
only the adapters train, the reference is the policy with its adapters off, exports, exact resume."""
import pytest
import torch
from safetensors.torch import load_file

import erpo.train.loop as trainer_module
import fake_vllm
from erpo.config import Config, apply_overrides, resolve
from erpo.models.loading import load_causal_lm, model_path_for
from erpo.models.lora import MERGED_DIR, inference_weights, is_adapter_dir, peft_model_of
from erpo.train.loop import train
from run_metrics import assert_same_metrics, metrics_by_step


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The tiny theta0's cache, and a reward that varies where the barely trained model is never correct."""
    root = tmp_path_factory.mktemp("theta0")
    (root / "varied_reward.py").write_text(
        "def varied(prompts, completions, **columns):\n    return [sum(map(ord, c)) % 7 / 7 for c in completions]\n")
    return str(root)


def lora_cfg(out, cache_dir, *overrides):
    return resolve(apply_overrides(Config(), [
        f"output_dir={out}", f"model.cache_dir={cache_dir}", f"reward.functions=[{cache_dir}/varied_reward.py:varied]",
        "tiny.hidden_size=16", "tiny.intermediate_size=32", "tiny.num_layers=1", "tiny.num_heads=2",
        "tiny.num_kv_heads=1", "tiny.sft_steps=30", "tiny.sft_examples=64",
        "data.num_examples=24", "rollout.n=4", "rollout.max_new_tokens=8", "trainer.max_steps=2",
        "trainer.rollout_batch_size=4", "trainer.update_batch_size=2", "trainer.micro_batch_size=6",
        "trainer.lr=0.01", "trainer.min_lr_ratio=1.0", "model.lora.rank=4", "logging.progress_bar=false",
        "logging.tensorboard=false", "logging.plot=false", *overrides]))


@pytest.fixture
def kept_updater(monkeypatch):
    """The run's updater, kept for inspection after `train` returns."""
    kept = {}
    build = trainer_module.build_models

    def keep(*args, **kwargs):
        kept["updater"], kept["reference"] = build(*args, **kwargs)
        return kept["updater"], kept["reference"]
    monkeypatch.setattr(trainer_module, "build_models", keep)
    return kept


def test_grpo_with_lora_trains_only_the_adapters(tmp_path, cache_dir, kept_updater):
    out = tmp_path / "run"
    cfg = lora_cfg(out, cache_dir, "algorithm.name=grpo", "model.lora.export_merged=true",
                   "model.gradient_checkpointing=true")
    train(cfg)
    records = metrics_by_step(out)
    assert sorted(records) == [1, 2, 3, 4]
    for r in records.values():
        assert r["reward"] is not None and r["qkl"] is not None and r["policy_kl"] is not None
    assert records[1]["qkl"] == pytest.approx(0.0, abs=1e-6)           # fresh adapters: exactly theta0
    assert records[1]["policy_kl"] == pytest.approx(0.0, abs=1e-6)
    assert records[4]["policy_kl"] > 0 and records[4]["qkl"] > 0        # the adapted policy moved away from theta0

    updater = kept_updater["updater"]
    model = peft_model_of(updater.model)
    assert isinstance(kept_updater["reference"], trainer_module.AdaptersDisabled)   # no frozen copy was loaded
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    optimized = [p for group in updater.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in adapters}
    assert all(float(p.detach().abs().max()) > 0 for n, p in model.named_parameters() if "lora_B" in n)  # B moved
    theta0 = dict(load_causal_lm(model_path_for(cfg), dtype=torch.float32, device="cpu").named_parameters())
    base = {n.replace(".base_layer.", "."): p for n, p in model.get_base_model().named_parameters() if "lora_" not in n}
    assert base.keys() == theta0.keys()
    assert all(torch.equal(base[n], theta0[n]) for n in theta0)        # base weights bitwise unchanged

    # checkpoints hold the adapters only; final/ is the adapter export, final/merged/ the merged model
    saved = torch.load(out / "checkpoints" / "step-2" / "model.pt", weights_only=True)
    assert saved and all("lora_" in k for k in saved)
    assert is_adapter_dir(out / "final") and is_adapter_dir(out / "checkpoints" / "step-2" / "hf")
    merged = load_file(out / "final" / MERGED_DIR / "model.safetensors")
    ids = torch.tensor([[5, 9, 12, 30, 41, 7]])
    with torch.no_grad():
        policy_logits = model(input_ids=ids).logits
        for path in (out / "final", out / "final" / MERGED_DIR):
            loaded = load_causal_lm(str(path), dtype=torch.float32, device="cpu")
            torch.testing.assert_close(loaded(input_ids=ids).logits, policy_logits, rtol=1e-5, atol=1e-5)
    assert not torch.equal(merged["model.layers.0.mlp.up_proj.weight"], theta0["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("updater", ["torch", "deepspeed"])
def test_lora_resume_matches_the_uninterrupted_run(tmp_path, cache_dir, updater):
    """Stopped after 1 rollout step, resumed to 2: the same metrics and adapters as one 2-step run (the base
    weights come back from theta0, the adapters, AdamW state, schedule and RNG from the checkpoint, which holds
    no base weight: DeepSpeed's engine at ZeRO-2 in one process, or the torch bundle)."""
    full, halves = tmp_path / "full", tmp_path / "halves"
    settings = (f"trainer.updater={updater}", f"trainer.zero_stage={2 if updater == 'deepspeed' else 0}")
    train(lora_cfg(full, cache_dir, *settings))
    train(lora_cfg(halves, cache_dir, "trainer.max_steps=1", *settings))
    train(lora_cfg(halves, cache_dir, *settings), resume=True)
    expected, actual = metrics_by_step(full), metrics_by_step(halves)
    assert sorted(expected) == [1, 2, 3, 4]
    assert len({round(r["loss"], 12) for r in expected.values()}) > 1
    assert_same_metrics(actual, expected)
    a, b = (load_file(run / "final" / "adapter_model.safetensors") for run in (halves, full))
    assert sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


@pytest.mark.parametrize("updater", ["torch", "deepspeed"])
def test_resume_refuses_other_lora_settings(tmp_path, cache_dir, updater):
    out = tmp_path / "run"
    train(lora_cfg(out, cache_dir, "trainer.max_steps=1", f"trainer.updater={updater}"))
    with pytest.raises(ValueError, match=r"trains other parameters than this model \(14 saved, 4 here; .*\): resume "
                                         r"with the model settings \(model.lora\) it was saved with"):
        train(lora_cfg(out, cache_dir, "model.lora.target_modules=[q_proj,v_proj]", f"trainer.updater={updater}"),
              resume=True)


def test_vllm_engine_holds_the_merged_policy(tmp_path, cache_dir, kept_updater, monkeypatch):
    """rollout.engine=vllm (a recording fake): after the optimizer steps the engine holds every weight of the plain
    model with the trained adapters merged in (what sampling then uses), under the plain model's names."""
    fake_vllm.install(monkeypatch)
    cfg = lora_cfg(tmp_path / "run", cache_dir, "rollout.engine=vllm", "trainer.max_steps=1")
    train(cfg)
    loaded = fake_vllm.LLM.instances[-1].model.loaded
    merged = {name: tensor.clone() for name, tensor in inference_weights(kept_updater["updater"].model)}
    theta0 = dict(load_causal_lm(model_path_for(cfg), dtype=torch.float32, device="cpu").named_parameters())
    assert loaded.keys() == merged.keys() == theta0.keys()
    assert all(torch.equal(loaded[n], merged[n]) for n in merged)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(loaded[name], theta0[name])                    # the trained adapters, merged
