"""ERPO's settings are checked by one rule (erpo.terms) in every trainer that exposes them: `erpo train`'s config,
ERPOTrainer's ERPOConfig, verl's ERPOSettings and OpenRLHF's ERPOPolicyLoss refuse the same bad Query-KL
coefficient, each names its own field, and read the reference for the same settings."""
import math

import pytest

from erpo.config import Config, apply_overrides, resolve
from erpo.integrations.openrlhf import ERPOPolicyLoss
from erpo.integrations.verl import ERPOSettings
from erpo.terms import needs_reference

trl = pytest.importorskip("trl", exc_type=ModuleNotFoundError)
from erpo.integrations.trl import ERPOConfig  # noqa: E402


def erpo_train(tmp_path, **settings):
    """`erpo train`'s resolved config with `algorithm.<key>=<value>` for each setting."""
    return resolve(apply_overrides(Config(output_dir=str(tmp_path)), [f"algorithm.{k}={v}" for k, v in
                                                                      settings.items()]))


def trl_config(tmp_path, **settings):
    return ERPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **settings)


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf])
def test_every_trainer_refuses_the_same_qkl_coef(tmp_path, value):
    for make, name in [(lambda: erpo_train(tmp_path, qkl_coef=value), "algorithm.qkl_coef"),
                       (lambda: trl_config(tmp_path, qkl_coef=value), "qkl_coef"),
                       (lambda: ERPOSettings(qkl_coef=value), "erpo.qkl_coef"),
                       (lambda: ERPOPolicyLoss(qkl_coef=value), "qkl_coef")]:
        with pytest.raises(ValueError, match=rf"^{name} must be a finite number >= 0, got"):
            make()


@pytest.mark.parametrize("qkl_coef, query_weight, expected", [
    (0.0, "none", False), (0.0, "static", True), (0.01, "none", True), (0.0, "current", False)])
def test_the_reference_is_read_for_the_same_settings(tmp_path, qkl_coef, query_weight, expected):
    assert needs_reference(qkl_coef, query_weight) is expected
    assert trl_config(tmp_path, qkl_coef=qkl_coef, query_weight=query_weight).needs_reference is expected
    if query_weight != "current":   # verl has no current w(q)
        assert ERPOSettings(qkl_coef=qkl_coef, query_weight=query_weight).needs_reference is expected


def test_query_weights_and_estimators_name_their_choices(tmp_path):
    with pytest.raises(ValueError, match=r"erpo.query_weight must be one of \['static', 'none'\], got 'current'"):
        ERPOSettings(query_weight="current")
    with pytest.raises(ValueError, match=r"erpo.qkl_estimator must be one of \['k1', 'k2', 'k3'\]"):
        ERPOSettings(qkl_estimator="k3-token")
    with pytest.raises(ValueError, match=r"query_weight must be one of \['static', 'current', 'none'\]"):
        trl_config(tmp_path, query_weight="current-unclipped")
    assert erpo_train(tmp_path, query_weight="current-unclipped").algorithm.query_weight == "current-unclipped"


def test_verl_names_an_unknown_erpo_setting_as_launched():
    with pytest.raises(ValueError, match=r"^\+erpo.qkl_cof is not an ERPO setting: did you mean \+erpo.qkl_coef\?$"):
        ERPOSettings.from_block({"qkl_cof": 0.02})
    with pytest.raises(ValueError, match=r"^\+erpo.alpha is not an ERPO setting: did you mean \+erpo.qkl_coef\?$"):
        ERPOSettings.from_block({"alpha": 0.02})   # the paper's symbol (did_you_mean's PAPER_NAMES)
    with pytest.raises(ValueError, match=r"^\+erpo.gamma is not an ERPO setting: ERPO's settings are erpo.qkl_coef, "
                                         r"erpo.qkl_estimator, erpo.query_weight, erpo.ref_cache$"):
        ERPOSettings.from_block({"gamma": 0.02})
    assert ERPOSettings.from_block({"qkl_coef": 0.02, "ref_cache": "c.json"}) == ERPOSettings(qkl_coef=0.02,
                                                                                              ref_cache="c.json")
