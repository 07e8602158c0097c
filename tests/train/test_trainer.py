"""erpo.train.loop end to end on a very small tiny-model run: metrics, algorithms, several updates per rollout,
checkpoint/resume, cache mismatch, failing reward functions, non-finite losses."""
import json
import math
import os
import statistics
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import erpo.train.loop as trainer_module
import erpo.train.update_step as update_step
from erpo.config import Config, apply_overrides, resolve
from erpo.errors import UserError
from erpo.reference.cache import ReferenceCache, prompt_hash
from erpo.reference.setup import precompute_reference
from erpo.train.loop import PromptSampler, train
from erpo.train.updater import deepspeed_config_for, lr_lambda
from tiny_models import bos_chat_tokenizer, save_tiny_model

REQUIRED = ["step", "reward", "accuracy", "qkl", "policy_kl", "entropy", "loss", "clip_ratio",
            "completions/mean_length", "completions/clipped_ratio", "grad_norm", "lr"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("theta0"))


def small_cfg(out, cache_dir, *overrides):
    cfg = apply_overrides(Config(), [
        f"output_dir={out}", f"model.cache_dir={cache_dir}", "tiny.hidden_size=16", "tiny.intermediate_size=32",
        "tiny.num_layers=1", "tiny.num_heads=2", "tiny.num_kv_heads=1", "tiny.sft_steps=30", "tiny.sft_examples=64",
        "data.num_examples=24", "rollout.n=4", "rollout.max_new_tokens=8", "trainer.max_steps=2",
        "trainer.rollout_batch_size=4", "trainer.update_batch_size=4", "trainer.micro_batch_size=6",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false", *overrides])
    return resolve(cfg)


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_erpo_run_writes_everything(tmp_path, cache_dir):
    out = tmp_path / "run"
    train(small_cfg(out, cache_dir, "logging.tensorboard=true", "logging.plot=true"))
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert "NaN" not in (out / "metrics.jsonl").read_text()   # a metric that does not apply is null, never NaN
    for r in records:
        assert set(REQUIRED) <= set(r)
        assert r["policy_kl"] is None  # ERPO computes no Policy-KL (no reference model: the metric does not apply)
        assert r["rollout_is_weight"] is None and r["rollout_logp_gap_max"] is None   # no importance sampling
        assert math.isfinite(r["qkl"]) and r["qkl"] >= 0 and math.isfinite(r["loss"])
        assert 0 <= r["accuracy"] <= 1 and r["num_samples"] == 16
        # rollout.max_new_tokens=8: a response of 8 tokens without EOS is clipped, one that ended is shorter or as long
        assert 1 <= r["completions/min_length"] <= r["completions/mean_length"] <= r["completions/max_length"] <= 8
        assert 0 <= r["completions/clipped_ratio"] <= 1
        assert r["completions/max_terminated_length"] <= 8
    assert records[0]["qkl"] == pytest.approx(0.0, abs=1e-6)  # theta0 == cached reference at the first step
    for name in ("config.yaml", "reference_cache.json", "final/config.json", "plots/training.png",
                 "checkpoints/step-2/meta.json"):
        assert (out / name).exists(), name
    events = EventAccumulator(str(out / "tb"))   # TensorBoard shows each metric as train/NAME, as TRL's
    events.Reload()
    for name in ("completions/mean_length", "completions/clipped_ratio", "completions/max_terminated_length"):
        shown = [(e.step, e.value) for e in events.Scalars(f"train/{name}")]
        assert shown == [(r["step"], pytest.approx(r[name])) for r in records], name
    # final/ is the last checkpoint's hf/ export, linked rather than written twice
    assert os.path.samefile(out / "final" / "model.safetensors", out / "checkpoints/step-2/hf/model.safetensors")


def test_the_first_step_scores_the_prompts_the_cache_scored(tmp_path, cache_dir):
    """`erpo train` on a user's model directory whose tokenizer is the hard case for a prompt's first token
    (`bos_chat_tokenizer`: the chat template writes the BOS, the tokenizer adds one to bare text too, the BOS is the pad
    token), a JSONL with the same problem in two rows of different answers and one prompt over data.max_prompt_length
    (dropped with skip_invalid): the cache holds exactly the kept prompts, each tokenized as built by hand (one user
    turn through the chat template with the generation prompt, tokenized without special tokens: one BOS), and the
    first step's Query-KL is 0."""
    tokenizer = bos_chat_tokenizer()
    model_dir = save_tiny_model(tmp_path / "model", tokenizer)
    problems = ["1+1=?", "12+30=?", "1+1=?", "7-2=?", "9*" + "9" * 40 + "=?"]
    source = tmp_path / "data.jsonl"
    source.write_text("".join(json.dumps({"problem": p, "answer": str(i)}) + "\n" for i, p in enumerate(problems)))
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match="dropped 1 invalid training record"):
        train(small_cfg(out, cache_dir, f"model.name_or_path={model_dir}", f"data.source={source}",
                        "data.num_examples=null", "data.max_prompt_length=40", "data.skip_invalid=true",
                        "trainer.max_steps=1", "trainer.save_hf=false"))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in problems[:4]]
    by_hand = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert all(ids[0] == tokenizer.bos_token_id != ids[1] for ids in by_hand)
    assert set(ReferenceCache.load(str(out / "reference_cache.json")).entries) == set(map(prompt_hash, by_hand))
    assert read_metrics(out)[0]["qkl"] == pytest.approx(0.0, abs=1e-6)


def test_grpo_logs_policy_kl_and_qkl(tmp_path, cache_dir):
    out = tmp_path / "grpo"
    train(small_cfg(out, cache_dir, "algorithm.name=grpo", "trainer.save_hf=false"))
    records = read_metrics(out)
    assert all(r["policy_kl"] is not None and r["qkl"] is not None for r in records)
    assert records[0]["policy_kl"] == pytest.approx(0.0, abs=1e-6)
    # no export in the checkpoints: final/ is written from the model itself
    assert not (out / "checkpoints/step-2/hf").exists() and (out / "final/model.safetensors").is_file()


def test_several_updates_per_rollout_and_variants(tmp_path, cache_dir):
    out = tmp_path / "multi"
    train(small_cfg(out, cache_dir, "trainer.update_batch_size=2", "trainer.micro_batch_size=3",
                    "algorithm.query_weight=current", "algorithm.qkl_estimator=k3-token",
                    "algorithm.filter_groups=true", "algorithm.mask_truncated=true", "algorithm.clip_high=0.28",
                    "model.gradient_checkpointing=true"))
    records = read_metrics(out)
    steps = [(r["step"], r["rollout_step"]) for r in records]
    assert steps == sorted(steps) and {rs for _, rs in steps} <= {1, 2}
    assert all(r["query_weight_mean"] is not None for r in records)


@pytest.mark.parametrize("objective", [
    ["algorithm.pg_objective=vespo", "rollout.importance_sampling_correction=true",
     "algorithm.off_policy_mask_threshold=0.05", "algorithm.top_entropy_quantile=0.5", "algorithm.entropy_coef=0.01"],
    ["algorithm.pg_objective=cispo", "algorithm.cispo_clip_max=1.2", "algorithm.loss_agg=seq-mean-token-mean"]],
    ids=["vespo-mask-filter", "cispo"])
def test_trl_policy_objectives_train(tmp_path, cache_dir, monkeypatch, objective):
    """The algorithm.* keys of TRL's loss types reach every loss call of a real run (two updates per rollout: old
    log-probs), which logs finite losses."""
    seen = []

    def recording(*args, **kwargs):
        seen.append({key: kwargs[key] for key in ("pg_objective", "off_policy_mask_threshold", "top_entropy_quantile",
                                                  "cispo_clip_max")})
        return loss(*args, **kwargs)

    loss = update_step.fused_linear_erpo_loss
    monkeypatch.setattr(update_step, "fused_linear_erpo_loss", recording)
    out = tmp_path / "run"
    train(small_cfg(out, cache_dir, "trainer.update_batch_size=2", "trainer.save_hf=false", *objective))
    records = read_metrics(out)
    assert len(records) == 4 and all(math.isfinite(r["loss"]) for r in records)
    given = dict(setting.removeprefix("algorithm.").split("=") for setting in objective)
    expected = {name: value for name, value in given.items() if name in seen[0]}
    assert len(expected) >= 2 and all({name: str(call[name]) for name in expected} == expected for call in seen)


def test_current_unclipped_query_weight_is_the_official_codes_weight(tmp_path, cache_dir):
    """query_weight=current-unclipped: w_i = mean_j s_j / s_i over the step's samples, unclipped, so its mean over
    those samples is mean(s) * mean(1/s) >= 1 (Cauchy-Schwarz); a missing wiring would log no weight at all."""
    train(small_cfg(tmp_path / "unclipped", cache_dir, "trainer.max_steps=2",
                    "algorithm.query_weight=current-unclipped"))
    records = read_metrics(tmp_path / "unclipped")
    assert all(r["query_weight_mean"] is not None and r["query_weight_mean"] >= 1 - 1e-6 for r in records)


@pytest.mark.parametrize("mode,max_weight", [("current", 2.0), ("current-unclipped", None), ("none", "off")])
def test_the_current_query_weight_is_the_papers_weight_over_the_steps_samples(tmp_path, cache_dir, monkeypatch, mode,
                                                                               max_weight):
    """The first optimizer step runs at theta0, where the current policy's ell(q) is the cached ell_theta0(q): its
    w(q) ("current": clip(mean_j s_j / s_i, 0, 2) over the step's samples; "current-unclipped": unclipped) is then
    `query_weights` of the cached values the same loss call receives; "none" passes no weight (w = 1)."""
    from erpo_kernels import query_weights
    real, seen = update_step.fused_linear_erpo_loss, []

    def recording(*args, **kwargs):
        seen.append((kwargs["query_weight"], kwargs["ref_query_logp"]))
        return real(*args, **kwargs)
    monkeypatch.setattr(update_step, "fused_linear_erpo_loss", recording)
    train(small_cfg(tmp_path / mode, cache_dir, "trainer.max_steps=1", "trainer.micro_batch_size=16",
                    f"algorithm.query_weight={mode}"))
    [(weight, ref_query_logp)] = seen          # 4 prompts x 4 responses in one micro-batch
    if max_weight == "off":
        assert weight is None
        return
    expected = query_weights(ref_query_logp.double(), max_weight=max_weight)
    torch.testing.assert_close(weight.float(), expected.float(), atol=1e-5, rtol=1e-5)
    assert len(set(ref_query_logp.tolist())) > 1 and not torch.allclose(weight, torch.ones_like(weight))


def test_only_the_later_updates_of_a_rollout_get_old_logprobs(tmp_path, cache_dir, monkeypatch):
    """The first update is on-policy (old log-probs = the current ones, no extra forward); the later ones use the
    log-probs of the model that sampled the rollout."""
    real, seen = update_step.fused_linear_erpo_loss, []

    def recording(*args, **kwargs):
        seen.append(kwargs["old_logp"])
        return real(*args, **kwargs)
    monkeypatch.setattr(update_step, "fused_linear_erpo_loss", recording)
    train(small_cfg(tmp_path / "old", cache_dir, "trainer.max_steps=1", "trainer.update_batch_size=2",
                    "trainer.micro_batch_size=8"))
    assert len(seen) == 2 and seen[0] is None
    assert seen[1] is not None and seen[1].dtype == torch.float32 and torch.isfinite(seen[1]).all()


def test_loss_workspace_reaches_every_loss_call(tmp_path, cache_dir, monkeypatch):
    """trainer.loss_workspace_mib is the fused loss's workspace_bytes (MiB -> bytes) on every micro-batch."""
    real, budgets = update_step.fused_linear_erpo_loss, []

    def recording(*args, **kwargs):
        budgets.append(kwargs["workspace_bytes"])
        return real(*args, **kwargs)
    monkeypatch.setattr(update_step, "fused_linear_erpo_loss", recording)
    train(small_cfg(tmp_path / "ws", cache_dir, "trainer.max_steps=1", "trainer.loss_workspace_mib=3"))
    assert budgets and budgets == [3 << 20] * len(budgets)


def test_logit_transform_is_read_once_and_reaches_every_scoring(tmp_path, cache_dir, monkeypatch):
    """The model's logit transform is read once at setup and passed as one object to the loss, the old log-probs
    and the current w(q) of every step (a stand-in transform here, soft-cap 50: the tiny Qwen2 has none)."""
    import erpo.sequences as sequences
    import erpo.train.step_plan as step_plan
    reads, losses, scorings = [], [], []
    transform = {"logit_scale": 1.0, "logit_softcap": 50.0}
    monkeypatch.setattr(trainer_module, "logit_transforms", lambda model: reads.append(model) or transform)
    real_loss, real_score = update_step.fused_linear_erpo_loss, sequences.scored_token_logp
    monkeypatch.setattr(update_step, "fused_linear_erpo_loss",
                        lambda *args, **kwargs: losses.append(kwargs["logit_softcap"]) or real_loss(*args, **kwargs))

    def scoring(model, batch, temperature=1.0, autocast=None, logit_options=None):
        scorings.append(logit_options)
        return real_score(model, batch, temperature, autocast, logit_options)
    monkeypatch.setattr(step_plan, "scored_token_logp", scoring)
    train(small_cfg(tmp_path / "run", cache_dir, "trainer.max_steps=2", "trainer.update_batch_size=2",
                    "algorithm.query_weight=current"))
    assert len(reads) == 1
    assert len(losses) >= 4 and set(losses) == {50.0}
    assert len(scorings) >= 4 and all(options is transform for options in scorings)   # old log-probs and w(q)


def test_resume_continues_from_the_checkpoint(tmp_path, cache_dir):
    out = tmp_path / "resume"
    # A constant learning rate, so that the run may be extended (a cosine schedule's length is fixed at the start).
    train(small_cfg(out, cache_dir, "trainer.save_steps=1", "trainer.min_lr_ratio=1.0"))
    first = read_metrics(out)
    train(small_cfg(out, cache_dir, "trainer.max_steps=3", "trainer.min_lr_ratio=1.0"), resume=True)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3] and records[:2] == first
    assert (out / "checkpoints" / "step-3" / "meta.json").exists()
    # a cache with other entries (here: one more prompt than the training set, which is unchanged) would give other
    # w(q) and ell_theta0(q) mid-run: refused
    other = tmp_path / "other_cache.json"
    precompute_reference(small_cfg(tmp_path / "other", cache_dir, "data.num_examples=25",
                                   f"reference.cache_path={other}"))
    with pytest.raises(UserError, match=rf"--resume: the checkpoint was trained against reference cache \w+, but "
                                        rf"{other} is \w+; resume with the original cache"):
        train(small_cfg(out, cache_dir, "trainer.max_steps=4", "trainer.min_lr_ratio=1.0",
                        f"reference.cache_path={other}"), resume=True)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        train(small_cfg(tmp_path / "fresh", cache_dir), resume=True)


def test_a_fresh_run_refuses_a_directory_with_checkpoints(tmp_path, cache_dir):
    """Without --resume a used run directory is left alone (its config, metrics and checkpoints unchanged)."""
    out = tmp_path / "used"
    train(small_cfg(out, cache_dir, "trainer.max_steps=1"))
    before = {name: (out / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    with pytest.raises(UserError, match=r"holds a finished run \(final/\); choose another --output-dir"):
        train(small_cfg(out, cache_dir, "trainer.max_steps=2", "trainer.seed=5"))
    assert {name: (out / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
    (out / "checkpoints" / "step-1" / "meta.json").unlink()   # an incomplete checkpoint is no run to protect
    train(small_cfg(out, cache_dir, "trainer.max_steps=1"))
    assert (out / "checkpoints" / "step-1" / "meta.json").exists()


def test_a_cache_built_for_another_template_is_refused(tmp_path, cache_dir):
    out = tmp_path / "mismatch"
    trainer_module.precompute_reference(small_cfg(out, cache_dir))
    with pytest.raises(ValueError, match=r"does not match this run: .*prompt template: cache built with 'plain"):
        train(small_cfg(out, cache_dir, "data.template=Q: {problem}"))


def test_a_raising_reward_function_stops_with_the_sample_named(tmp_path, cache_dir):
    file = tmp_path / "reward.py"
    file.write_text("def picky(prompts, completions, answer, **kw):\n"
                    "    return [1.0 if a != '3' else 1 / 0 for a in answer]\n")
    cfg = small_cfg(tmp_path / "bad_reward", cache_dir, f"reward.functions=[{file}:picky]", "data.num_examples=200",
                    "trainer.rollout_batch_size=24", "trainer.update_batch_size=24")
    with pytest.raises(RuntimeError, match=r"reward function 'picky' raised on sample \d+ \(prompt"):
        train(cfg)



def test_reward_functions_get_trl_s_keywords_and_unscorable_samples_train_on(tmp_path, cache_dir):
    """A reward function written for TRL's GRPOTrainer in a real run: called by keyword (`completions` first), it
    reads `trainer_state` (optimizer steps done out of the run's, the fractional epoch), `completion_ids` and the
    dataset's columns; where it returns None for a sample (the only function: unscorable) the run goes on, and
    `reward` / `reward_std` are the nanmean / Bessel nanstd of the values it returned on the step's samples."""
    calls = tmp_path / "calls.jsonl"
    file = tmp_path / "reward.py"
    file.write_text(
        "import json\n"
        "def curriculum(completions, trainer_state, completion_ids, problem, **kwargs):\n"
        "    values = [None if i == 0 else len(ids) % 3 + trainer_state.global_step / trainer_state.max_steps\n"
        "              for i, ids in enumerate(completion_ids)]\n"
        "    state = {name: getattr(trainer_state, name) for name in ('global_step', 'max_steps', 'epoch',\n"
        "             'is_world_process_zero', 'is_local_process_zero')}\n"
        f"    with open({str(calls)!r}, 'a') as log:\n"
        "        texts = all(isinstance(c, str) for c in completions)\n"
        "        log.write(json.dumps({**state, 'values': values, 'texts': texts, 'problems': len(problem),\n"
        "                              'keys': sorted(kwargs)}) + '\\n')\n"
        "    return values\n")
    out = tmp_path / "curriculum"
    train(small_cfg(out, cache_dir, f"reward.functions=[{file}:curriculum]", "trainer.update_batch_size=2",
                    "trainer.save_hf=false"))
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    # 24 prompts, 4 per rollout step: the second begins 4/24 into the first pass; 2 rollout steps x 2 updates
    assert [(c["global_step"], c["max_steps"], c["epoch"]) for c in seen] == [(0, 4, 0.0), (2, 4, 4 / 24)]
    assert all(c["is_world_process_zero"] and c["is_local_process_zero"] and c["texts"] for c in seen)
    assert all(c["problems"] == 16 and c["keys"] == ["answer", "prompts"] for c in seen)
    records = read_metrics(out)
    assert len(records) == 4
    # each rollout step's first sample is unscorable: left out of its first optimizer step's reward metrics
    for record, values in zip(records, [half for c in seen for half in (c["values"][1:8], c["values"][8:])]):
        given = [v for v in values if v is not None]
        assert len(given) == len(values)
        assert record["reward"] == pytest.approx(statistics.fmean(given))
        assert record["reward_std"] == pytest.approx(statistics.stdev(given))
    # TRL's is_std_zero per sample: its group's scored rewards (rollout.n = 4) are all equal, two or more of them
    halves = [c["values"][h:h + 8] for c in seen for h in (0, 8)]
    for record, values in zip(records, halves):
        groups = [[v for v in values[g:g + 4] if v is not None] for g in (0, 4)]
        zero_std = [len(group) > 1 and len(set(group)) == 1 for group in groups]
        assert record["frac_reward_zero_std"] == sum(zero_std) / 2



@pytest.mark.parametrize("values, why", [
    ("[None] * len(completions)",
     "no sample of this batch could be scored (no reward function returned a value for any of them, so "
     "algorithm.filter_groups dropped every group); make at least one reward function return a number for these "
     "samples (the warning above names the first)"),
    ("[None if i < 4 else 1.0 for i in range(len(completions))]",   # the first group (rollout.n = 4) unscored
     "every group of this batch has equal rewards or no scored sample (algorithm.filter_groups)"),
    ("[1.0] * len(completions)", "every group of this batch has equal rewards (algorithm.filter_groups)")],
    ids=["unscored", "unscored-or-equal", "equal"])
def test_dapo_s_filter_emptying_a_step_names_why(tmp_path, cache_dir, caplog, values, why):
    # every sample unscored (NaN rewards) is not "equal rewards": the warning names the cause and what to do
    file = tmp_path / "reward.py"
    file.write_text(f"def constant(completions, **kwargs):\n    return {values}\n")
    with caplog.at_level("WARNING", logger="erpo"):
        train(small_cfg(tmp_path / "run", cache_dir, f"reward.functions=[{file}:constant]", "trainer.max_steps=1",
                        "algorithm.filter_groups=true", "trainer.save_hf=false"))
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("optimizer step skipped: ")]
    assert skipped == [f"optimizer step skipped: {why}"]


@pytest.fixture
def nan_on_first_call(monkeypatch):
    real = update_step.fused_linear_erpo_loss
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            out.loss = out.loss * float("nan")
        return out
    monkeypatch.setattr(update_step, "fused_linear_erpo_loss", flaky)


def test_nonfinite_loss_is_skipped_and_counted(tmp_path, cache_dir, nan_on_first_call):
    out = tmp_path / "skip"
    train(small_cfg(out, cache_dir))
    records = read_metrics(out)
    assert records[0]["nonfinite_skipped"] == 1 and records[0]["loss"] is None and records[0]["grad_norm"] is None
    assert records[1]["nonfinite_skipped"] == 1 and records[1]["grad_norm"] is not None


def test_nonfinite_loss_can_stop_the_run(tmp_path, cache_dir, nan_on_first_call):
    out = tmp_path / "stop"
    with pytest.raises(FloatingPointError, match=r"non-finite loss .* optimizer step 1 .*Checkpoint of the model "
                                                 r"before this step: .*step-0"):
        train(small_cfg(out, cache_dir, "trainer.on_nonfinite=stop"))
    saved = json.loads((out / "checkpoints" / "step-0" / "meta.json").read_text())["state"]
    # the state of the model before this rollout: resuming redoes it with the same prompts
    assert (saved["rollout_step"], saved["opt_step"], saved["epoch"], saved["cursor"]) == (0, 0, 0, 0)
    assert saved["nonfinite_skipped"] == 0


@pytest.mark.parametrize("overrides", [(), ("algorithm.top_entropy_quantile=0.5",)], ids=["default", "entropy-filter"])
def test_host_reads_per_update_step(tmp_path, cache_dir, monkeypatch, overrides):
    """The loss step (`accumulate_loss`) over 4 micro-batches, counted by LaunchCounter on the CPU: its metrics, the
    non-finite count and the gap are read once per step (before 2026-11-26 each micro-batch read them one by one,
    10 reads each), and the scored rows' hidden states are selected by their positions (`PackedBatch.row_index`: a
    boolean index and its backward were 2 reads each): 13, was 52; and the chunk plan takes the host layout `pack`
    built (`PackedBatch.host_layout`, checked against the rows in the value checks' read): 9, was 13. What remains per
    micro-batch: the model's forward (1, inside transformers: its sdpa mask reads `padding_mask.all()` to choose
    is_causal) and the loss's value checks (1, validate=True): 4 x 2 + 1. The micro-batch's advantages,
    ell_theta0(q) and w(q), host values, go up from pinned memory without a wait (3 blocking uploads per micro-batch
    before 2026-11-26, 12 in this count). With the entropy filter, the same (21 before 2026-11-26: in one process
    the loss selected the entropy pool from the rows, 3 reads per micro-batch, where it needs no gather)."""
    from launch_counts import LaunchCounter
    real, counts = update_step.accumulate_loss, []

    def counted(cfg, updater, ref_model, plan, *args, **kwargs):
        query_weight, ref_query_logp = args[1], args[2]
        with LaunchCounter(device="cpu") as counter:
            # host memory (on the CPU the counter would take them for device tensors): the layouts `pack` built, the
            # rollout's advantages and prompts, the step's sample indices, the cache's ell_theta0(q) and the weights
            counter.host_memory(*(mb.batch.host_layout for mb in plan.micro_batches), plan.rollout.advantages,
                                plan.rollout.prompts, *(mb.index for mb in plan.micro_batches), ref_query_logp,
                                *(w for w in query_weight if w is not None))
            result = real(cfg, updater, ref_model, plan, *args, **kwargs)
        counts.append((len(plan.micro_batches), counter.syncs, counter.sync_names))
        return result
    monkeypatch.setattr(update_step, "accumulate_loss", counted)
    train(small_cfg(tmp_path / "reads", cache_dir, "trainer.max_steps=1", "trainer.micro_batch_size=4", *overrides))
    [(micro_batches, syncs, names)] = counts
    assert micro_batches == 4 and syncs == 9, names
    assert names == {"aten._local_scalar_dense": 8, "Tensor.tolist": 1}, names   # the step's metrics, in one read


def test_plan_step_uploads_each_micro_batch_without_a_wait(tmp_path, cache_dir, monkeypatch):
    """plan_step packs each micro-batch on the host and uploads it in one copy from pinned memory without a wait
    (`erpo.sequences.to_device_together`), and counts the response rows on the host layout it built: counted by
    LaunchCounter on the CPU, no sync at all. The rollout's tensors and pack's layout (`from_padded` of the host
    lists' tensors) are host memory, which the counter cannot see on the CPU: they are marked. Before 2026-11-26: 4
    blocking uploads and a read of token_kind per micro-batch counted here (6 uploads by the code: the counter took
    torch.full's and torch.zeros' host tensors for device tensors)."""
    import erpo.sequences as sequences
    from launch_counts import LaunchCounter
    real_plan, real_layout, counts = trainer_module.plan_step, sequences.from_padded, []
    counter = LaunchCounter(device="cpu")

    def host_layout(*args, **kwargs):
        layout = real_layout(*args, **kwargs)
        counter.host_memory(layout.targets, layout.token_kind, layout.sample_index)
        return layout

    def counted(cfg, rollout, *args):
        counter.sync_names.clear()
        with counter:
            counter.host_memory(rollout.prompts, rollout.truncated, rollout.keep)
            plan = real_plan(cfg, rollout, *args)
        counts.append((len(plan.micro_batches), dict(counter.sync_names)))
        return plan
    monkeypatch.setattr(sequences, "from_padded", host_layout)
    monkeypatch.setattr(trainer_module, "plan_step", counted)
    train(small_cfg(tmp_path / "plan", cache_dir, "trainer.max_steps=1", "trainer.micro_batch_size=4"))
    assert counts == [(4, {})], counts


def test_micro_batching_does_not_change_the_gradient(tmp_path, cache_dir):
    """The same optimizer step accumulated over 1 or 3 micro-batches gives the same update."""
    finals = []
    for micro in (16, 5):
        out = tmp_path / f"micro{micro}"
        train(small_cfg(out, cache_dir, "trainer.max_steps=1", f"trainer.micro_batch_size={micro}"))
        finals.append(read_metrics(out)[0])
    assert finals[0]["grad_norm"] == pytest.approx(finals[1]["grad_norm"], rel=1e-4)
    assert finals[0]["loss"] == pytest.approx(finals[1]["loss"], rel=1e-4, abs=1e-7)
    assert finals[0]["qkl"] == pytest.approx(finals[1]["qkl"], abs=1e-7)


def test_entropy_is_the_steps_token_mean_whatever_the_micro_batches():
    """`entropy` is the mean of H_t over every response token of the optimizer step (each micro-batch's token mean
    weighted by its tokens), independent of how the step is split: here micro-batches of 2 and 8 response tokens.
    TRL 1.16's GRPOTrainer logs the mean over micro-batches of each one's token mean instead (`_compute_loss`
    appends one value per micro-batch, `log` averages them), which weights a short micro-batch's tokens more."""
    from erpo.models.tiny import build_model, build_tokenizer
    from erpo.sequences import logit_transforms
    from erpo.tasks.data import PromptSet
    from erpo.train.metrics import step_record
    from erpo.train.rollout_stage import Rollout
    from erpo.train.step_plan import plan_step
    from erpo.train.updater import TorchUpdater

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_layers=1)
    with torch.no_grad():   # peaked logits: an untrained model's H_t are all near log(V), so both means would agree
        model.lm_head.weight.mul_(8.0)
    cfg = resolve(apply_overrides(Config(), ["algorithm.name=grpo+qkl", "trainer.micro_batch_size=2"]))
    prompts = PromptSet(records=[{}, {}], prompts=["a", "b"], prompt_ids=[[5, 6, 7], [8, 9]], answers=["1", "2"])
    responses = [[10], [11], [12, 13, 14, 15, 16, 17, 18, 19]]
    rollout = Rollout(prompts=torch.tensor([0, 0, 1]), response_ids=responses,
                      rewards=torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64),
                      correct=torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64), truncated=torch.zeros(3, dtype=bool),
                      advantages=torch.tensor([1.0, -1.0, 0.5]), keep=torch.ones(3, dtype=bool),
                      reward_std_zero=torch.zeros(3, dtype=bool), rollout_logp=None)
    plan = plan_step(cfg, rollout, prompts, tokenizer.pad_token_id, "cpu")
    assert [len(mb.index) for mb in plan.micro_batches] == [2, 1] and plan.num_items == 10
    sums, gap, _ = update_step.accumulate_loss(cfg, TorchUpdater(model, cfg, total_steps=1), None, plan, None,
                                               [None, None], torch.tensor([-5.0, -6.0]), logit_transforms(model))
    record = step_record(cfg, plan, sums, gap, 0.0, grad_norm=1.0, lr=1e-3, nonfinite_skipped=0)

    def token_entropies(prompt, response):   # H_t of each response token at T = 1, from the model's own logits
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double()
        return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    per_sample = [token_entropies(prompts.prompt_ids[int(p)], r) for p, r in zip(rollout.prompts, responses)]
    step_mean = torch.cat(per_sample).mean().item()
    trl_mean = (torch.cat(per_sample[:2]).mean().item() + per_sample[2].mean().item()) / 2
    assert record["entropy"] == pytest.approx(step_mean, rel=1e-5)
    assert abs(step_mean - trl_mean) > 0.01 * step_mean      # the two definitions differ here (by 2%)


def test_prompt_sampler_is_resumable_and_covers_every_prompt():
    a = PromptSampler(10, seed=1)
    seen = a.next(4) + a.next(4)
    b = PromptSampler(10, seed=1, **a.state)
    assert a.next(4) == b.next(4)
    assert len(set(seen)) == 8 and a.epoch == 1


def test_lr_schedule_warmup_then_cosine():
    f = lr_lambda(total_steps=10, warmup_ratio=0.2, min_lr_ratio=0.1)
    assert [round(f(s), 4) for s in (0, 1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(10) == pytest.approx(0.1)
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    torch.testing.assert_close(torch.tensor(lr_lambda(4, 0.0, 1.0)(3)), torch.tensor(1.0))


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path, cache_dir, monkeypatch):
    class StopAfterFirstStep(trainer_module.GracefulStop):
        def should_stop(self):
            self.requested = True
            return True
    monkeypatch.setattr(trainer_module, "GracefulStop", StopAfterFirstStep)
    out = tmp_path / "sigterm"
    train(small_cfg(out, cache_dir, "trainer.max_steps=5"))
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert (out / "checkpoints" / "step-1" / "meta.json").exists() and not (out / "final").exists()


def test_deepspeed_backend_matches_plain_torch(tmp_path, cache_dir):
    """One rollout, two optimizer steps, under each updater: rewards that differ within groups (the math reward is 0
    for this tiny model, which would leave every gradient 0) make the first step move the policy, so the second
    step's Query-KL and gradient show the first update, DeepSpeed's (torch's AdamW on a CPU) against torch's."""
    pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)
    file = tmp_path / "reward.py"
    file.write_text("def by_length(prompts, completions, **kw):\n    return [float(len(c) % 5) for c in completions]\n")
    runs = {}
    for backend in ("torch", "deepspeed"):
        out = tmp_path / backend
        train(small_cfg(out, cache_dir, f"trainer.updater={backend}", "trainer.update_batch_size=2",
                        "trainer.max_steps=1", f"reward.functions=[{file}:by_length]", "rollout.temperature=0.7",
                        "trainer.lr=0.01"))
        runs[backend] = read_metrics(out)
    assert len(runs["torch"]) == len(runs["deepspeed"]) == 2  # two optimizer steps from one rollout
    first, second = runs["torch"]
    assert first["grad_norm"] > 0 and first["qkl"] == 0 and second["qkl"] > 1e-6   # theta0, then moved
    for a, b in zip(runs["torch"], runs["deepspeed"]):
        assert a["reward"] == b["reward"]
        assert a["qkl"] == pytest.approx(b["qkl"], rel=1e-3, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
        assert a["lr"] == pytest.approx(b["lr"])


def test_sft_warm_start_is_cached_and_learns(tmp_path):
    from erpo.models.sft import tiny_theta0
    cfg = small_cfg(tmp_path / "unused", str(tmp_path / "cache"), "tiny.sft_steps=40")
    path = tiny_theta0(cfg)
    weights = Path(path) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert tiny_theta0(cfg) == path  # second call: the cached model, nothing rebuilt
    assert weights.stat().st_mtime_ns == before
    other = tiny_theta0(small_cfg(tmp_path / "unused", str(tmp_path / "cache"), "tiny.sft_steps=41"))
    assert other != path


def test_sft_loss_decreases():
    from erpo.models.sft import sft_warm_start, worked_response
    from erpo.models.tiny import build_model, build_tokenizer
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=16, intermediate_size=32, num_layers=1)
    examples = [("1+1=?", worked_response("2", tokenizer.eos_token))] * 4
    losses = sft_warm_start(model, tokenizer, examples, steps=30, batch_size=4, lr=1e-2, seed=0)
    assert losses[-1] < 0.5 * losses[0]
    with pytest.raises(ValueError, match="steps > 0"):
        sft_warm_start(model, tokenizer, examples, steps=0, batch_size=4, lr=1e-2, seed=0)


def test_pack_scores_prompt_and_response_rows_and_masks_truncated_responses():
    from erpo.sequences import pack
    batch = pack([[5, 6, 7], [8, 9]], [[10, 11], [12]], pad_id=0, device="cpu", response_scored=[True, False])
    assert batch.input_ids.tolist() == [[5, 6, 7, 10, 11], [8, 9, 12, 0, 0]]
    # sample 0: query rows predict 6, 7; response rows predict 10, 11. sample 1: query row predicts 9 only.
    assert batch.targets.tolist() == [6, 7, 10, 11, 9]
    assert batch.token_kind.tolist() == [1, 1, 2, 2, 1]
    assert batch.sample_index.tolist() == [0, 0, 0, 0, 1]
    assert batch.rollout_logp is None
    # pad = EOS (a tokenizer without a pad token, as HFRollout then pads): the rows come from the lengths, not the ids,
    # so each response's EOS stays scored and nothing after it is
    batch = pack([[5, 6, 7], [8, 9]], [[10, 0], [0]], pad_id=0, device="cpu")
    assert batch.targets.tolist() == [6, 7, 10, 0, 9, 0] and batch.token_kind.tolist() == [1, 1, 2, 2, 1, 2]
    # the engine's log-prob of response token j lands on the row that predicts it
    batch = pack([[5, 6, 7], [8, 9]], [[10, 11], [12]], pad_id=0, device="cpu", response_logp=[[-0.5, -1.5], [-2.5]])
    assert batch.token_kind.tolist() == [1, 1, 2, 2, 1, 2]
    assert batch.targets.tolist() == [6, 7, 10, 11, 9, 12]
    assert batch.rollout_logp.tolist() == [0.0, 0.0, -0.5, -1.5, 0.0, -2.5]
    with pytest.raises(ValueError, match="sample 1: 2 rollout log-probs for 1 response tokens"):
        pack([[5, 6, 7], [8, 9]], [[10, 11], [12]], pad_id=0, device="cpu", response_logp=[[-0.5, -1.5], [-2.5, -1.0]])
    # the tensors' types, as the model and the loss take them (uploaded together as int64 and cast back)
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.rows.dtype == torch.bool and batch.rows.tolist() == [1, 1, 1, 1, 0, 1, 1, 0, 0, 0]
    assert batch.row_index.tolist() == [0, 1, 2, 3, 5, 6] and batch.rollout_logp.dtype == torch.float32
    assert all(t.dtype == torch.int64 for t in (batch.input_ids, batch.attention_mask, batch.targets,
                                                 batch.token_kind, batch.sample_index, batch.host_layout))
    assert batch.host_layout.tolist() == [batch.token_kind.tolist(), batch.sample_index.tolist()]


def test_to_device_together_keeps_shapes_dtypes_and_values_without_a_sync():
    """One upload for several host tensors, each back in its shape and dtype (bool, int32, int64), no sync (on CUDA
    from pinned memory with non_blocking; LaunchCounter on the CPU sees any blocking upload of a host tensor)."""
    from erpo.sequences import to_device_together
    from launch_counts import LaunchCounter
    with LaunchCounter(device="cpu") as counter:
        host = [torch.tensor([[3, -1], [2**40, 0]]), torch.tensor([True, False, True]),
                torch.tensor([7, 8], dtype=torch.int32)]
        out = to_device_together(host, "cpu")
    assert counter.syncs == 0, counter.sync_names
    assert [(t.shape, t.dtype) for t in out] == [(t.shape, t.dtype) for t in host]
    assert all(torch.equal(a, b) for a, b in zip(out, host))


def test_importance_sampling_correction_lines_up_the_engines_logprobs(tmp_path, cache_dir):
    """HF rollouts sample with the training model itself, so the sampling log-prob of every response token equals
    the trainer's own (for the on-policy first update and, through old_logp, the second): gaps ~0 and weights ~1
    show the engine's log-probs reach the loss on the right rows, at the rollout temperature. Rewards that differ
    within groups (the math reward is 0 for this tiny model) make the first update move the policy: the second
    update's ratio is then not 1, while its old log-probs are still the rollout's (taken before the first update,
    not after it), and the first update's ratio is exactly 1. Off by default with HF rollouts."""
    file = tmp_path / "reward.py"
    file.write_text("def by_length(prompts, completions, **kw):\n    return [float(len(c) % 5) for c in completions]\n")
    out = tmp_path / "tis"
    train(small_cfg(out, cache_dir, "rollout.importance_sampling_correction=true", "trainer.update_batch_size=2",
                    f"reward.functions=[{file}:by_length]", "rollout.temperature=0.7", "trainer.lr=0.01"))
    records = read_metrics(out)
    assert len(records) == 4
    for record in records:
        assert record["rollout_logp_gap_max"] < 1e-4 and abs(record["rollout_logp_gap_abs"]) < 1e-5
        assert abs(record["rollout_is_weight"] - 1) < 1e-5
    first, second = records[0::2], records[1::2]
    assert all(r["ratio_mean"] == 1.0 and r["clip_ratio"] == 0.0 for r in first)
    assert all(abs(r["ratio_mean"] - 1) > 1e-4 for r in second)
    default = tmp_path / "default"
    train(small_cfg(default, cache_dir, "trainer.max_steps=1"))
    keys = ("rollout_is_weight", "rollout_logp_gap_abs", "rollout_logp_gap_max")
    assert [read_metrics(default)[0][k] for k in keys] == [None, None, None]


def test_vllm_backend_is_wired_through_the_trainer(tmp_path, cache_dir, monkeypatch):
    """rollout.engine=vllm against the recording fake vLLM of tests/support/fake_vllm.py: the engine is built on theta0
    with the run's lengths, its samples train the policy, and the weights are synced after every optimizer step."""
    import fake_vllm
    fake_vllm.install(monkeypatch)
    out = tmp_path / "vllm"
    train(small_cfg(out, cache_dir, "rollout.engine=vllm", "trainer.update_batch_size=2"))
    llm = fake_vllm.LLM.instances[-1]
    assert "tiny-theta0-" in llm.kwargs["model"]
    assert llm.kwargs["enable_sleep_mode"] is False and "sleep" not in llm.call_names()
    assert llm.kwargs["max_model_len"] == 64 + 8
    assert llm.call_names().count("generate") == 2                # one per rollout step
    assert llm.call_names().count("load_weights") >= 4            # after each of the 4 optimizer steps
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in records)


def test_vllm_sleep_mode_sleeps_between_rollouts(tmp_path, cache_dir, monkeypatch):
    """rollout.enable_sleep_mode: vLLM sleeps right after each generate (KV cache freed, weights discarded: level
    2), its
    weights wake before the first weight sync, and the KV cache wakes right before the next generate."""
    import fake_vllm
    fake_vllm.install(monkeypatch)
    train(small_cfg(tmp_path / "sleep", cache_dir, "rollout.engine=vllm", "rollout.enable_sleep_mode=true",
                    "trainer.update_batch_size=2"))
    llm = fake_vllm.LLM.instances[-1]
    assert llm.kwargs["enable_sleep_mode"] is True
    calls = [call if call[0] in ("sleep", "wake_up") else call[0] for call in llm.calls[1:]]
    calls = [c for i, c in enumerate(calls) if c != "load_weights" or calls[i - 1] != "load_weights"]
    sync = ["load_weights", "reset_prefix_cache"]
    step1 = ["generate", ("sleep", 2), ("wake_up", ["weights"]), *sync, *sync]
    step2 = [("wake_up", ["kv_cache"]), "generate", ("sleep", 2), ("wake_up", ["weights"]), *sync, *sync]
    assert calls == step1 + step2


def test_offload_settings_reach_the_deepspeed_config(no_launcher_variables):
    # deepspeed_config_for fills the launcher variables for a one-rank group: the fixture takes them away after
    off = deepspeed_config_for(resolve(apply_overrides(Config(), ["trainer.zero_stage=3"])))
    assert "offload_optimizer" not in off["zero_optimization"] and "offload_param" not in off["zero_optimization"]
    cfg = resolve(apply_overrides(Config(), ["trainer.zero_stage=3", "trainer.offload_optimizer=true",
                                             "trainer.offload_params=true", "trainer.lr=2e-5"]))
    ds = deepspeed_config_for(cfg)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    params = dict(ds["optimizer"]["params"])
    torch_adam = params.pop("torch_adam", None)   # without CUDA torch's AdamW, offloaded too (test_deepspeed_cpu_ops)
    assert ds["optimizer"]["type"] == "AdamW" and params == {"lr": 2e-5, "betas": [0.9, 0.999], "weight_decay": 0.0}
    assert torch_adam is (None if torch.cuda.is_available() else True)
    zero2 = deepspeed_config_for(resolve(apply_overrides(
        Config(), ["trainer.zero_stage=2", "trainer.offload_optimizer=true"])))
    assert "offload_optimizer" in zero2["zero_optimization"] and "offload_param" not in zero2["zero_optimization"]


def test_zero3_models_are_born_partitioned_and_grpo_matches_plain_torch(tmp_path, cache_dir, monkeypatch):
    """trainer.zero_stage=3 (one DeepSpeed rank): the policy and GRPO's reference model are created partitioned,
    the reference becomes a ZeRO-3 inference engine, the reference cache is built from the partitioned policy, and
    the update equals plain torch's; once train returns, torch.nn.functional.linear is torch's again (DeepSpeed's
    replacement would change the last bits of every later forward in the process)."""
    pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)
    pytest.importorskip("accelerate", exc_type=ModuleNotFoundError)
    from erpo import distributed as D
    created, references = [], []
    load_model, prepare_reference_model = trainer_module.load_model, D.prepare_reference_model

    def recording_load_model(*args, **kwargs):
        model = load_model(*args, **kwargs)
        created.append((kwargs["trainable"], all(D.is_zero3_param(p) for p in model.parameters())))
        return model

    def recording_prepare(model, ds_config):
        references.append(prepare_reference_model(model, ds_config))
        return references[-1]
    monkeypatch.setattr(trainer_module, "load_model", recording_load_model)
    monkeypatch.setattr(D, "prepare_reference_model", recording_prepare)
    runs, linear = {}, torch.nn.functional.linear
    for backend, stage in (("torch", 0), ("deepspeed", 3)):
        out = tmp_path / backend
        train(small_cfg(out, cache_dir, f"trainer.updater={backend}", f"trainer.zero_stage={stage}",
                        "algorithm.name=grpo", "trainer.max_steps=1"))
        runs[backend] = read_metrics(out)[0]
        # ZeRO-3's zero.Init replaced it with DeepSpeed's linear for good; train puts torch's back at its end
        assert torch.nn.functional.linear is linear, (backend, torch.nn.functional.linear)
    assert created == [(True, False), (False, False), (True, True), (False, True)]
    from transformers.integrations import is_deepspeed_zero3_enabled
    assert not is_deepspeed_zero3_enabled()   # partitioned creation ends with train's model loading
    assert len(references) == 1 and D.is_deepspeed_engine(references[0])
    assert all(D.is_zero3_param(p) for p in references[0].parameters())
    a, b = runs["torch"], runs["deepspeed"]
    assert a["reward"] == b["reward"]
    assert b["qkl"] == pytest.approx(0.0, abs=1e-6) and b["policy_kl"] == pytest.approx(0.0, abs=1e-6)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("ending, caller_sets", [("returns", ()), ("raises", ("MASTER_ADDR", "MASTER_PORT"))],
                         ids=["returns", "raises-beside-the-callers-port"])
def test_train_leaves_the_process_as_found(tmp_path, cache_dir, monkeypatch, no_launcher_variables, ending,
                                           caller_sets):
    """train() from Python (a notebook, a script that then launches a job), one DeepSpeed ZeRO-3 rank on 2 threads in
    a process without a process group: once it returns or raises, torch.nn.functional.linear and the caller's threads
    are as before, the launcher variables the run filled are gone (a process launched next would inherit MASTER_PORT,
    bound by this one's group) with the group, and those the caller set (its own free port) keep the caller's
    values."""
    pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)
    pytest.importorskip("accelerate", exc_type=ModuleNotFoundError)
    from erpo import distributed as D
    from torchrun import free_port
    assert not D.is_initialized()
    caller = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key in caller_sets:
        monkeypatch.setenv(key, caller[key])
    before = {key: os.environ.get(key) for key in D.LAUNCHER_VARIABLES}
    threads, linear, inside = torch.get_num_threads(), torch.nn.functional.linear, []
    stage = trainer_module.rollout_stage

    def recording_stage(*args, **kwargs):
        inside.append(({key: os.environ.get(key) for key in D.LAUNCHER_VARIABLES}, torch.get_num_threads(),
                       torch.nn.functional.linear is linear, D.is_initialized()))
        if ending == "raises":
            raise RuntimeError("the rollout failed")
        return stage(*args, **kwargs)
    monkeypatch.setattr(trainer_module, "rollout_stage", recording_stage)
    cfg = small_cfg(tmp_path / "run", cache_dir, "trainer.updater=deepspeed", "trainer.zero_stage=3",
                    f"trainer.cpu_threads={threads + 1}", "trainer.max_steps=1", "trainer.save_hf=false")
    if ending == "raises":
        with pytest.raises(RuntimeError, match="the rollout failed"):
            train(cfg)
    else:
        train(cfg)
    (env, run_threads, torch_linear, group), = inside   # during the run: a one-rank group, its threads, ZeRO-3's linear
    port = env.pop("MASTER_PORT")
    assert port == before["MASTER_PORT"] if "MASTER_PORT" in caller_sets else port.isdigit()
    filled = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert env == {**filled, **{key: before[key] for key in caller_sets if key != "MASTER_PORT"}}
    assert run_threads == threads + 1 and not torch_linear and group
    assert {key: os.environ.get(key) for key in D.LAUNCHER_VARIABLES} == before and not D.is_initialized()
    assert torch.get_num_threads() == threads and torch.nn.functional.linear is linear


def test_fresh_run_replaces_a_stale_metrics_log(tmp_path, cache_dir):
    """A run that crashed before its first checkpoint leaves metrics.jsonl behind; starting again (nothing to
    resume) logs from step 1 without the stale lines."""
    out = tmp_path / "crashed"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "reward": 123.0}\n{"step": 2, "reward": 456.0}\n')
    train(small_cfg(out, cache_dir, "trainer.max_steps=1"))
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1] and records[0]["reward"] != 123.0


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_deepspeed_skips_a_nonfinite_step_without_poisoning_the_next(tmp_path, cache_dir, nan_on_first_call,
                                                                     zero_stage):
    """The first optimizer step's loss is NaN: DeepSpeed applies nothing, and the next step gets clean gradients
    (ZeRO keeps partitioned gradient buffers that a bare zero_grad leaves behind) and moves the weights."""
    pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)
    from transformers import AutoModelForCausalLM
    out = tmp_path / f"zero{zero_stage}"
    reward = tmp_path / "reward.py"  # rewards that differ within a group, so the second step has a gradient
    reward.write_text("def by_length(prompts, completions, **kw):\n"
                      "    return [float(len(c) % 3) for c in completions]\n")
    train(small_cfg(out, cache_dir, "trainer.updater=deepspeed", f"trainer.zero_stage={zero_stage}",
                    "trainer.update_batch_size=2", "trainer.max_steps=1", f"reward.functions=[{reward}:by_length]"))
    first, second = read_metrics(out)
    assert first["nonfinite_skipped"] == 1 and first["grad_norm"] is None
    assert second["grad_norm"] is not None and math.isfinite(second["grad_norm"]) and second["grad_norm"] > 0
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert all(torch.isfinite(p).all() for p in final.parameters())
