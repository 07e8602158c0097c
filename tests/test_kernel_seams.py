"""The module seams of erpo_kernels: no import cycle, and the torch reference never imports the Triton path (so it
stays an independent oracle of the kernels); the public inputs object and option choices work as documented."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import erpo_kernels
from erpo_kernels import OPTION_CHOICES, LossInputs, LossOptions, erpo_loss
from helpers import loss_inputs, random_batch

PACKAGE = Path(erpo_kernels.__file__).parent
REFERENCE_SIDE = ("reference", "objective", "common", "validation", "segment", "layout", "torch_fused_linear")


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports ("<triton>" for the triton package itself)."""
    graph = {}
    for path in PACKAGE.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(name and name.split(".")[0] == "triton" for name in names):
                deps.add("<triton>")
        graph[path.stem] = deps
    return graph


def reachable(graph, module) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_import_cycle():
    graph = import_graph()
    assert {"api", "fused_linear", "triton_fused_linear", "reference"} <= set(graph)
    assert [module for module in graph if module in reachable(graph, module)] == []


@pytest.mark.parametrize("module", REFERENCE_SIDE)
def test_reference_side_does_not_import_triton(module):
    reached = reachable(import_graph(), module)
    assert not {dep for dep in reached if dep.startswith("triton") or dep == "<triton>"}, reached


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
