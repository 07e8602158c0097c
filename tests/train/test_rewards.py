"""erpo.tasks.rewards: boxed extraction, answer checking (math-verify, its time bound, the fallback), reward
functions and how they are called (TRL's keywords, `trainer_state`, a sample no function scores)."""
import logging
import math
import os
import signal
import threading
import time

import pytest

from erpo.config import Config
from erpo.models.sft import worked_response
from erpo.models.tiny import build_tokenizer
from erpo.tasks import rewards
from erpo.tasks.data import arithmetic_dataset
from erpo.tasks.rewards import (
    ANSWER_TIMEOUT_S,
    answers_match,
    compute_rewards,
    extract_boxed,
    fallback_match,
    format_reward,
    grade,
    load_reward_function,
    math_reward,
    normalize_answer,
)
from erpo.tasks.trainer_progress import TrainerProgress

PROGRESS = TrainerProgress(global_step=3, max_steps=8, epoch=1.25, is_world_process_zero=True,
                           is_local_process_zero=True)


@pytest.mark.parametrize("text,expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\left\{ x \mid x^{2} > 1 \right\}}", r"\left\{ x \mid x^{2} > 1 \right\}"),
    (r"\fbox{7}", "7"),
    (r"\boxed {3}", "3"),
    ("no box", None),
    (r"\boxed{unclosed", None),
    # without braces the box holds the next word (as verl's last_boxed_only_string and math-verify read it)
    (r"the answer is $\boxed 5$.", "5"), (r"\boxed -3", "-3"), (r"\boxed\frac12", r"\frac12"),
    (r"\boxed{1} then \boxed 2", "2"), (r"\boxed 2 then \boxed{1}", "1"), (r"\boxed{3}, cut at \boxed", None),
    # a completion cut inside its last box has no answer, even where an earlier box is closed
    (r"\boxed{3}, no: \boxed{5", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# (prediction, reference answer, whether they are equal): the forms MATH and AIME answers take. The issue's
# pairs first; the hand-written normalizer (now `fallback_match`) rejected each of them.
ANSWER_PAIRS = [
    (r"2\sqrt{2}", r"\sqrt{8}", True), (r"\sqrt{4}", "2", True), ("2^{10}", "1024", True),
    (r"\frac{\pi}{2}", r"\pi/2", True), (r"5 \text{ cm}", "5", True), (r"\text{(B)}", "B", True),
    (r"x \in [1,3]", "[1,3]", True), (r"\{1,2\}", r"\{2,1\}", True), ("1{,}000", "1000", True),
    # fractions, decimals, separators, units, wrappers
    ("0.5", r"\frac{1}{2}", True), (r"\dfrac12", r"\frac{1}{2}", True), ("1/2", r"\frac12", True),
    ("1,000", "1000", True), ("1,234,567", "1234567", True), (r"\$1{,}234.50", "1234.5", True),
    ("2.0", "2", True), ("0.50", "0.5", True), (r"$-\frac{3}{4}$", r"\frac{-3}{4}", True),
    (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}", True), (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}", True),
    # a percent sign against its bare number, as MATH's normalizer (verl's strip_string) judges; math-verify alone
    # reads 50\% as 0.5
    (r"90^\circ", "90", True), (r"30^{\circ}", "30", True), ("50\\%", "50", True), (r"\$5.00", "5", True),
    # a trailing point: "5." is 5.0 (math-verify on the whole completion and verl's string match call it wrong)
    ("5.", "5", True),
    ("10^{3}", "1000", True), (r"3\pi", r"3\pi", True), ("x = 5", "5", True), ("y = 2x+1", "2x+1", True),
    # multiple choice, text
    (r"\text{(A)}", "(A)", True), ("(B)", "B", True), (r"\textbf{(C)}", "C", True), (r"\mathrm{(D)}", "D", True),
    (r"\text{\textbf{(B)}}", "(B)", True), (r"\text{Monday}", "Monday", True),
    # tuples, intervals, sets, matrices, polynomials
    (r"\left( 1, 2 \right)", "(1,2)", True), (r"(-\infty, 2]", r"(-\infty,2]", True), ("[1,3]", r"x \in [1,3]", True),
    (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    ("(x+1)^2", "x^2+2x+1", True), ("x^2 + y^2", "y^2 + x^2", True), ("2\\sqrt{3}", "\\sqrt{12}", True),
    ("\\binom{5}{2}", "10", True),
    # not equal
    ("3", "4", False), (r"\frac{1}{3}", "0.33", False), ("(1,2)", "(2,1)", False), ("[1,3]", "(1,3)", False),
    ("(1,2]", "(1,2)", False), (r"\sqrt{8}", "3", False), ("2^{10}", "1000", False), ("B", "C", False),
    (r"\text{(B)}", "(C)", False), ("A", "(B)", False), (r"\{1,2\}", r"\{1,3\}", False), ("x^2+1", "x^2-1", False),
    (r"5 \text{ cm}", "50", False), ("1{,}000", "100", False), ("1,000", "1", False), ("12", "1,2", False),
    (r"\pi/2", r"\pi", False), (r"\frac{\pi}{2}", "1.57", False), ("0.5", "5", False), ("2", "-2", False),
    ("x", "y", False), ("", "1", False),
]
ISSUE_PAIRS = ANSWER_PAIRS[:9]


@pytest.mark.parametrize("pred,gold,equal", ANSWER_PAIRS)
def test_answer_pairs_are_judged_right(pred, gold, equal):
    assert answers_match(pred, gold) is equal
    assert math_reward(["p"], [rf"so \boxed{{{pred}}}."], answer=[gold]) == [float(equal)]


def test_no_answer_matches_nothing():
    assert not answers_match(None, "1")


def test_the_fallback_misjudges_what_its_warning_says(monkeypatch, tmp_path, caplog):
    # math-verify made unimportable in the checking process: every answer goes to fallback_match, and the run
    # says so once. The forms its warning names are indeed misjudged; the simple ones are still right.
    (tmp_path / "math_verify.py").write_text("raise ImportError('hidden by the test')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(rewards, "_checker", rewards.AnswerChecker())
    monkeypatch.setattr(rewards, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="erpo"):
        assert answers_match("0.5", r"\frac{1}{2}") and not answers_match("3", "4")
        for pred, gold in [(r"2\sqrt{2}", r"\sqrt{8}"), ("2^{10}", "1024"), (r"\frac{\pi}{2}", r"\pi/2"),
                           (r"\{1,2\}", r"\{2,1\}"), (r"x \in [1,3]", "[1,3]"), ("(x+1)^2", "x^2+2x+1")]:
            assert f"{pred} vs {gold}" in caplog.text
            assert not answers_match(pred, gold)
    warnings = [r for r in caplog.records if "math-verify cannot be imported" in r.getMessage()]
    assert len(warnings) == 1 and "hidden by the test" in warnings[0].getMessage()
    assert sum(fallback_match(p, g) == equal for p, g, equal in ISSUE_PAIRS) < len(ISSUE_PAIRS)



def test_an_answer_math_verify_raises_on_is_wrong_and_logged(monkeypatch, tmp_path, caplog):
    # A math-verify that raises on one answer (its own errors it catches; this is what it does not): the answer
    # counts as wrong, the log names it and the error, and the next answer is judged as usual.
    (tmp_path / "math_verify.py").write_text(
        "def parse(text, **kw):\n    return [text]\n"
        "def verify(gold, pred, **kw):\n"
        "    if pred == ['$boom$']:\n        raise RecursionError('too deep')\n    return gold == pred\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(rewards, "_checker", rewards.AnswerChecker())
    with caplog.at_level(logging.WARNING, logger="erpo"):
        assert math_reward(["p"] * 3, [r"\boxed{boom}", r"\boxed{7}", r"\boxed{8}"], answer=["boom", "7", "7"]) == [
            0.0, 1.0, 0.0]
    raised = [r.getMessage() for r in caplog.records if "raised" in r.getMessage()]
    assert len(raised) == 1 and "RecursionError: too deep" in raised[0] and "'boom'" in raised[0]

def test_an_adversarial_answer_cannot_stall_a_reward_called_from_a_thread(caplog):
    # Each of these keeps math-verify busy for over a minute without a time bound (measured), and math-verify's own
    # SIGALRM bound raises outside the main thread. The reward runs in a worker thread, as a rollout server's does.
    huge = r"10^{10^{10}}"
    nested = "(" * 3000 + "1" + ")" * 3000
    completions = [rf"\boxed{{{huge}}}", rf"\boxed{{{nested}}}", r"\boxed{2\sqrt{2}}"]
    result = {}

    def run():
        start = time.monotonic()
        result["rewards"] = math_reward(["p"] * 3, completions, answer=["1", "1", r"\sqrt{8}"])
        result["seconds"] = time.monotonic() - start
    thread = threading.Thread(target=run)
    with caplog.at_level(logging.WARNING, logger="erpo"):
        thread.start()
        thread.join(timeout=600)
    assert not thread.is_alive() and result["rewards"] == [0.0, 0.0, 1.0]
    # Each runaway answer is named in the log, with the reward it got.
    timeouts = [r.getMessage() for r in caplog.records if "counted as wrong" in r.getMessage()]
    assert len(timeouts) == 2 and huge in timeouts[0] and "((((" in timeouts[1]
    # Two answers bounded to ANSWER_TIMEOUT_S each, two restarts of the checking process: far below this.
    assert result["seconds"] < 4 * ANSWER_TIMEOUT_S + 2 * 60


def checker_worker(monkeypatch) -> "rewards.AnswerChecker":
    """A checker of this test's own (as the fallback test's), its math-verify process started by one answer."""
    checker = rewards.AnswerChecker()
    monkeypatch.setattr(rewards, "_checker", checker)
    assert answers_match("2", "2")
    return checker


def test_sigterm_to_the_process_group_leaves_the_answers_to_the_trainer(monkeypatch, caplog):
    # `timeout`, `kill -TERM -PGID` and a batch scheduler's preemption signal every process of the group: the trainer
    # finishes its step and saves a checkpoint (docs/training.md), so the math-verify child must keep answering
    # (it died: the step's answers were counted wrong, then the reward raised and the run crashed, unsaved)
    checker = checker_worker(monkeypatch)
    os.kill(checker._proc.pid, signal.SIGTERM)
    time.sleep(1.0)
    with caplog.at_level(logging.WARNING, logger="erpo"):
        assert answers_match("0.5", r"\frac{1}{2}")
    assert "counted as wrong" not in caplog.text and checker._proc.poll() is None


def test_a_dead_math_verify_process_costs_one_answer_and_is_replaced(monkeypatch, caplog):
    # killed from outside (SIGKILL, the OOM killer): the answer in flight counts as wrong with a warning, the next
    # one starts a new process (closing the dead one's pipe, whose unsent request raised BrokenPipeError, crashed)
    checker = checker_worker(monkeypatch)
    os.kill(checker._proc.pid, signal.SIGKILL)
    checker._proc.wait()
    with caplog.at_level(logging.WARNING, logger="erpo"):
        assert not answers_match("0.5", r"\frac{1}{2}")
        assert answers_match("0.5", r"\frac{1}{2}")
    assert "math-verify exited (-9)" in caplog.text


def test_answers_checked_from_many_threads_at_once():
    pairs = ANSWER_PAIRS[:12] * 2
    verdicts = [None] * len(pairs)

    def check(i):
        verdicts[i] = answers_match(*pairs[i][:2])
    threads = [threading.Thread(target=check, args=(i,)) for i in range(len(pairs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert verdicts == [equal for _, _, equal in pairs]


def test_normalize_answer_is_idempotent():
    for s in [r"\dfrac{3}{4}", " 12. ", r"\text{ cm}", "1,234,567", r"\text{\mathrm{m}}"]:
        assert normalize_answer(normalize_answer(s)) == normalize_answer(s)


def test_math_and_format_rewards():
    completions = [r"<think>2+2</think> so \boxed{4}", r"\boxed{5}", "4", r"<think>x</think>\boxed{4}"]
    assert math_reward(["p"] * 4, completions, answer=["4", "4", "4", "4"]) == [1.0, 0.0, 0.0, 1.0]
    assert format_reward(["p"] * 4, completions) == [1.0, 0.0, 0.0, 1.0]
    assert [grade(c, "4") for c in completions] == [("4", True), ("5", False), (None, False), ("4", True)]
    with pytest.raises(ValueError, match="answer has 1 entries for 4 completions"):
        math_reward(["p"] * 4, completions, answer=["4"])


def test_load_reward_function_from_file(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text("def length_reward(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    fn = load_reward_function(f"{file}:length_reward")
    assert fn(["a"], ["abc"]) == [3.0]
    assert load_reward_function("math") is math_reward
    with pytest.raises(ValueError, match="no callable named 'nope'"):
        load_reward_function(f"{file}:nope")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_reward_function(f"{tmp_path}/missing.py:fn")
    with pytest.raises(ValueError, match="expected 'math', 'format' or"):
        load_reward_function("bleu")


def test_compute_rewards_weights_and_none():
    def half(prompts, completions, **kw):
        return [None if c == "skip" else 0.5 for c in completions]
    totals, per_fn = compute_rewards([math_reward, half], [1.0, 2.0], ["p", "p"], [r"\boxed{1}", "skip"],
                                     {"answer": ["1", "1"]}, trainer_state=PROGRESS)
    assert totals == [2.0, 0.0] and per_fn["half"] == [0.5, None]


def test_a_sample_no_function_scores_has_no_reward_and_a_warning(caplog):
    """TRL 1.16's GRPOTrainer: a warning, and the sample's reward NaN (left out of the group's statistics and the
    reward metrics, advantage 0: tests/train/test_advantages.py), where erpo stopped the run before."""
    def half(prompts, completions, **kw):
        return [None if c.startswith("skip") else 0.5 for c in completions]
    with caplog.at_level(logging.WARNING, logger="erpo"):
        totals, per_fn = compute_rewards([half, half], None, ["p0", "p1", "p2"], ["a", "skip me", "skip"], {},
                                         trainer_state=PROGRESS)
    assert totals[0] == 1.0 and math.isnan(totals[1]) and math.isnan(totals[2])
    assert per_fn == {"half": [0.5, None, None], "half_1": [0.5, None, None]}
    [warning] = [r.getMessage() for r in caplog.records]
    assert "every reward function returned None for 2 of 3 samples, first sample 1 (prompt 'p1', completion " \
           "'skip me')" in warning and "advantage 0" in warning


def test_reward_functions_with_the_same_name_all_count(tmp_path):
    # Two files may both define `reward`: each keeps its own values and weight.
    fns = []
    for stem, value in (("first", 1.0), ("second", 10.0)):
        path = tmp_path / f"{stem}.py"
        path.write_text(f"def reward(prompts, completions, **kw):\n    return [{value}] * len(completions)\n")
        fns.append(load_reward_function(f"{path}:reward"))
    totals, per_fn = compute_rewards(fns, [2.0, 3.0], ["p"], ["c"], {}, trainer_state=PROGRESS)
    assert totals == [32.0]
    assert per_fn == {"reward": [1.0], "reward_1": [10.0]}


def test_compute_rewards_rejects_a_weight_count_mismatch():
    with pytest.raises(ValueError, match="weights has 1 entries for 2 reward functions"):
        compute_rewards([math_reward, format_reward], [1.0], ["p"], ["c"], {"answer": ["1"]}, trainer_state=PROGRESS)


def test_a_raising_reward_function_names_the_sample():
    def fragile(prompts, completions, answer, **kw):
        return [1.0 / int(a) for a in answer]
    with pytest.raises(RuntimeError, match=r"reward function 'fragile' raised on sample 2 \(prompt 'p2'.*"
                                           r"ZeroDivisionError"):
        compute_rewards([fragile], None, ["p0", "p1", "p2"], ["c0", "c1", "c2"], {"answer": ["1", "2", "0"]},
                        trainer_state=PROGRESS)


@pytest.mark.parametrize("bad", [[1.0], [1.0, math.nan], [1.0, "x"]])
def test_bad_reward_values_are_errors(bad):
    with pytest.raises(ValueError, match="reward function 'bad_fn'"):
        def bad_fn(prompts, completions, **kw):
            return bad
        compute_rewards([bad_fn], None, ["p", "q"], ["a", "b"], {}, trainer_state=PROGRESS)


def test_dataset_columns_named_like_the_arguments_do_not_clash():
    seen = {}

    def reward(prompts, completions, **columns):
        seen.update(prompts=prompts, columns=columns)
        return [1.0 for _ in completions]
    totals, _ = compute_rewards([reward], None, ["p0", "p1"], ["c0", "c1"],
                                {"prompts": ["dataset", "column"], "completions": ["x", "y"], "answer": ["1", "2"],
                                 "trainer_state": ["a", "column"]}, trainer_state=PROGRESS)
    assert totals == [1.0, 1.0] and seen["prompts"] == ["p0", "p1"]
    assert seen["columns"] == {"answer": ["1", "2"], "trainer_state": PROGRESS}


def test_reward_functions_are_called_with_trl_s_keywords():
    """TRL calls `reward_func(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...)`: a
    function whose first parameter is `completions` (TRL's own examples) works, and so does one that takes its
    arguments in another order or reads `trainer_state` for a curriculum. On a raise, each sample is called alone
    the same way, until the one that raises."""
    calls = []

    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def curriculum(completion_ids, trainer_state, answer, prompts, completions):
        calls.append((prompts, completions, answer, completion_ids, trainer_state))
        share = trainer_state.global_step / trainer_state.max_steps
        return [share * len(ids) if c != "bad" else share / 0 for c, ids in zip(completions, completion_ids)]
    columns = {"answer": ["1", "2"], "completion_ids": [[5, 6, 7], [8]]}
    totals, per_fn = compute_rewards([reward_len, curriculum], None, ["p0", "p1"], ["abc", "de"], columns,
                                     trainer_state=PROGRESS)
    assert per_fn == {"reward_len": [3.0, 2.0], "curriculum": [3 * 3 / 8, 3 / 8]}
    assert totals == [3.0 + 9 / 8, 2.0 + 3 / 8]
    assert calls == [(["p0", "p1"], ["abc", "de"], ["1", "2"], [[5, 6, 7], [8]], PROGRESS)]
    calls.clear()
    with pytest.raises(RuntimeError, match=r"'curriculum' raised on sample 1 \(prompt 'p1', completion 'bad'\)"):
        compute_rewards([curriculum], None, ["p0", "p1"], ["abc", "bad"], columns, trainer_state=PROGRESS)
    assert calls[1:] == [(["p0"], ["abc"], ["1"], [[5, 6, 7]], PROGRESS), (["p1"], ["bad"], ["2"], [[8]], PROGRESS)]


def test_trainer_state_names_what_it_does_not_hold():
    assert (PROGRESS.global_step, PROGRESS.max_steps, PROGRESS.epoch) == (3, 8, 1.25)
    with pytest.raises(AttributeError, match=r"trainer_state.log_history: erpo train fills only global_step, "
                                             r"max_steps, epoch, is_world_process_zero, is_local_process_zero"):
        PROGRESS.log_history
    assert not hasattr(PROGRESS, "num_train_epochs")


def test_an_answer_boxed_without_braces_earns_its_reward():
    # `\boxed 5` is a box in LaTeX; verl's math scorer and math-verify both accept it (it scored 0 before).
    completions = [r"so the answer is $\boxed 5$.", r"\boxed 6", r"\boxed{4} or rather \boxed 5"]
    assert math_reward(["p"] * 3, completions, answer=["5"] * 3) == [1.0, 0.0, 1.0]


def test_the_default_task_rewards_right_answers_and_only_them():
    # The README's first command trains on arithmetic with the math reward alone (README: reward = accuracy there).
    # The warm start's answer form, decoded as a rollout decodes it, earns 1 when right, 0 off by one or by sign.
    cfg = Config()
    assert cfg.data.source == "arithmetic" and cfg.reward.functions == ["math"]
    tokenizer = build_tokenizer()
    records = arithmetic_dataset(40, seed=0, max_operand=cfg.data.arithmetic_max_operand)
    gold = [r["answer"] for r in records]
    assert any(a.startswith("-") for a in gold) and any(a == "0" for a in gold)

    def rollout_text(answer):
        ids = tokenizer(worked_response(answer, tokenizer.eos_token), add_special_tokens=False)["input_ids"]
        return tokenizer.decode(ids, skip_special_tokens=True)
    assert math_reward(None, [rollout_text(a) for a in gold], answer=gold) == [1.0] * len(gold)
    assert math_reward(None, [rollout_text(str(int(a) + 1)) for a in gold], answer=gold) == [0.0] * len(gold)
    signed = [a for a in gold if a.startswith("-")]
    assert math_reward(None, [rollout_text(a[1:]) for a in signed], answer=signed) == [0.0] * len(signed)
