"""The trainer's pieces without a model: the updater choice, the step plan and the metrics record under
(simulated) several ranks, and the per-sample sums of the reference cache."""
import pytest
import torch

from erpo import distributed as D
from erpo.config import Config, apply_overrides, resolve
from erpo.sequences import PackedBatch, per_sample_sum
from erpo.tasks import rewards
from erpo.tasks.data import PromptSet
from erpo.tasks.trainer_progress import TrainerProgress
from erpo.train.metrics import SUMMED_METRICS, TOKEN_MEAN_METRICS, step_record
from erpo.train.rollout_stage import Rollout, rollout_stage
from erpo.train.step_plan import StepPlan
from erpo.train.updater import choose_updater

NOT_APPLYING = ("policy_kl", "rollout_is_weight", "rollout_logp_gap_abs")   # ERPO's defaults: record names


def rollout_of(rewards) -> Rollout:
    n = len(rewards)
    return Rollout(prompts=torch.arange(n), response_ids=[[1] * (i + 1) for i in range(n)],
                   rewards=torch.tensor(rewards, dtype=torch.float64),
                   correct=torch.tensor(rewards, dtype=torch.float64),
                   truncated=torch.tensor([i == 0 for i in range(n)]), advantages=torch.zeros(n),
                   keep=torch.ones(n, dtype=torch.bool), reward_std_zero=torch.tensor([i < n // 2 for i in range(n)]),
                   rollout_logp=None)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_step_metrics_of_identical_ranks_equal_one_rank(monkeypatch, world):
    """`world` ranks holding the same samples log the one-rank means (counts multiplied by `world`): every
    metric is reduced over ranks exactly once (query_weight_mean was divided by the world size)."""
    cfg = resolve(Config())
    rollout = rollout_of([1.0, 0.0, 0.5, 1.0])
    local_tokens = 10
    sums = {"loss": 0.3, "qkl": 0.02, "pg_loss": 0.25, **{name: 0.5 * local_tokens for name in TOKEN_MEAN_METRICS}}
    weight_sum = 3.0    # w(q) summed over the 4 samples: mean 0.75
    monkeypatch.setattr(D, "all_reduce_sum", lambda x: x * world)   # `world` ranks with the same values
    monkeypatch.setattr(D, "all_reduce_max", lambda x: x)
    plan = StepPlan(rollout, [], num_items=local_tokens * world, num_seqs=len(rollout) * world)
    record = step_record(cfg, plan, sums, 0.0, weight_sum, grad_norm=1.0, lr=1e-3, nonfinite_skipped=0)
    assert record["query_weight_mean"] == pytest.approx(0.75)
    assert record["reward"] == pytest.approx(0.625) and record["accuracy"] == pytest.approx(0.625)
    # responses of 1-4 tokens, the first clipped
    assert record["completions/mean_length"] == pytest.approx(2.5) and record["completions/clipped_ratio"] == 0.25
    assert (record["completions/min_length"], record["completions/max_length"]) == (1.0, 4.0)
    assert record["completions/mean_terminated_length"] == pytest.approx(3.0)
    assert (record["completions/min_terminated_length"], record["completions/max_terminated_length"]) == (2.0, 4.0)
    assert record["filtered_frac"] == 0.0
    assert record["reward_std"] == pytest.approx(torch.tensor([1.0, 0.0, 0.5, 1.0] * world).std().item())
    assert record["frac_reward_zero_std"] == 0.5
    for name in TOKEN_MEAN_METRICS:
        assert record[name] == pytest.approx(0.5)
    # loss terms are already normalized by the global counts: their sum over ranks is the full-batch value
    assert record["loss"] == pytest.approx(0.3 * world) and record["qkl"] == pytest.approx(0.02 * world)
    assert (record["num_samples"], record["response_tokens"]) == (4 * world, 10 * world)


@pytest.mark.parametrize("world", [1, 2])
def test_the_reward_metrics_are_trl_s_on_the_same_samples(monkeypatch, world):
    """reward, reward_std and each function's rewards/NAME/mean and rewards/NAME/std are TRL 1.16 GRPOTrainer's
    nanmean and (Bessel-corrected) nanstd over every rank's samples: a function's None, and a sample no function
    scored, are left out; null where TRL's value is NaN (no sample, or one, to take a mean or a std of)."""
    from trl.trainer.utils import nanstd as trl_nanstd
    cfg = resolve(Config())
    nan = float("nan")
    rollout = rollout_of([1.5, nan, 0.5, 1.0])
    rollout.reward_parts = {"accuracy_reward": torch.tensor([1.0, nan, nan, 1.0], dtype=torch.float64),
                            "format_reward": torch.tensor([0.5, nan, 0.5, 0.0], dtype=torch.float64),
                            "reward": torch.tensor([nan, nan, 0.0, nan], dtype=torch.float64),  # a user's `reward`
                            "never": torch.full((4,), nan, dtype=torch.float64)}
    monkeypatch.setattr(D, "all_reduce_sum", lambda x: x * world)
    plan = StepPlan(rollout.select(0, 4), [], num_items=8 * world, num_seqs=4 * world)
    record = step_record(cfg, plan, {"loss": 0.0}, None, 0.0, grad_norm=1.0, lr=1e-3, nonfinite_skipped=0)
    every_rank = {name: values.repeat(world) for name, values in rollout.reward_parts.items()}
    for name in ("accuracy_reward", "format_reward"):
        assert record[f"rewards/{name}/mean"] == pytest.approx(torch.nanmean(every_rank[name]).item())
        assert record[f"rewards/{name}/std"] == pytest.approx(trl_nanstd(every_rank[name]).item())
    assert record["reward"] == pytest.approx(1.0)
    assert record["reward_std"] == pytest.approx(trl_nanstd(rollout.rewards.repeat(world)).item())
    assert record["rewards/reward/mean"] == 0.0 and record["reward"] != 0.0   # the total and a function named reward
    assert record["rewards/reward/std"] == (None if world == 1 else 0.0)      # TRL: NaN for one value
    assert record["rewards/never/mean"] is None and record["rewards/never/std"] is None


def trl_completion_metrics(lengths: list[int], clipped: list[bool]) -> dict:
    """TRL 1.16 GRPOTrainer._generate's completions/* metrics of the responses gathered from every rank: their
    token counts and whether each was clipped (no EOS); the terminated ones' of a lone 0 when there are none."""
    lengths, clipped = torch.tensor(lengths), torch.tensor(clipped)
    terminated = lengths[~clipped] if not clipped.all() else torch.zeros(1)
    return {"completions/mean_length": lengths.float().mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": clipped.float().mean().item(),
            "completions/mean_terminated_length": terminated.float().mean().item(),
            "completions/min_terminated_length": terminated.min().item(),
            "completions/max_terminated_length": terminated.max().item()}


@pytest.mark.parametrize("clipped", [((False, True, False, False), (True, True)),
                                     ((True,) * 4, (False, True)),
                                     ((True,) * 4, (True, True))])
def test_the_completion_metrics_are_trl_s_over_uneven_ranks(monkeypatch, clipped):
    """Rank 0 holds 4 responses (1-4 tokens) and rank 1 two longer ones (9, 5), one rank or both with every response
    clipped: completions/* are TRL 1.16's over every rank's responses, the min and max too (a rank with no
    terminated response, or with every response, takes no part in their extremes), 0 for the terminated lengths when
    every response was clipped, as TRL. The rollout log-prob gap's max is reduced over ranks in the same call."""
    cfg = resolve(Config())
    ranks = [rollout_of([1.0, 0.0, 0.5, 1.0]), rollout_of([0.5, 1.0])]
    ranks[1].response_ids = [[1] * 9, [1] * 5]
    for rollout, flags in zip(ranks, clipped):
        rollout.truncated = torch.tensor(flags)
    gaps = (0.3, 0.7)

    def record_of(rank):
        plan = StepPlan(ranks[rank], [], num_items=24, num_seqs=6)
        return step_record(cfg, plan, {"loss": 0.0}, gaps[rank], 0.0, grad_norm=1.0, lr=1e-3, nonfinite_skipped=0)
    sent = []   # what each rank hands to the sum and to the max over ranks
    for rank in (0, 1):
        sent.append({})
        monkeypatch.setattr(D, "all_reduce_sum", lambda x: sent[-1].setdefault("sum", x))
        monkeypatch.setattr(D, "all_reduce_max", lambda x: sent[-1].setdefault("max", x))
        record_of(rank)
    monkeypatch.setattr(D, "all_reduce_sum", lambda x: sent[0]["sum"] + sent[1]["sum"])
    monkeypatch.setattr(D, "all_reduce_max", lambda x: torch.maximum(sent[0]["max"], sent[1]["max"]))
    record = record_of(0)
    expected = trl_completion_metrics([1, 2, 3, 4, 9, 5], [*clipped[0], *clipped[1]])
    assert {name: record[name] for name in expected} == pytest.approx(expected)
    assert record["rollout_logp_gap_max"] == 0.7


def test_metrics_that_do_not_apply_are_logged_as_null(monkeypatch):
    """accumulate_loss sums only the loss metrics that apply (no policy_kl without a reference model, no rollout
    metrics without importance sampling: absent from LossMetrics): the record logs them as null, never NaN, and
    still reduces the others over ranks."""
    cfg = resolve(Config())
    rollout = rollout_of([1.0, 0.0])
    applying = [name for name in SUMMED_METRICS if name not in NOT_APPLYING]
    sums = {"loss": 0.3, **dict.fromkeys(applying, 2.0)}
    monkeypatch.setattr(D, "all_reduce_sum", lambda x: x * 2)
    plan = StepPlan(rollout, [], num_items=8, num_seqs=4)
    record = step_record(cfg, plan, sums, None, 0.0, grad_norm=1.0, lr=1e-3, nonfinite_skipped=0)
    assert all(record[name] is None for name in NOT_APPLYING) and record["rollout_logp_gap_max"] is None
    assert record["qkl"] == 4.0 and record["entropy"] == 0.5 and record["loss"] == pytest.approx(0.6)


def test_the_automatic_updater_is_deepspeed_with_several_ranks_or_zero(monkeypatch):
    """trainer.updater=auto on a CPU machine: torch in one process; DeepSpeed with several ranks (the torch
    updater is single-process) or when ZeRO is asked for."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_updater(resolve(Config())) == "torch"
    assert choose_updater(resolve(apply_overrides(Config(), ["trainer.zero_stage=3"]))) == "deepspeed"
    monkeypatch.setattr(D, "world_size", lambda: 2)
    assert choose_updater(resolve(Config())) == "deepspeed"
    with pytest.raises(ValueError, match="trainer.updater 'torch' is single-process"):
        choose_updater(resolve(apply_overrides(Config(), ["trainer.updater=torch"])))


def test_the_old_key_names_still_set_the_renamed_keys():
    cfg = resolve(apply_overrides(Config(), ["trainer.backend=deepspeed", "rollout.backend=vllm"]))
    assert (cfg.trainer.updater, cfg.rollout.engine) == ("deepspeed", "vllm")


def test_loss_options_are_built_once_from_the_config():
    cfg = resolve(apply_overrides(Config(), ["algorithm.name=grpo", "algorithm.clip_high=0.28",
                                             "rollout.temperature=0.7"]))
    options = cfg.algorithm.loss_options
    assert (options.qkl_coef, options.policy_kl_coef, options.clip_high, options.temperature) == (0.0, 0.01, 0.28, 0.7)
    with pytest.raises(ValueError, match="dual_clip"):
        resolve(apply_overrides(Config(), ["algorithm.dual_clip=0.5"]))


def test_per_sample_sum_is_a_fixed_order_sum_without_atomics(monkeypatch):
    """The reference cache's ell(q) sums each sample's rows in row order (as the loss's own segment sums do), never
    with index_add_ (a float atomic on CUDA, whose result changes from run to run)."""
    def atomic(*args, **kwargs):
        raise AssertionError("index_add_ is a float atomic on CUDA")
    monkeypatch.setattr(torch.Tensor, "index_add_", atomic)
    gen = torch.Generator().manual_seed(0)
    sample_index = torch.tensor([0, 0, 1, 1, 1, 0, 2, 2])
    token_kind = torch.tensor([1, 1, 1, 2, 1, 2, 1, 1])
    values = torch.randn(8, generator=gen) * 30
    batch = PackedBatch(input_ids=torch.zeros(3, 4, dtype=torch.long), attention_mask=torch.ones(3, 4),
                        rows=torch.ones(12, dtype=torch.bool), targets=torch.zeros(8, dtype=torch.long),
                        token_kind=token_kind, sample_index=sample_index)
    expected = torch.zeros(3)
    for v, s, k in zip(values, sample_index, token_kind):   # fp32, row order
        if k == 1:
            expected[s] += v
    got = per_sample_sum(values, batch, kind=1)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected.double(), rtol=0, atol=0)



def test_train_state_round_trips_through_the_checkpoint_record():
    """A checkpoint's "state" keeps its keys (older checkpoints resume): the counters, the sampler's position and the
    training set; read back, the counters return with this run's LR schedule length and training set (an older
    checkpoint's record has none)."""
    from erpo.train.train_state import TrainState
    training_set = {"prompts": 2, "prompt_ids": "c0", "answers": "a1"}
    state = TrainState(reference_cache_id="ab12", lr_schedule_steps=8, training_set=training_set, rollout_step=3,
                       opt_step=6, nonfinite_skipped=1)
    record = state.checkpoint_record({"epoch": 2, "cursor": 4})
    assert record == {"rollout_step": 3, "opt_step": 6, "epoch": 2, "cursor": 4, "nonfinite_skipped": 1,
                      "reference_cache_id": "ab12", "lr_schedule_steps": 8, "training_set": training_set}
    del record["training_set"]
    assert TrainState.from_checkpoint_record(record, lr_schedule_steps=10, training_set=training_set) == TrainState(
        reference_cache_id="ab12", lr_schedule_steps=10, training_set=training_set, rollout_step=3, opt_step=6,
        nonfinite_skipped=1)


# Two prompts x two responses (advantage_ranks.FixedEngine: response j of prompt p is the token 2p + j).
GRADED_COMPLETIONS = [r"\boxed{7}", r"<think>add</think> so \boxed{8}", r"<think>halve</think> \boxed{0.5}",
                      "no answer"]
GRADED_PROMPTS = PromptSet(records=[{}, {}], prompts=["3+4=?", "1/2=?"], prompt_ids=[[3], [4]],
                           answers=["7", r"\frac{1}{2}"])


class GradedTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return GRADED_COMPLETIONS[ids[0]]


def graded_step(reward_fns, overrides):
    """The rollout stage and metrics record of one optimizer step over GRADED_COMPLETIONS."""
    from advantage_ranks import FixedEngine
    cfg = resolve(apply_overrides(Config(), ["rollout.n=2", "trainer.rollout_batch_size=2",
                                             "trainer.update_batch_size=2", *overrides]))
    progress = TrainerProgress(global_step=0, max_steps=1, epoch=0.0, is_world_process_zero=True,
                               is_local_process_zero=True)
    [rollout] = rollout_stage(cfg, FixedEngine(), GRADED_PROMPTS, GradedTokenizer(), reward_fns, [0, 1], 0, progress)
    plan = StepPlan(rollout, [], num_items=4, num_seqs=4)
    return rollout, step_record(cfg, plan, {"loss": 0.0}, None, 0.0, grad_norm=1.0, lr=1e-3, nonfinite_skipped=0)


def counting_answer_checks(monkeypatch) -> list:
    """Count the calls of the grading entry point (`answers_match`: one per graded sample), passing them on."""
    calls = []
    real = rewards.answers_match

    def counted(pred, gold, **kwargs):
        calls.append(pred)
        return real(pred, gold, **kwargs)
    monkeypatch.setattr(rewards, "answers_match", counted)
    return calls


def test_a_step_grades_each_sample_once_when_math_is_a_reward_function(monkeypatch):
    """With erpo's `math` among the reward functions its verdicts are the accuracy too: math-verify (a child
    process, one answer at a time) judges each sample once per step, not once for the reward and once more for
    `accuracy`. The logged reward and accuracy are those of grading twice (fixed batch, exact values), whatever the
    weights: the accuracy is the unweighted verdict."""
    calls = counting_answer_checks(monkeypatch)
    rollout, record = graded_step([rewards.math_reward, rewards.format_reward],
                                  ["reward.functions=[math,format]", "reward.weights=[2.0,0.5]"])
    assert len(calls) == len(GRADED_COMPLETIONS)
    assert rollout.correct.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert rollout.rewards.tolist() == [2.0, 0.5, 2.5, 0.0]
    assert (record["accuracy"], record["reward"], record["rewards/math_reward/mean"]) == (0.5, 1.25, 0.5)


def test_accuracy_is_graded_apart_from_a_reward_function_that_is_not_erpo_s_math(monkeypatch):
    """A user's function, even one named `math_reward`, is not taken as the accuracy: without erpo's `math` among
    the reward functions each sample is graded once, for `accuracy` alone."""
    def math_reward(prompts, completions, **columns):   # a user's function under erpo's name
        return [1.0] * len(completions)
    calls = counting_answer_checks(monkeypatch)
    rollout, record = graded_step([math_reward], ["reward.functions=[math]"])
    assert len(calls) == len(GRADED_COMPLETIONS)
    assert rollout.correct.tolist() == [1.0, 0.0, 1.0, 0.0] and rollout.rewards.tolist() == [1.0] * 4
    assert (record["accuracy"], record["reward"]) == (0.5, 1.0)
