"""erpo.eval.problem_sets: loaders for the common public formats (JSONL and Parquet) and the built-in set."""

import json
import os
import sys
import types

import pytest

from erpo.config import DataConfig
from erpo.eval.model_specs import RAW_TEMPLATES, PromptSettings
from erpo.eval.problem_sets import (
    held_out_benchmark,
    load_benchmark,
    load_benchmarks,
    parse_benchmark_spec,
    read_records,
    records_to_problems,
    synthetic_benchmark,
)
from erpo.eval.sampling import problem_prompt_ids
from erpo.models.tiny import build_tokenizer
from erpo.tasks.data import arithmetic_dataset
from erpo.tasks.rewards import math_reward

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "benchmarks")

# (problem, gold answer alternatives) the loader must produce from each fixture, whichever the file format.
UNIT = "\n\nThe unit of the answer is m/s; put only its value, without the unit, in \\boxed{}."
EXPECTED = {
    "math500": [("What is $2+3$?", ["5"]), ("Simplify $\\frac{6}{8}$.", ["\\frac{3}{4}"]),
                ("Solve $x^2=9$ for $x>0$.", ["3"])],
    "aime24": [("Find the remainder when $7^{4}$ is divided by $1000$.", ["401"]),
               ("How many positive divisors does $36$ have?", ["9"])],
    "aime25": [("Compute $12 \\cdot 12$.", ["144"]), ("Compute $2^{10}$.", ["1024"])],
    "amc": [("What is $10\\%$ of $250$?", ["25"]),  # float 25.0 in the public AMC set
            ("What is $\\frac{1}{2}+\\frac{1}{4}$ as a decimal?", ["0.75"])],
    "minerva": [("A car moves at $20 \\mathrm{~m/s}$ for $3 \\mathrm{~s}$. How far does it go, in meters?", ["60"]),
                ("What is the frequency in Hz of a wave with period $0.5 \\mathrm{~s}$?", ["2"])],
    "olympiadbench": [("Find all real $x$ with $x^2=4$.", ["2, -2"]),  # is_multiple_answer: one answer, two parts
                      ("Compute $\\frac{1}{2}+\\frac{1}{3}$.", ["\\frac{5}{6}"])],
    "verl": [("What is $4+4$?", ["8"]), ("What is $9-3$?", ["6"])],  # chat prompt + reward_model.ground_truth
    # official ERPO JSONL: the paper's suffix already in 'prompt' (removed: the template adds it once),
    # ground_truth a Python-repr list string of alternatives
    "erpo_minerva": [("Estimate the wavelength in Angstroms, to two significant figures.", ["9.6"]),
                     ("What is the angular resolution of a single dish, in radians?", ["0.01", "0.02"]),
                     ("Compute the luminosity in erg/s.", ["7 \\times 10^{37}"])],
    "erpo_olympiad_bench": [("How many moves does Sergey need?", ["2"]),
                            ("Find the largest real number $\\mu$.", ["\\frac{1}{2 n+2}"]),
                            ("Determine all triples $(p, x, y)$.", ["(1,8,19), (2,7,13), (4,5,7)"])],
    "erpo_math": [("What is $1+1$?", ["2"]), ("Simplify $\\frac{2}{4}$.", ["\\frac{1}{2}"])],
    # Dr.GRPO's Minerva: a list of alternatives
    "minerva_alternatives": [("What is the angular resolution of a single dish, in radians?", ["0.01", "0.02"]),
                             ("Give the wavelength in nm.", ["500"])],
    # OlympiadBench physics: the unit is named in the problem, the gold answer is the bare value
    "olympiadbench_unit": [("A ball falls for $2 \\mathrm{~s}$ from rest. How fast is it then? "
                            "Take $g=10 \\mathrm{~m/s^2}$." + UNIT, ["20"]),
                           ("Compute $3 \\cdot 4$.", ["12"])],
    # verl-style prompts that already hold verl's or Qwen2.5-Math's instruction (removed)
    "verl_instruction": [("What is $4+4$?", ["8"]), ("What is $9-3$?", ["6"])],
}


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_formats_load(name, ext):
    path = os.path.join(FIXTURES, f"{name}.{ext}")
    if name == "verl":   # its first prompt holds a system message, which the problem leaves out (said)
        with pytest.warns(UserWarning, match="1 of 2 chat prompts hold a system message"):
            bench = load_benchmark(path)
    else:
        bench = load_benchmark(path)
    assert bench.name == name
    assert [(p["problem"], p["answers"]) for p in bench.problems] == EXPECTED[name]
    assert [p["id"] for p in bench.problems] == list(range(len(EXPECTED[name])))


def test_jsonl_and_parquet_rows_agree():
    for name in EXPECTED:
        assert read_records(os.path.join(FIXTURES, f"{name}.jsonl")) == read_records(
            os.path.join(FIXTURES, f"{name}.parquet")), name


def test_json_list_file(tmp_path):
    rows = read_records(os.path.join(FIXTURES, "aime25.jsonl"))
    path = tmp_path / "aime25.json"
    path.write_text(json.dumps(rows))
    bench = load_benchmark(f"my_aime={path}")
    assert bench.name == "my_aime"
    assert [(p["problem"], p["answers"]) for p in bench.problems] == EXPECTED["aime25"]


def test_field_mapping_overrides_detection():
    # MATH500 rows hold both 'answer' and 'solution': map the answer from the \boxed{} of the solution,
    # and the problem from a nested/dotted field in the verl format.
    bench = load_benchmark(os.path.join(FIXTURES, "math500.jsonl") + "#answer=solution#limit=2")
    assert [p["answers"] for p in bench.problems] == [["5"], ["\\frac{3}{4}"]]
    with pytest.warns(UserWarning, match="system message"):
        verl = load_benchmark("v=" + os.path.join(FIXTURES, "verl.parquet")
                              + "#answer=reward_model.ground_truth#problem=prompt")
    assert [p["answers"] for p in verl.problems] == [["8"], ["6"]]


def test_missing_field_names_the_option(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"text": "1+1?", "label": "2"}) + "\n")
    with pytest.raises(ValueError, match="#problem=FIELD"):
        load_benchmark(str(path))
    bench = load_benchmark(f"{path}#problem=text#answer=label")
    assert bench.problems == [{"id": 0, "problem": "1+1?", "answers": ["2"]}]
    with pytest.raises(ValueError, match="record 0"):
        load_benchmark(f"{path}#problem=label#answer=missing_field")


def test_bad_files_and_specs(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_benchmark(str(tmp_path / "absent.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_benchmark(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        load_benchmark(str(empty))
    with pytest.raises(ValueError, match="bad option"):
        parse_benchmark_spec("x.jsonl#colour=red")
    with pytest.raises(ValueError, match="limit must be an int"):
        load_benchmark("synthetic#limit=many")
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        load_benchmark("synthetic#limit=0")
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        load_benchmark("synthetic#seed=-1")
    with pytest.raises(ValueError, match="not a file"):
        load_benchmark("no_such_benchmark")
    with pytest.raises(ValueError, match="unique"):
        load_benchmarks(["synthetic", "synthetic"])


def test_parse_benchmark_spec():
    assert parse_benchmark_spec("data/aime24.parquet") == ("aime24", "data/aime24.parquet", {})
    assert parse_benchmark_spec("ob=x/y.jsonl#problem=question#answer=final_answer") == (
        "ob", "x/y.jsonl", {"problem": "question", "answer": "final_answer"})
    assert parse_benchmark_spec("HuggingFaceH4/MATH-500#split=test") == (
        "MATH-500", "HuggingFaceH4/MATH-500", {"split": "test"})


def test_answer_normalisation():
    rows = [{"q": "a", "a": 7}, {"q": "b", "a": 3.0}, {"q": "c", "a": "$x+1$"}, {"q": "d", "a": ["4"]}]
    assert [p["answers"] for p in records_to_problems(rows, "t", "q", "a")] == [["7"], ["3"], ["x+1"], ["4"]]
    with pytest.raises(ValueError, match="without"):
        records_to_problems([{"problem": "a", "solution": "no box"}], "t", None, "solution")


def test_list_literals_and_instructions_are_read_narrowly():
    """Only a Python list of strings is unpacked (an interval or a list of numbers is an answer); an instruction
    is removed only at the end of a problem, and a problem that is nothing but an instruction is kept."""
    rows = [{"q": "a", "a": "[0, 1]"}, {"q": "b", "a": "[2, 5)"}, {"q": "c", "a": "['1', '1', ' 2 ']"}]
    assert [p["answers"] for p in records_to_problems(rows, "t", "q", "a")] == [["[0, 1]"], ["[2, 5)"], ["1", "2"]]
    suffix = "Please reason step by step, and put your final answer within \\boxed{}."
    rows = [{"q": suffix + " Then add 1.", "a": "1"}, {"q": suffix, "a": "1"}]
    assert [p["problem"] for p in records_to_problems(rows, "t", "q", "a")] == [suffix + " Then add 1.", suffix]



@pytest.mark.parametrize("template,kept", [("plain", True), ("Q: {problem}", True), ("paper", False),
                                          (RAW_TEMPLATES["qwen-math"], False)])
def test_a_problems_own_instruction_is_dropped_only_for_a_template_that_brings_one(template, kept):
    """A verl-style file's instruction is the only one a `plain` run trained with: the model is asked with it. A
    template that asks for \\boxed{} itself (paper, qwen-math) gets the problem without it: one instruction either
    way (with `plain` the model was asked none at all)."""
    tokenizer = build_tokenizer()
    problems = load_benchmark(os.path.join(FIXTURES, "verl_instruction.jsonl")).problems
    settings = PromptSettings(template=template, use_chat_template=template in ("plain", "paper"))
    instructions = ["Let's think step by step and output the final answer within \\boxed{}.",
                    "Please reason step by step, and put your final answer within \\boxed{}."]
    for problem, instruction, ids in zip(problems, instructions, problem_prompt_ids(tokenizer, problems, settings)):
        prompt = tokenizer.decode(ids)
        assert problem["problem"] + (" " + instruction if kept else "") in prompt
        assert prompt.count("\\boxed{}") == 1


def test_a_system_message_left_out_of_a_chat_prompt_is_warned_of():
    """A chat prompt's problem is its last user message: a system message beside it (a verl-style file's instruction
    or persona) does not reach the model, which is said once per benchmark, not left silent."""
    rows = [{"prompt": [{"role": "system", "content": "Put the answer in \\boxed{}."},
                        {"role": "user", "content": "1+1?"}], "answer": "2"},
            {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
    with pytest.warns(UserWarning, match=r"^t: 1 of 2 chat prompts hold a system message, which is left out"):
        problems = records_to_problems(rows, "t")
    assert [p["problem"] for p in problems] == ["1+1?", "2+2?"]

def test_synthetic_default_is_offline_and_deterministic():
    default = load_benchmarks(None)
    assert [b.name for b in default] == ["synthetic"]
    first = synthetic_benchmark(12, seed=3)
    again = synthetic_benchmark(12, seed=3)
    other = synthetic_benchmark(12, seed=4)
    assert first.problems == again.problems
    assert first.problems != other.problems
    assert len(first.problems) == 12
    assert all(p["problem"] and p["answers"] for p in first.problems)
    limited = load_benchmark("arith=synthetic#n=20#seed=3#limit=5")
    assert limited.name == "arith" and len(limited.problems) == 5
    small = load_benchmark("synthetic#n=50#max_operand=2")
    assert all(-2 <= int(p["answers"][0]) <= 4 for p in small.problems)
    assert {p["answers"][0] for p in small.problems} >= {"-2", "4"}  # the extremes occur in 50 draws


def _every_training_problem(max_operand: int) -> set[str]:
    return {f"{a}{op}{b}=?" for a in range(max_operand + 1) for b in range(max_operand + 1) for op in "+-"}


def test_heldout_is_disjoint_from_training():
    """No held-out problem is one the training generator can draw at the default operand bound, nor (with
    #larger_than=M) at a raised one; the training prompts of a seed do meet the synthetic set, for contrast."""
    trained = DataConfig().arithmetic_max_operand
    default = load_benchmark("heldout#n=500")
    assert default.name == "heldout" and len(default.problems) == 500
    assert not {p["problem"] for p in default.problems} & _every_training_problem(trained)
    assert {p["problem"] for p in default.problems} <= _every_training_problem(2 * trained)
    raised = load_benchmark("h20=heldout#n=300#larger_than=20#seed=3")
    assert raised.name == "h20" and not {p["problem"] for p in raised.problems} & _every_training_problem(20)
    assert {p["problem"] for p in raised.problems} <= _every_training_problem(40)
    training = {r["problem"] for r in arithmetic_dataset(1000, seed=0, max_operand=trained)}
    assert training & {p["problem"] for p in load_benchmark("synthetic#n=128#seed=7").problems}
    assert not training & {p["problem"] for p in default.problems}


def test_heldout_is_deterministic_and_options_apply():
    first = held_out_benchmark(40, seed=9)
    assert first.problems == load_benchmark("heldout#n=40#seed=9").problems
    assert first.problems != held_out_benchmark(40, seed=10).problems
    assert first.source == "heldout#n=40#seed=9#larger_than=10#max_operand=20"
    wide = load_benchmark("heldout#n=200#max_operand=30")
    largest = [max(int(x) for x in p["problem"][:-2].replace("-", "+").split("+")) for p in wide.problems]
    assert min(largest) > 10 and max(largest) == 30
    with pytest.raises(ValueError, match="must be above larger_than"):
        load_benchmark("heldout#larger_than=10#max_operand=10")
    with pytest.raises(ValueError, match="heldout set only"):
        load_benchmark("synthetic#larger_than=10")


def test_heldout_answers_are_graded_by_the_math_check():
    problems = held_out_benchmark(24, seed=2).problems
    golds = [p["answers"][0] for p in problems]
    assert golds == [str(eval(p["problem"][:-2])) for p in problems]
    prompts = [p["problem"] for p in problems]
    right = math_reward(prompts, [f"\\boxed{{{g}}}" for g in golds], golds)
    wrong = math_reward(prompts, [f"\\boxed{{{int(g) + 1}}}" for g in golds], golds)
    assert right == [1.0] * len(problems) and wrong == [0.0] * len(problems)


def test_hub_names_go_through_datasets(monkeypatch):
    """Short names and owner/name specs call datasets.load_dataset(name, config, split=...) (faked here)."""
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return [{"question": "What is $1+1$?", "final_answer": ["$2$"]}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert load_benchmark("math500").problems == [{"id": 0, "problem": "What is $1+1$?", "answers": ["2"]}]
    load_benchmark("ob=someone/olympiad#config=OE_TO_maths_en_COMP#split=train")
    assert calls == [("HuggingFaceH4/MATH-500", None, "test"), ("someone/olympiad", "OE_TO_maths_en_COMP", "train")]
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ImportError, match="pip install datasets"):
        load_benchmark("aime24")
