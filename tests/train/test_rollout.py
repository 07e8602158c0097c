"""erpo.rollout.hf.HFRollout: grouping, EOS handling, seeds, and sampling log-probs that match the model."""
import logging

import pytest
import torch

from erpo.models.tiny import build_model, build_tokenizer
from erpo.rollout.engine import RolloutBatch, RolloutEngine
from erpo.rollout.hf import HFRollout


@pytest.fixture(scope="module")
def setup():
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_layers=1)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("1+1=?", "12+30=?", "7-2=?")]
    return model, tokenizer, prompts


def test_groups_lengths_and_truncation(setup):
    model, tokenizer, prompts = setup
    batch = HFRollout(model, tokenizer, batch_size=2).generate(prompts, n=3, temperature=1.0, max_new_tokens=6, seed=1)
    assert isinstance(batch, RolloutBatch)
    assert batch.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert batch.prompt_ids == [p for p in prompts for _ in range(3)]
    for ids, logp, truncated in zip(batch.response_ids, batch.response_logp, batch.truncated):
        assert 1 <= len(ids) <= 6 and len(logp) == len(ids)
        eos_at = [i for i, t in enumerate(ids) if t == tokenizer.eos_token_id]
        assert truncated == (not eos_at)
        assert not eos_at or eos_at == [len(ids) - 1]  # cut right after the first EOS
        assert all(x <= 0 for x in logp)


def test_seed_makes_generation_reproducible(setup):
    model, tokenizer, prompts = setup
    engine = HFRollout(model, tokenizer)
    a = engine.generate(prompts, n=2, temperature=1.0, max_new_tokens=5, seed=7)
    b = engine.generate(prompts, n=2, temperature=1.0, max_new_tokens=5, seed=7)
    c = engine.generate(prompts, n=2, temperature=1.0, max_new_tokens=5, seed=8)
    assert a.response_ids == b.response_ids and a.response_ids != c.response_ids
    model.train()
    engine.generate(prompts[:1], n=1, temperature=1.0, max_new_tokens=2, seed=0)
    assert model.training
    model.eval()


def test_sampling_logp_matches_the_model_at_the_temperature(setup):
    model, tokenizer, prompts = setup
    temperature = 0.7
    batch = HFRollout(model, tokenizer).generate(prompts, n=2, temperature=temperature, max_new_tokens=5, seed=3)
    for prompt, response, logp in zip(batch.prompt_ids, batch.response_ids, batch.response_logp):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logp), expected, atol=1e-4, rtol=1e-4)


def test_the_checkpoints_generation_defaults_do_not_reshape_sampling():
    """A checkpoint's generation_config.json (Qwen2.5-Instruct ships repetition_penalty 1.05) fills what generate
    leaves unset: the engine still samples from the policy at the temperature, and stops only at EOS or the limit."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_layers=1)
    model.generation_config.update(repetition_penalty=3.0, no_repeat_ngram_size=1, min_new_tokens=4, typical_p=0.5)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("1+1=?", "12+30=?")]
    temperature = 0.7
    batch = HFRollout(model, tokenizer).generate(prompts, n=2, temperature=temperature, max_new_tokens=8, seed=3)
    for prompt, response, logp in zip(batch.prompt_ids, batch.response_ids, batch.response_logp):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logp), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs,match", [({"n": 0}, "n > 0"), ({"temperature": 0.0}, "temperature"),
                                          ({"max_new_tokens": 0}, "max_new_tokens")])
def test_bad_arguments(setup, kwargs, match):
    model, tokenizer, prompts = setup
    args = {"n": 1, "temperature": 1.0, "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        HFRollout(model, tokenizer).generate(prompts, **args)
    with pytest.raises(ValueError, match="non-empty"):
        HFRollout(model, tokenizer).generate([[1], []], n=1, temperature=1.0, max_new_tokens=2)


def test_engine_interface():
    assert issubclass(HFRollout, RolloutEngine)
    with pytest.raises(TypeError):
        RolloutEngine()


def test_vllm_only_settings_are_warned_of_with_the_hf_engine(caplog):
    from erpo.cli.args import config_from_args
    from erpo.cli.commands import build_parser
    from erpo.rollout import warn_vllm_only_settings

    def warnings(*sets):
        cfg = config_from_args(build_parser().parse_args(["train", "--set", *sets]))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="erpo"):
            warn_vllm_only_settings(cfg.rollout)
        return [record.getMessage() for record in caplog.records]

    assert warnings("rollout.engine=hf") == []
    assert warnings("rollout.engine=hf", "rollout.enable_sleep_mode=true", "rollout.tensor_parallel_size=2") == [
        "rollout.tensor_parallel_size=2 is ignored by the hf engine (vLLM only: rollout.engine=vllm)",
        "rollout.enable_sleep_mode=True is ignored by the hf engine (vLLM only: rollout.engine=vllm)"]
    assert warnings("rollout.engine=vllm", "rollout.enable_sleep_mode=true") == []
