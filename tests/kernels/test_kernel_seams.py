"""The seams of erpo_kernels the import contract cannot check: the public inputs object and the option choices work
as documented. (No import cycle and a torch reference that never imports the Triton path, so it stays an independent
oracle of the kernels: the import contract in setup.cfg, run by tests/repo/test_lint.py.)"""
import dataclasses

import pytest
import torch

from erpo_kernels import MAX_QUERY_WEIGHT, OPTION_CHOICES, LossInputs, LossOptions, erpo_loss, query_weights
from helpers import loss_inputs, random_batch


def test_loss_inputs_object_is_the_keyword_call():
    batch = random_batch(num_rows=40, vocab=50, seed=3)
    kwargs = loss_inputs(batch)
    inputs = LossInputs(**kwargs)
    assert inputs.as_kwargs().keys() == {"advantages", "ref_query_logp", "query_weight", "old_logp", "ref_logp",
                                         "token_weight", "rollout_logp"}
    rows = (batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"])
    direct = erpo_loss(*rows, **kwargs, policy_kl_coef=0.1, backend="torch")
    via_object = erpo_loss(*rows, **inputs.as_kwargs(), policy_kl_coef=0.1, backend="torch")
    assert torch.equal(direct.loss, via_object.loss)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.advantages = None


def test_option_choices_are_what_loss_options_accepts():
    assert set(OPTION_CHOICES) == {"qkl_estimator", "loss_agg", "ratio_level", "entropy_agg", "pg_objective"}
    for name, choices in OPTION_CHOICES.items():
        assert getattr(LossOptions(), name) in choices
        for value in choices:
            assert getattr(LossOptions(**{name: value}), name) == value
        with pytest.raises(ValueError, match=name):
            LossOptions(**{name: "nonsense"})


@pytest.mark.parametrize("options,error,match", [
    ({"kl_clamp": 0.0}, ValueError, "kl_clamp must be None or a finite number > 0"),
    ({"pg_log_ratio_clamp": float("inf")}, ValueError, "pg_log_ratio_clamp must be None or a finite number > 0"),
    ({"policy_kl_bias_correction": 1}, TypeError, "policy_kl_bias_correction must be True or False"),
])
def test_parity_options_are_checked(options, error, match):
    with pytest.raises(error, match=match):
        LossOptions(**options)


def test_query_weights_clip_at_the_one_constant():
    """w(q)'s upper clip is MAX_QUERY_WEIGHT (2, paper appendix C), which erpo's trainer and ERPOTrainer import."""
    ell = torch.tensor([-1.0, -10.0, -100.0], dtype=torch.float64)   # mean surprisal 37: raw weights 37, 3.7, 0.37
    assert MAX_QUERY_WEIGHT == 2.0
    torch.testing.assert_close(query_weights(ell), torch.tensor([2.0, 2.0, 0.37]))
    torch.testing.assert_close(query_weights(ell, max_weight=None), torch.tensor([37.0, 3.7, 0.37]))
