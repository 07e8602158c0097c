"""erpo.config: YAML onto the typed schema, --set overrides, algorithm presets, cross-field checks."""
import pytest
import yaml

from erpo.cli.args import shipped_config
from erpo.config import Config, apply_overrides, dump_yaml, from_dict, load_config, resolve, updates_per_rollout


def test_defaults_are_the_tiny_run_and_resolve_to_the_erpo_preset():
    cfg = resolve(Config())
    assert cfg.model.name_or_path == "tiny"
    assert (cfg.algorithm.qkl_coef, cfg.algorithm.policy_kl_coef, cfg.algorithm.query_weight) == (0.01, 0.0, "static")
    assert resolve(load_config(shipped_config("tiny"))) == cfg


def test_the_loss_workspace_default_is_the_loss_functions():
    """trainer.loss_workspace_mib's default, in bytes, is fused_linear_erpo_loss's workspace_bytes default (1 GiB)."""
    import inspect

    from erpo_kernels import fused_linear_erpo_loss

    default = inspect.signature(fused_linear_erpo_loss).parameters["workspace_bytes"].default
    assert Config().trainer.loss_workspace_mib << 20 == default == 1 << 30


@pytest.mark.parametrize("name,qkl,pkl,weight", [("grpo", 0.0, 0.01, "none"), ("grpo+qw", 0.0, 0.01, "static"),
                                                  ("grpo+qkl", 0.01, 0.0, "none"), ("erpo", 0.01, 0.0, "static")])
def test_presets(name, qkl, pkl, weight):
    cfg = resolve(apply_overrides(Config(), [f"algorithm.name={name}"]))
    assert (cfg.algorithm.qkl_coef, cfg.algorithm.policy_kl_coef, cfg.algorithm.query_weight) == (qkl, pkl, weight)


def test_explicit_fields_beat_the_preset():
    cfg = resolve(apply_overrides(Config(), ["algorithm.name=grpo", "algorithm.policy_kl_coef=0.05",
                                             "algorithm.query_weight=current"]))
    assert cfg.algorithm.policy_kl_coef == 0.05 and cfg.algorithm.query_weight == "current"


def test_overrides_are_typed():
    cfg = apply_overrides(Config(), ["trainer.lr=2e-5", "trainer.max_steps=7", "model.gradient_checkpointing=true",
                                     "reward.functions=[math, format]", "reward.weights=1,0.5",
                                     "algorithm.dual_clip=3", "algorithm.dual_clip=null", "output_dir=x/y"])
    assert cfg.trainer.lr == 2e-5 and cfg.trainer.max_steps == 7 and cfg.model.gradient_checkpointing is True
    assert cfg.reward.functions == ["math", "format"] and cfg.reward.weights == [1.0, 0.5]
    assert cfg.algorithm.dual_clip is None and cfg.output_dir == "x/y"


@pytest.mark.parametrize("override,match", [
    # the nearest key (`did_you_mean`), in full, else the section's keys
    ("trainer.lrr=1", r"^unknown config key 'trainer.lrr': did you mean 'trainer.lr'\?$"),
    ("model.lora.alhpa=1", r"^unknown config key 'model.lora.alhpa': did you mean 'model.lora.alpha'\?$"),
    ("algorithm.alpha=0.1", r"^unknown config key 'algorithm.alpha': did you mean 'algorithm.qkl_coef'\?$"),
    ("algoritm.qkl_coef=1", r"^unknown config key 'algoritm.qkl_coef': did you mean 'algorithm'\?$"),
    ("nosuch.key=1", r"^unknown config key 'nosuch.key': 'nosuch' is not in <root> \(valid: algorithm, data, "),
    ("trainer.zzzz=1", r"^unknown config key 'trainer.zzzz': 'zzzz' is not in trainer \(valid: .*, lr, .*\)$"),
    # one temperature for the engine and the loss: the loss's own option is not a second key that could disagree
    ("algorithm.temperature=0.7", r"'algorithm.temperature'.*the loss's temperature comes from rollout.temperature"),
    ("trainer=1", "is a section"),
    ("trainer.max_steps", "expects key=value"),
])
def test_bad_override_keys(override, match):
    with pytest.raises(ValueError, match=match):
        apply_overrides(Config(), [override])


@pytest.mark.parametrize("override", ["trainer.max_steps=ten", "trainer.max_steps=1.5", "trainer.lr=fast",
                                      "model.gradient_checkpointing=maybe", "trainer.loss_workspace_mib=1.5"])
def test_bad_override_types(override):
    with pytest.raises(TypeError, match=override.split("=")[0]):
        apply_overrides(Config(), [override])


def test_yaml_unknown_key_and_wrong_type(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  lr: 1e-5\n  warmup: 3\n")
    with pytest.raises(ValueError, match=r"^unknown config key 'trainer.warmup': did you mean 'trainer.warmup_ratio"):
        load_config(str(bad))
    with pytest.raises(ValueError, match=r"^unknown config key 'model.lora.alhpa': did you mean 'model.lora.alpha'\?$"):
        from_dict({"model": {"lora": {"alhpa": 16}}})
    with pytest.raises(ValueError, match=r"^unknown config key 'trainer.zzzz': 'zzzz' is not in trainer \(valid: "):
        from_dict({"trainer": {"zzzz": 1}})
    with pytest.raises(ValueError, match=r"'algorithm.temperature' \(the loss's temperature comes from rollout"):
        from_dict({"algorithm": {"temperature": 0.7}})
    with pytest.raises(TypeError, match="rollout.n"):
        from_dict({"rollout": {"n": "eight"}})
    with pytest.raises(TypeError, match="section 'rollout'"):
        from_dict({"rollout": 3})


def test_yaml_round_trip():
    cfg = resolve(apply_overrides(Config(), ["algorithm.name=grpo", "trainer.lr=3e-4"]))
    assert resolve(from_dict(yaml.safe_load(dump_yaml(cfg)))) == cfg


@pytest.mark.parametrize("overrides,match", [
    (["trainer.rollout_batch_size=10", "trainer.update_batch_size=4"], "multiple of"),
    (["trainer.max_steps=0"], "trainer.max_steps"),
    (["algorithm.name=ppo"], "algorithm.name"),
    (["algorithm.qkl_estimator=k4"], "qkl_estimator"),
    (["reward.weights=[1, 2]"], "reward.weights"),
    (["trainer.zero_stage=4"], "zero_stage"),
    (["rollout.temperature=0"], "temperature"),
    (["rollout.importance_sampling_cap=0"], "importance_sampling_cap"),
    (["rollout.engine=vllm", "rollout.temperature=2.5"], r"rollout.temperature=2.5 is outside"),
    (["rollout.engine=vllm", "rollout.temperature=0.005"], r"rollout.temperature=0.005 is outside"),
    (["rollout.engine=vllm", "rollout.gpu_memory_utilization=1.5"],
     r"^rollout.gpu_memory_utilization must be a fraction in \(0, 1\] \(vLLM's share of each GPU's memory\), got 1.5$"),
    (["rollout.engine=vllm", "rollout.gpu_memory_utilization=0"], r"^rollout.gpu_memory_utilization must be .*got 0"),
    (["rollout.engine=vllm", "rollout.top_p=0.9"], r"rollout.top_p=0.9 with rollout.importance_sampling"),
    (["rollout.importance_sampling_correction=true", "rollout.top_p=0.9"], "top_p"),
    (["trainer.keep_last=0"], r"keep_last >= 1.*keep_last=0"),
    (["trainer.save_steps=-1"], r"trainer.save_steps must be >= 0.*got save_steps=-1"),
    (["trainer.save_steps=5", "trainer.keep_every=-5"], r"keep_every >= 0, got .*keep_every=-5"),
    (["trainer.keep_every=10"], r"keep_every=10 keeps checkpoints that are never written.*now 0"),
    (["trainer.save_steps=4", "trainer.keep_every=10"], r"multiple of trainer.save_steps \(now 4"),
    (["trainer.loss_workspace_mib=0"], r"^config key 'trainer.loss_workspace_mib' must be > 0, got 0$"),
    (["rollout.n=1"], r"algorithm.advantage 'grpo' needs rollout.n >= 2 \(a group of one response has advantage 0"),
    (["rollout.n=1", "algorithm.scale_rewards=batch"], r"'grpo' needs rollout.n >= 2"),
    (["rollout.n=1", "algorithm.advantage=rloo"], r"'rloo' needs rollout.n >= 2"),
])
def test_resolve_rejects_inconsistent_configs(overrides, match):
    with pytest.raises(ValueError, match=match):
        resolve(apply_overrides(Config(), overrides))


def test_query_weight_none_is_a_value_not_the_presets_static_weight(tmp_path):
    """algorithm.query_weight=none (w = 1) from --set and from YAML stays "none": read as YAML's null it was left
    unset, and the erpo preset filled in its static w(q). null still means the preset's value."""
    assert resolve(apply_overrides(Config(), ["algorithm.query_weight=none"])).algorithm.query_weight == "none"
    config = tmp_path / "run.yaml"
    config.write_text("algorithm:\n  query_weight: none\n")
    assert resolve(load_config(str(config))).algorithm.query_weight == "none"
    assert resolve(apply_overrides(Config(), ["algorithm.query_weight=null"])).algorithm.query_weight == "static"
    assert apply_overrides(Config(), ["data.num_examples=none"]).data.num_examples is None   # no "none" value there
    with pytest.raises(ValueError, match="'algorithm.query_weight' = 'None'; expected one of"):   # not the preset
        resolve(apply_overrides(Config(), ["algorithm.query_weight=None"]))


def test_one_response_per_prompt_is_accepted_with_the_batch_baseline():
    """rollout.n=1 is refused for the group baselines only: REINFORCE's batch mean still gives non-zero advantages."""
    cfg = resolve(apply_overrides(Config(), ["rollout.n=1", "algorithm.advantage=reinforce"]))
    assert (cfg.rollout.n, cfg.algorithm.advantage) == (1, "reinforce")


def test_importance_sampling_cap_none_is_refused():
    """None (from the Python API; YAML's null is refused by the field's type) is a one-line error, not `None > 0`:
    the kernels would read rollout_is_cap=None as no correction at all while the config asks for one."""
    cfg = Config()
    cfg.rollout.importance_sampling_cap = None
    with pytest.raises(ValueError, match="importance_sampling_cap must be a finite number > 0, got None .*"
                                         "importance_sampling_correction=false"):
        resolve(cfg)


def test_policy_objective_options_reach_the_loss_options():
    """algorithm.* keys named as the kernels' options, validated once by LossOptions."""
    cfg = resolve(apply_overrides(Config(), [
        "algorithm.pg_objective=vespo", "algorithm.vespo_k_pos=1.5", "algorithm.vespo_lambda_neg=0.5",
        "algorithm.off_policy_mask_threshold=0.1", "algorithm.top_entropy_quantile=0.2",
        "algorithm.qkl_linear_beyond=8", "algorithm.sapo_temperature_neg=2", "algorithm.cispo_clip_max=3"]))
    options = cfg.algorithm.loss_options
    assert (options.pg_objective, options.vespo_k_pos, options.vespo_lambda_neg, options.off_policy_mask_threshold,
            options.top_entropy_quantile, options.qkl_linear_beyond, options.sapo_temperature_neg,
            options.cispo_clip_max) == ("vespo", 1.5, 0.5, 0.1, 0.2, 8.0, 2.0, 3.0)
    assert resolve(Config()).algorithm.loss_options.pg_objective == "ppo-clip"
    for overrides, message in ((["algorithm.pg_objective=ppo"], "algorithm.pg_objective"),
                               (["algorithm.cispo_clip_max=0"], "cispo_clip_max must be"),
                               (["algorithm.pg_objective=sapo", "algorithm.dual_clip=3"], "dual_clip applies")):
        with pytest.raises(ValueError, match=message):
            resolve(apply_overrides(Config(), overrides))


def test_top_p_and_high_temperature_allowed_where_scored_alike():
    resolve(apply_overrides(Config(), ["rollout.engine=vllm", "rollout.top_p=0.9",
                                       "rollout.importance_sampling_correction=false"]))
    resolve(apply_overrides(Config(), ["rollout.temperature=2.5"]))     # hf samples at exactly T


def test_paper_recipes():
    erpo = resolve(load_config(shipped_config("qwen25_math_7b_erpo")))
    grpo = resolve(load_config(shipped_config("qwen25_math_7b_grpo")))
    for cfg in (erpo, grpo):
        assert cfg.model.name_or_path == "Qwen/Qwen2.5-Math-7B"
        assert (cfg.rollout.n, cfg.rollout.temperature) == (8, 1.0)
        assert (cfg.trainer.rollout_batch_size, cfg.trainer.update_batch_size, cfg.trainer.max_steps) == (512, 128, 240)
        assert cfg.trainer.lr == 1e-6 and updates_per_rollout(cfg) == 4
        assert (cfg.data.max_prompt_length, cfg.rollout.max_new_tokens) == (1024, 3000)   # Dr.GRPO's 3K
        assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high, cfg.algorithm.dual_clip) == (0.2, 0.3, 3.0)
        assert (cfg.reward.functions, cfg.reward.weights) == (["math", "format"], [0.9, 0.1])   # EasyR1's
        assert cfg.rollout.top_p == 1.0 and cfg.rollout.importance_sampling_correction
        assert cfg.data.template == "paper" and cfg.algorithm.loss_agg == "token-mean"
    algorithm = erpo.algorithm
    assert (algorithm.qkl_coef, algorithm.policy_kl_coef, algorithm.query_weight) == (0.01, 0.0, "static")
    assert (grpo.algorithm.qkl_coef, grpo.algorithm.policy_kl_coef, grpo.algorithm.query_weight) == (0.0, 0.01, "none")
    # the algorithm flag switches a paper config completely (its preset fields are left unset in the file)
    switched = resolve(apply_overrides(load_config(shipped_config("qwen25_math_7b_erpo")), ["algorithm.name=grpo"]))
    assert switched.algorithm == grpo.algorithm


def test_importance_sampling_correction_defaults_to_the_rollout_engine():
    assert resolve(Config()).rollout.importance_sampling_correction is False
    assert resolve(apply_overrides(Config(), ["rollout.engine=vllm"])).rollout.importance_sampling_correction is True
    cfg = resolve(apply_overrides(Config(), ["rollout.engine=vllm", "rollout.importance_sampling_correction=false"]))
    assert cfg.rollout.importance_sampling_correction is False


def test_offload_and_sleep_mode_settings():
    cfg = resolve(Config())
    assert (cfg.trainer.offload_optimizer, cfg.trainer.offload_params, cfg.rollout.enable_sleep_mode) == \
        (False, False, False)
    cfg = resolve(apply_overrides(Config(), ["trainer.zero_stage=3", "trainer.offload_optimizer=true",
                                             "trainer.offload_params=yes", "rollout.enable_sleep_mode=true"]))
    assert (cfg.trainer.offload_optimizer, cfg.trainer.offload_params, cfg.rollout.enable_sleep_mode) == \
        (True, True, True)
    with pytest.raises(ValueError, match="trainer.offload_params needs trainer.zero_stage=3, got 2"):
        resolve(apply_overrides(Config(), ["trainer.zero_stage=2", "trainer.offload_params=true"]))
    with pytest.raises(ValueError, match="trainer.offload_optimizer needs trainer.zero_stage >= 1"):
        resolve(apply_overrides(Config(), ["trainer.offload_optimizer=true"]))
    with pytest.raises(TypeError, match="rollout.enable_sleep_mode"):
        apply_overrides(Config(), ["rollout.enable_sleep_mode=maybe"])


def test_the_algorithm_section_is_the_loss_options_derived():
    """Every field of the kernels' LossOptions is a key of `algorithm` with the kernels' default (or filled by the
    preset), or listed as set elsewhere; each key reaches the resolved LossOptions."""
    import dataclasses

    from erpo.config import CONFIG_LOSS_OPTIONS, LOSS_OPTIONS_ELSEWHERE, PRESET_OPTIONS, AlgorithmConfig
    from erpo_kernels import LossOptions
    names = {f.name for f in dataclasses.fields(LossOptions)}
    assert set(CONFIG_LOSS_OPTIONS) | set(LOSS_OPTIONS_ELSEWHERE) == names
    assert not set(CONFIG_LOSS_OPTIONS) & set(LOSS_OPTIONS_ELSEWHERE)
    algorithm, kernel = AlgorithmConfig(), LossOptions()
    for name in CONFIG_LOSS_OPTIONS:
        assert getattr(algorithm, name) == (None if name in PRESET_OPTIONS else getattr(kernel, name)), name
    changed = {"clip_high": 0.3, "kl_clamp": 4.0, "entropy_agg": "token-mean", "policy_kl_bias_correction": True}
    cfg = resolve(apply_overrides(Config(), [f"algorithm.{k}={v}" for k, v in changed.items()]
                                  + ["rollout.temperature=0.7"]))
    for name, value in changed.items():
        assert getattr(cfg.algorithm.loss_options, name) == value, name
    assert cfg.algorithm.loss_options.temperature == 0.7
