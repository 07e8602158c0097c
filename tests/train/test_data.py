"""erpo.tasks.data and erpo.models.tiny: arithmetic generator, JSONL/JSON/Parquet loading, the paper's prompt,
tokenization."""
import copy
import json
import os

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from erpo.errors import UserError
from erpo.eval.model_specs import PromptSettings
from erpo.eval.problem_sets import records_to_problems
from erpo.eval.sampling import problem_prompt_ids
from erpo.models.tiny import build_model, build_tokenizer
from erpo.tasks.data import (
    PAPER_SUFFIX,
    PromptSet,
    arithmetic_dataset,
    build_prompt,
    encode_prompt,
    load_dataset_records,
    prompt_set_identity,
    tokenize_prompts,
)
from erpo.tasks.rewards import math_reward
from erpo.train.run_dir import training_set_mismatch


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_arithmetic_dataset_is_deterministic_and_correct():
    records = arithmetic_dataset(50, seed=3, max_operand=9)
    assert records == arithmetic_dataset(50, seed=3, max_operand=9)
    assert records != arithmetic_dataset(50, seed=4, max_operand=9)
    for r in records:
        assert r["problem"].endswith("=?")
        assert int(r["answer"]) == eval(r["problem"][:-2])
    with pytest.raises(ValueError, match="n must be > 0"):
        arithmetic_dataset(0, seed=0)


def test_arithmetic_training_draws_are_pinned():
    """The training problems of a seed are those of earlier runs (taken from the generator before larger_than
    existed): a change here would silently change every recorded experiment's prompts."""
    assert [r["problem"] for r in arithmetic_dataset(6, seed=0)] == [
        "6+6=?", "4-8=?", "6-4=?", "5+9=?", "8-2=?", "2-1=?"]
    assert [r["problem"] for r in arithmetic_dataset(4, seed=42, max_operand=20)] == [
        "20+3=?", "8+7=?", "4+3=?", "18+13=?"]


def test_arithmetic_larger_than_draws_only_beyond_it():
    records = arithmetic_dataset(300, seed=5, max_operand=20, larger_than=10)
    operands = [tuple(int(x) for x in r["problem"][:-2].replace("-", "+").split("+")) for r in records]
    assert all(10 < max(pair) <= 20 and min(pair) >= 0 for pair in operands)
    assert min(min(pair) for pair in operands) <= 10  # one operand may still be small: not just a shifted range
    assert all(int(r["answer"]) == eval(r["problem"][:-2]) for r in records)
    for bad in (20, 25, -1):
        with pytest.raises(ValueError, match="larger_than must be in"):
            arithmetic_dataset(3, seed=0, max_operand=20, larger_than=bad)


def test_load_jsonl_json_parquet(tmp_path):
    rows = [{"problem": "1+1=?", "answer": "2", "level": 3}, {"problem": "2+2=?", "answer": "4", "level": 5}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.json", "d.parquet"):
        assert load_dataset_records(str(tmp_path / name))[0] == rows
    assert load_dataset_records(str(tmp_path / "d.json"))[1] == ["record 1", "record 2"]
    assert load_dataset_records(str(tmp_path / "d.parquet"))[1] == ["row 1", "row 2"]


def test_jsonl_text_may_hold_unicode_line_separators(tmp_path):
    rows = [{"problem": "one\u2028two", "answer": "1"}, {"problem": "three", "answer": "3"}]
    path = tmp_path / "sep.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    assert load_dataset_records(str(path)) == (rows, ["line 1", "line 2"])


def test_custom_fields_and_missing_field_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    # lines count from 1, blank lines included
    path.write_text(json.dumps({"question": "q", "solution": "s"}) + "\n\n" + json.dumps({"question": "q2"}) + "\n")
    with pytest.raises(UserError, match=r"d.jsonl: line 3 has no field 'solution' \(data.answer_field\).*\['question'\]"
                                        r".*set data.answer_field"):
        load_dataset_records(str(path), problem_field="question", answer_field="solution")
    with pytest.raises(UserError, match="line 1 has no field 'problem'"):
        load_dataset_records(str(path))


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file") as missing:
        load_dataset_records(str(tmp_path / "missing.jsonl"))
    assert isinstance(missing.value, UserError)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x", "answer": "1"}\n{not json\n')
    with pytest.raises(UserError, match="bad.jsonl:2: not valid JSON"):
        load_dataset_records(str(bad))
    bad_list = tmp_path / "bad.json"
    bad_list.write_text('[\n{"problem": "x", "answer": "1"},\n{oops}\n]')
    with pytest.raises(UserError, match="bad.json:3: not valid JSON"):
        load_dataset_records(str(bad_list))
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install datasets"):
            load_dataset_records("someone/some-dataset")


def test_paper_prompt_through_chat_template(tokenizer):
    text = build_prompt(tokenizer, "  What is 1+1?  ", "paper")
    assert text == ("<|im_start|>user\nWhat is 1+1?" + PAPER_SUFFIX + "<|im_end|>\n<|im_start|>assistant\n")
    assert "<think> </think>" in text and "\\boxed{}" in text
    assert build_prompt(tokenizer, "x", "Q: {problem} A:", use_chat_template=False) == "Q: x A:"
    with pytest.raises(ValueError, match="data.template"):
        build_prompt(tokenizer, "x", "no placeholder")
    text, ids = encode_prompt(tokenizer, "What is 1+1?", "plain")  # chat tokens are single ids, no BOS added
    assert text == "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and tokenizer.decode(ids) == text
    assert len(ids) == 3 + len("user\nWhat is 1+1?" "\n" "assistant\n")  # 3 chat tokens, 1 id per character


def test_the_bos_is_in_every_prompt_once(tokenizer):
    """A tokenizer that adds a BOS (as Llama's and Gemma's do): bare text gets it from the tokenizer (it had none:
    a BOS-trained model scored every prompt without it), a chat template that writes it gets it from the template
    only (once)."""
    bos = copy.deepcopy(tokenizer)
    bos.add_special_tokens({"bos_token": "<s>"})
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                                         special_tokens=[("<s>", bos.bos_token_id)])
    bos.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    text, bare = encode_prompt(bos, "1+1", "plain", use_chat_template=False)
    assert bare == [bos.bos_token_id] + tokenizer(text)["input_ids"]
    text, templated = encode_prompt(bos, "1+1", "plain", use_chat_template=True)
    assert text == "<s>[1+1]" and templated.count(bos.bos_token_id) == 1 and templated[0] == bos.bos_token_id
    bos.chat_template = None   # a base model without a chat template: the bare text, with the BOS
    assert encode_prompt(bos, "1+1", "plain", use_chat_template=True)[1] == bare


def test_an_eos_the_tokenizer_appends_to_bare_text_is_left_out(tokenizer):
    """A tokenizer that adds BOS and EOS (`add_eos_token=True`, as an SFT setup leaves it): the bare prompt keeps the
    BOS and ends without the EOS (a prompt ending in EOS asks for no response); an EOS the text itself ends with
    stays."""
    both = copy.deepcopy(tokenizer)
    both.add_special_tokens({"bos_token": "<s>"})
    specials = [("<s>", both.bos_token_id), (both.eos_token, both.eos_token_id)]
    both.backend_tokenizer.post_processor = processors.TemplateProcessing(single=f"<s> $A {both.eos_token}",
                                                                          special_tokens=specials)
    text, ids = encode_prompt(both, "1+1", "plain", use_chat_template=False)
    assert ids == [both.bos_token_id] + tokenizer(text)["input_ids"]
    text, ids = encode_prompt(both, "1+1" + both.eos_token, "plain", use_chat_template=False)
    assert text.endswith(both.eos_token) and ids[-1] == both.eos_token_id and ids.count(both.eos_token_id) == 2


def test_tokenize_prompts_rejects_empty_and_too_long(tokenizer):
    records = [{"problem": "1+1=?", "answer": "2"}, {"problem": "   ", "answer": "0"},
               {"problem": "9" * 80, "answer": "9"}, {"problem": "3+3=?", "answer": None}]
    kwargs = dict(problem_field="problem", answer_field="answer", template="plain", use_chat_template=True,
                  max_prompt_length=64)
    with pytest.raises(UserError, match=r"3 invalid training record\(s\): record 2: empty.*record 3: prompt has "
                                        r"\d+ tokens > data.max_prompt_length=64.*record 4: missing 'answer'"):
        tokenize_prompts(tokenizer, records, skip_invalid=False, **kwargs)
    with pytest.raises(UserError, match=r"d.jsonl line 9: empty"):
        tokenize_prompts(tokenizer, records[:2], skip_invalid=False, where=["d.jsonl line 7", "d.jsonl line 9"],
                         **kwargs)
    with pytest.warns(UserWarning, match="dropped 3 invalid"):
        kept = tokenize_prompts(tokenizer, records, skip_invalid=True, **kwargs)
    assert kept.answers == ["2"] and kept.records == records[:1]
    assert kept.prompt_ids[0] == tokenizer(kept.prompts[0], add_special_tokens=False)["input_ids"]



def test_training_reads_gold_answers_as_evaluation_does(tokenizer):
    """The answer column is read as `erpo eval` reads a benchmark's: the official ERPO files' Python-list string, a
    one-element list, a float and `$...$` (each compared raw before: every sample's math reward 0), a solution's last
    box; an empty answer or several alternatives (the math reward compares with one) are invalid records."""
    kwargs = dict(problem_field="problem", template="plain", use_chat_template=True, max_prompt_length=64)
    gold = ["['9.6\\n']", ["0.02"], 25.0, "$\\frac{1}{2}$", "-3"]
    kept = tokenize_prompts(tokenizer, [{"problem": "p", "answer": a} for a in gold], answer_field="answer",
                            skip_invalid=False, **kwargs)
    assert kept.answers == ["9.6", "0.02", "25", "\\frac{1}{2}", "-3"]
    completions = ["\\boxed{9.6}", "\\boxed{0.02}", "\\boxed{25}", "\\boxed{0.5}", "\\boxed{-3}"]
    assert math_reward(kept.prompts, completions, answer=kept.answers) == [1.0] * 5
    solved = tokenize_prompts(tokenizer, [{"problem": "p", "solution": "So $x=\\boxed{7}$."}], answer_field="solution",
                              skip_invalid=False, **kwargs)
    assert solved.answers == ["7"]
    bad = [{"problem": "p", "answer": a} for a in ["", ["1", "2"], "['1', '2']", True]]
    with pytest.raises(UserError, match=r"4 invalid training record\(s\): record 1: field 'answer' is empty; "
                                        r"record 2: 'answer' holds 2 alternative answers.*record 3: 'answer' holds 2"
                                        r".*record 4: field 'answer' must be a string or a number"):
        tokenize_prompts(tokenizer, bad, answer_field="answer", skip_invalid=False, **kwargs)


def test_a_small_float_answer_is_written_as_its_digits(tokenizer):
    """A float answer column (Parquet, JSONL) below 1e-4 was printed as Python does, `1.5e-05`: math-verify reads
    that as 1.5 (inside `$`, as 1.5 e - 5 with Euler's e), so `0.000015` and `1.5 \\times 10^{-5}` earned 0 in
    training and evaluation alike. It is written positionally; a NaN or infinite answer is an invalid record naming
    the field."""
    kwargs = dict(problem_field="problem", answer_field="answer", template="plain", use_chat_template=True,
                  max_prompt_length=64, skip_invalid=False)
    kept = tokenize_prompts(tokenizer, [{"problem": "p", "answer": a} for a in [1.5e-05, -3e-06, 0.25, [1e-07]]],
                            **kwargs)
    assert kept.answers == ["0.000015", "-0.000003", "0.25", "0.0000001"]
    assert records_to_problems([{"problem": "p", "answer": 1.5e-05}], "t")[0]["answers"] == ["0.000015"]
    completions = ["\\boxed{0.000015}", "\\boxed{-3 \\times 10^{-6}}", "\\boxed{\\frac14}", "\\boxed{10^{-7}}"]
    assert math_reward(kept.prompts, completions, answer=kept.answers) == [1.0] * 4
    with pytest.raises(UserError, match=r"2 invalid training record\(s\): record 1: field 'answer' must be a finite "
                                        r"number, got nan; record 2: field 'answer' must be a finite number, got inf"):
        tokenize_prompts(tokenizer, [{"problem": "p", "answer": a} for a in [float("nan"), float("inf")]], **kwargs)


@pytest.mark.parametrize("template", ["plain", "paper"])
def test_a_problem_is_asked_with_one_instruction_in_training_as_in_evaluation(tokenizer, template):
    """A problem that ends with an instruction (the official ERPO files' suffix, verl's line) is asked with it under
    `plain` and without it under `paper` (which brings its own; it was asked two): the prompt `erpo eval` gives."""
    instruction = "Let's think step by step and output the final answer within \\boxed{}."
    for problem in ["What is $4+4$? " + instruction, "What is $4+4$?" + PAPER_SUFFIX]:
        kept = tokenize_prompts(tokenizer, [{"problem": problem, "answer": "8"}], problem_field="problem",
                                answer_field="answer", template=template, use_chat_template=True,
                                max_prompt_length=512, skip_invalid=False)
        assert kept.prompts[0].count("\\boxed{}") == 1
        bench = records_to_problems([{"problem": problem, "answer": "8"}], "t")
        settings = PromptSettings(template=template, use_chat_template=True)
        assert kept.prompt_ids == problem_prompt_ids(tokenizer, bench, settings)


@pytest.mark.parametrize("template", ["plain", "paper"])
def test_a_row_with_a_unit_is_asked_the_same_question_in_training_as_in_evaluation(tokenizer, template):
    """OlympiadBench's rows with a `unit`: the sentence naming it, which `erpo eval` adds, is in the training prompt
    too, in the same place (training left it out), with or without an instruction ending the problem."""
    for problem in ["How fast is it?",
                    "How fast is it? Please reason step by step, and put your final answer within \\boxed{}."]:
        row = {"problem": problem, "answer": "20", "unit": " m/s "}
        kept = tokenize_prompts(tokenizer, [row], problem_field="problem", answer_field="answer", template=template,
                                use_chat_template=True, max_prompt_length=512, skip_invalid=False)
        assert "The unit of the answer is m/s; put only its value" in kept.prompts[0]
        settings = PromptSettings(template=template, use_chat_template=True)
        assert kept.prompt_ids == problem_prompt_ids(tokenizer, records_to_problems([row], "t"), settings)


def test_the_official_erpo_file_trains_as_it_is(tokenizer):
    """docs/training.md: the official file (prompt with the paper's suffix, a Python-repr ground_truth) trains with
    data.problem_field=prompt, answer_field=ground_truth, template=paper: one instruction, the gold read as `erpo eval`
    reads it, the prompts `erpo eval` gives."""
    path = os.path.join(os.path.dirname(__file__), "fixtures", "benchmarks", "erpo_olympiad_bench.jsonl")
    records, where = load_dataset_records(path, problem_field="prompt", answer_field="ground_truth")
    kept = tokenize_prompts(tokenizer, records, problem_field="prompt", answer_field="ground_truth", template="paper",
                            use_chat_template=True, max_prompt_length=1024, skip_invalid=False, where=where)
    assert [p.count(PAPER_SUFFIX.strip()) for p in kept.prompts] == [1, 1, 1]
    assert kept.answers == ["2", "\\frac{1}{2 n+2}", "(1,8,19), (2,7,13), (4,5,7)"]
    bench = records_to_problems(records, path, "prompt", "ground_truth")
    assert kept.prompt_ids == problem_prompt_ids(tokenizer, bench, PromptSettings(template="paper"))

def test_a_training_set_is_identified_by_its_prompt_ids_in_order_and_its_answers():
    """What a resumed run checks its checkpoint's training set against (`erpo.train.run_dir`): the count, the token ids
    in order (their split into prompts included) and the gold answers; the message names which of them differs."""
    def identity(prompt_ids, answers):
        return prompt_set_identity(PromptSet([{}] * len(answers), ["p"] * len(answers), prompt_ids, answers))

    base = identity([[5, 6], [7, 8]], ["1", "2"])
    assert base["prompts"] == 2 and identity([[5, 6], [7, 8]], ["1", "2"]) == base
    others = {"reordered": identity([[7, 8], [5, 6]], ["2", "1"]),
              "split otherwise": identity([[5], [6, 7, 8]], ["1", "2"]),
              "other answers": identity([[5, 6], [7, 8]], ["1", "3"]), "fewer": identity([[5, 6]], ["1"])}
    assert len({json.dumps(i, sort_keys=True) for i in [base, *others.values()]}) == 5
    assert training_set_mismatch(base, base) is None
    assert training_set_mismatch(base, others["fewer"]) == "2 prompts then, 1 now"
    for name in ("reordered", "split otherwise"):
        assert training_set_mismatch(base, others[name]) == "2 prompts then and now, other prompt token ids"
    assert training_set_mismatch(base, others["other answers"]) == "2 prompts then and now, other gold answers"


def test_tiny_tokenizer_is_character_level_and_survives_save_load(tmp_path, tokenizer):
    text = build_prompt(tokenizer, "12 + 3=?\n\tok", "plain") + "\\boxed{15}<|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    body = "12 + 3=?\n\tok"
    assert len(tokenizer(body, add_special_tokens=False)["input_ids"]) == len(body)
    build_model(tokenizer, seed=0, hidden_size=16, intermediate_size=32, num_layers=1).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)  # transformers picks Qwen2's tokenizer class for qwen2
    assert reloaded(text, add_special_tokens=False)["input_ids"] == ids
    assert reloaded.chat_template == tokenizer.chat_template
    assert (reloaded.eos_token_id, reloaded.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
