"""Every documented setting of the verl loss trains, saves and resumes on verl's real FSDP engine: each case takes
two optimizer steps (verl's `train_batch`) with the ERPO loss, saving verl's checkpoint after the first, the cache
scored by the engine at start (verl's compute_log_prob); a new engine loads that checkpoint, reads the cache back
from its file (without scoring: its weights are no longer theta0) and takes the second step again: the same loss,
metrics and weights. The cases cover the Query-KL on and off, both query-weight modes, each loss aggregation,
verl's KL loss and entropy bonus, remove-padding or padded batches, dynamic batch sizes (gradient accumulation over
token-budget micro-batches) and bf16 mixed precision."""
import tempfile

import pytest
import torch

from erpo.integrations.verl import ERPOSettings, erpo_loss_fn

# that file sets verl up for a CPU (and skips without verl); its `tiny` fixture holds the HF model too
from test_verl_integration import (  # noqa: F401
    actor_config,
    batch,
    engine_reference,
    metric_values,
    prompt_ids_of,
    tiny,
    verl_engine,
)

CASES = {
    "qkl-static-token-mean-kl-entropy": (dict(), dict(loss_agg_mode="token-mean"),
                                         dict(qkl_coef=0.5, query_weight="static"), True),
    "off-none-seq-mean-token-sum-norm-padded": (dict(use_remove_padding=False),
                                                dict(loss_agg_mode="seq-mean-token-sum-norm", use_kl_loss=False,
                                                     entropy_coeff=0.0),
                                                dict(qkl_coef=0.0, query_weight="none"), False),
    "qkl-none-seq-mean-token-mean-bf16": (dict(param_dtype="bf16"), dict(loss_agg_mode="seq-mean-token-mean"),
                                          dict(qkl_coef=0.5, query_weight="none"), True),
    "off-static-token-sum-dynamic": (dict(use_dynamic_bsz=True, max_token_len=24),
                                     dict(loss_agg_mode="token-sum", use_dynamic_bsz=True),
                                     dict(qkl_coef=0.0, query_weight="static"), True),
    "qkl-static-seq-mean-token-sum": (dict(), dict(loss_agg_mode="seq-mean-token-sum", use_kl_loss=False),
                                      dict(qkl_coef=0.5, query_weight="static"), True),
}


def step(engine, data, loss_fn) -> dict:
    with engine.train_mode():
        return engine.train_batch(data.clone(), loss_fn)


def weights(engine) -> dict:
    return {name: p.full_tensor().detach().clone() for name, p in engine.module.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_setting_trains_saves_and_resumes(tiny, tmp_path, case, monkeypatch):  # noqa: F811  (the imported fixture)
    engine_settings, actor_settings, erpo_settings, entropy = CASES[case]
    config = actor_config(**actor_settings)
    settings = ERPOSettings(**erpo_settings)
    def loss_fn(engine, scored: bool):   # the cache read from its file each time, as a restarted verl run reads it
        reference, group = engine_reference(tiny, engine, prompt_ids_of(batch(tiny, engine, nested=False)),
                                            tmp_path / "cache.json")
        assert bool(group.calls) == scored
        return erpo_loss_fn(config, settings, reference if settings.needs_reference else None)

    engine = verl_engine.build_engine(tiny[0], lr=1e-2, **engine_settings)
    data = batch(tiny, engine, entropy=entropy, **({"with_is": False} if "use_dynamic_bsz" in actor_settings else {}))
    step(engine, data, loss_fn(engine, scored=True))
    # verl's save takes a file lock named after the folder in the temporary directory and leaves it there: here
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    engine.save_checkpoint(str(tmp_path / "step-1"), global_step=1)
    saved = weights(engine)
    second = step(engine, data, loss_fn(engine, scored=False))
    after = weights(engine)
    assert any(not torch.equal(after[name], value) for name, value in saved.items())   # step 2 trains

    resumed = verl_engine.build_engine(tiny[0], lr=1e-2, **engine_settings)
    # verl restores the "cpu" platform's RNG through torch.cpu.set_rng_state, which torch lacks: the CPU generator's
    monkeypatch.setattr(torch.cpu, "set_rng_state", torch.set_rng_state, raising=False)
    resumed.load_checkpoint(str(tmp_path / "step-1"), del_local_after_load=False)
    again = step(resumed, data, loss_fn(resumed, scored=False))
    expected, actual = metric_values(second), metric_values(again)
    assert actual.keys() == expected.keys()
    for name, values in expected.items():
        assert actual[name] == pytest.approx(values, rel=1e-5, abs=1e-7), name
    for name, value in weights(resumed).items():
        torch.testing.assert_close(value, after[name], rtol=1e-5, atol=1e-7, msg=name)
