"""The loss options are defined once (LossOptions): every entry point's signature lists them with their defaults
and types, a misspelled one is refused with the closest name, and docs/API.md's options table is that list."""
import ast
import dataclasses
import inspect
import re
import typing
from pathlib import Path

import pytest
import torch

from erpo_kernels import (
    ERPOLoss,
    FusedLinearERPOLoss,
    LossOptions,
    did_you_mean,
    erpo_loss,
    fused_linear_erpo_loss,
    logprob_erpo_loss,
    padded_erpo_loss,
)

API = (Path(__file__).resolve().parents[2] / "docs" / "API.md").read_text()
ENTRY_POINTS = [erpo_loss, fused_linear_erpo_loss, padded_erpo_loss, logprob_erpo_loss, ERPOLoss,
                FusedLinearERPOLoss]
OPTIONS = dataclasses.fields(LossOptions)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda entry: entry.__name__)
def test_signature_lists_every_option_keyword_only_with_its_default_and_type(entry):
    parameters = inspect.signature(entry).parameters
    types = typing.get_type_hints(LossOptions)
    for option in OPTIONS:
        parameter = parameters[option.name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert parameter.default == option.default and parameter.annotation == types[option.name]
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def test_help_shows_the_options():
    assert "qkl_coef: float = 0.01" in str(inspect.signature(erpo_loss))
    assert erpo_loss.__doc__.startswith("The ERPO loss on logits")   # the docstring is the function's own


def call(entry, **options):
    """Call `entry` with `options` (and CPU arguments, on every machine: the options check never reaches them)."""
    if entry in (ERPOLoss, FusedLinearERPOLoss):
        return entry(**options)
    cpu = torch.device("cpu")
    rows = (torch.zeros(2, 3, device=cpu), torch.zeros(2, dtype=torch.long, device=cpu),
            torch.ones(2, dtype=torch.long, device=cpu), torch.zeros(2, device=cpu))
    if entry is padded_erpo_loss:
        return entry(advantages=torch.zeros(1, device=cpu), completion_mask=torch.ones(1, 2, device=cpu), **options)
    if entry is fused_linear_erpo_loss:
        return entry(rows[0], torch.zeros(4, 3, device=cpu), *rows[1:], advantages=torch.zeros(1, device=cpu),
                     **options)
    if entry is logprob_erpo_loss:
        return entry(torch.zeros(2, device=cpu), *rows[2:], advantages=torch.zeros(1, device=cpu), **options)
    return entry(*rows, advantages=torch.zeros(1, device=cpu), **options)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda entry: entry.__name__)
@pytest.mark.parametrize("typo, meant", [("qkl_coeff", "qkl_coef"), ("loss_aggregation", "loss_agg"),
                                         ("ref_querylogp", "ref_query_logp"), ("backnd", "backend")])
def test_a_misspelled_keyword_names_the_closest_one(entry, typo, meant):
    if meant == "ref_query_logp" and entry in (ERPOLoss, FusedLinearERPOLoss):
        meant = None   # the modules take the tensors in forward, not in the constructor
    with pytest.raises(TypeError) as error:
        call(entry, **{typo: 1})
    message = str(error.value)
    assert f"unexpected keyword argument {typo!r}" in message and "\n" not in message
    assert (f"did you mean {meant!r}?" in message) if meant else "did you mean" not in message


def test_loss_options_from_kwargs_names_the_closest_option():
    with pytest.raises(TypeError, match="'clip_hgh'; did you mean 'clip_high'"):
        LossOptions.from_kwargs({"clip_hgh": 0.3})


def test_did_you_mean_is_the_closest_name_as_the_caller_writes_it():
    """The one suggestion behind every "unknown name" error (the kernels' keywords, verl's `+erpo.*` settings,
    OpenRLHF's actor keywords): difflib's closest name, written as the caller spells its names, or None."""
    names = [field.name for field in OPTIONS]
    assert did_you_mean("clip_hgh", names) == "did you mean 'clip_high'?"
    verl = did_you_mean("qkl_cof", ["qkl_coef", "ref_cache"], spelled="+erpo.{}".format)
    assert verl == "did you mean +erpo.qkl_coef?"
    assert did_you_mean("entirely_else", names) is None
    assert did_you_mean("fused_lin", ["fused_linear"]) == "did you mean 'fused_linear'?"   # ratio 6/7 >= 0.6
    assert did_you_mean("fused_lin", ["fused_linear"], cutoff=0.9) is None                 # and < 0.9
    # the paper's symbols name the options that hold them, where the caller takes those options
    assert did_you_mean("alpha", names) == "did you mean 'qkl_coef'?"
    assert did_you_mean("beta", ["policy_kl_coef"], spelled="+erpo.{}".format) == "did you mean +erpo.policy_kl_coef?"
    assert did_you_mean("alpha", ["alphas", "r"]) == "did you mean 'alphas'?"            # no qkl_coef here: by spelling


def api_options_table() -> list[tuple[str, object]]:
    """API.md's options table: (option name, default as a Python value), in the table's order."""
    section = API.split("### Options (keyword-only) and defaults")[1].split("\n### ")[0]
    table = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`(\w+)`", cells[0])
        defaults = [ast.literal_eval(value.strip()) for value in cells[1].split(",")]
        assert len(names) == len(defaults), line
        table += zip(names, defaults)
    return table


def test_api_options_table_is_loss_options():
    table = api_options_table()
    assert sorted(name for name, _ in table) == sorted(option.name for option in OPTIONS)   # each once
    assert dict(table) == {option.name: option.default for option in OPTIONS}


def test_options_hash_once_as_the_dataclass_and_equal_options_alike():
    """LossOptions keeps its hash after the first (a loss call looks its options up in caches): equal options hash
    alike whichever was hashed first, unequal ones apart, and pickle / copy carry the fields, not the cached hash
    (a string's hash differs from one process to the next)."""
    import copy
    import pickle

    first, second = LossOptions(qkl_coef=0.02, pg_objective="cispo"), LossOptions(qkl_coef=0.02, pg_objective="cispo")
    assert hash(first) == hash(first) == hash(second) and first == second
    assert hash(first) == hash(tuple(getattr(first, field.name) for field in OPTIONS))  # the dataclass's own rule
    assert {first: 1}[second] == 1 and LossOptions(qkl_coef=0.03) not in {first: 1}
    for clone in (pickle.loads(pickle.dumps(first)), copy.deepcopy(first), copy.copy(first),
                  dataclasses.replace(first)):
        assert "_hash" not in vars(clone) and clone == first and hash(clone) == hash(first)
    assert dataclasses.asdict(first) == dataclasses.asdict(second) and "_hash" not in dataclasses.asdict(first)
