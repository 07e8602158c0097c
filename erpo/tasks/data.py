"""Prompt datasets: the built-in arithmetic generator, JSONL/Parquet/HF loading, the paper's prompt, tokenization."""
from __future__ import annotations

import hashlib
import json
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

from erpo.errors import UserError
from erpo.records import RECORD_SUFFIXES, read_hub_records, read_located_records
from erpo.tasks.gold import gold_answers

# Paper appendix A: appended to the problem, then the whole message goes through the chat template.
PAPER_SUFFIX = (" You FIRST think about the reasoning process as an internal monologue and then provide the "
                "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
                "answer MUST BE put in \\boxed{}.")
TEMPLATES = {"paper": "{problem}" + PAPER_SUFFIX, "plain": "{problem}"}
# Instructions a data file's problem may already end with (the official ERPO files, verl's math preprocessing,
# Qwen2.5-Math's prompt): a template that brings its own is filled with the problem without it (`split_instruction`).
INSTRUCTION_SUFFIXES = (
    PAPER_SUFFIX.strip(),
    "Let's think step by step and output the final answer within \\boxed{}.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
)


def split_instruction(problem: str) -> tuple[str, str]:
    """(`problem` stripped and without a trailing INSTRUCTION_SUFFIXES, that instruction with the white space before
    it or ""): a problem that is nothing but an instruction, or holds one elsewhere, is left whole."""
    text = problem.strip()
    for suffix in INSTRUCTION_SUFFIXES:
        if text.endswith(suffix) and text != suffix:
            kept = text[: -len(suffix)].rstrip()
            return kept, text[len(kept):]
    return text, ""


# OlympiadBench rows with a `unit` column: its gold answer is the bare value, as OlympiadBench's own prompt asks for it
UNIT_SENTENCE = "The unit of the answer is {unit}; put only its value, without the unit, in \\boxed{{}}."


def question_parts(problem: str, unit=None) -> tuple[str, str]:
    """(the question without an instruction, the instruction `problem` ended with or "") of a row's problem text and
    `unit` column, as training and `erpo eval` both ask it (`asked_problem`): `split_instruction`'s, with a sentence
    naming a non-empty `unit` (UNIT_SENTENCE) after the problem, before any instruction."""
    text, instruction = split_instruction(problem)
    if isinstance(unit, str) and unit.strip():
        text = f"{text}\n\n{UNIT_SENTENCE.format(unit=unit.strip())}"
    return text, instruction


def asked_problem(question: str, instruction: str, template: str) -> str:
    """The text `template` is filled with, in training and in `erpo eval` alike (the model is asked the same
    question): `question_parts`' question, then its instruction unless the template brings its own (one
    instruction either way)."""
    return question if brings_instruction(template) else question + instruction


def brings_instruction(template: str) -> bool:
    """Whether a prompt template (a name of TEMPLATES or the format text) asks for the answer in \\boxed{} itself,
    as the paper's and qwen-math's do; `plain` does not. Such a template is filled with a problem without the
    instruction the problem ended with (`split_instruction`): it is asked one either way."""
    return "\\boxed" in TEMPLATES.get(template, template)


def arithmetic_dataset(n: int, seed: int, max_operand: int = 10, larger_than: int | None = None) -> list[dict]:
    """`n` verifiable problems "a+b" / "a-b" with 0 <= a, b <= max_operand; keys `problem`, `answer` (str).

    With `larger_than` (< max_operand), only problems whose larger operand exceeds it: a pair with
    max(a, b) <= larger_than is drawn again. Such problems are disjoint from every problem of
    `arithmetic_dataset(..., max_operand=larger_than)` (a held-out set); without it the draws are unchanged.
    """
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    if larger_than is not None and not 0 <= larger_than < max_operand:
        raise ValueError(f"larger_than must be in [0, max_operand={max_operand}), got {larger_than}")
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        while larger_than is not None and max(a, b) <= larger_than:
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        records.append({"problem": f"{a}{op}{b}=?", "answer": str(a + b if op == "+" else a - b)})
    return records


def load_dataset_records(source: str, split: str = "train", problem_field: str = "problem",
                         answer_field: str = "answer") -> tuple[list[dict], list[str]]:
    """(records, where) from a .jsonl/.json/.parquet file or an HF `datasets` name; every record keeps all its
    columns, and where[i] says where record i is ("line N" of a .jsonl, from 1; see `read_located_records`).

    Raises a UserError naming the line and the missing field when `problem_field`/`answer_field` is absent.
    """
    if Path(source).suffix in RECORD_SUFFIXES or Path(source).is_file():   # a local file of another kind is refused
        located = read_located_records(source)
    else:
        located = [(f"row {i}", row) for i, row in enumerate(read_hub_records(source, split=split), 1)]
    for where, record in located:
        if not isinstance(record, dict):
            raise UserError(f"{source}: {where} is not an object: {record!r:.80}")
        for name, key in (("data.problem_field", problem_field), ("data.answer_field", answer_field)):
            if key not in record:
                raise UserError(f"{source}: {where} has no field {key!r} ({name}); its fields are {sorted(record)}; "
                                f"fix the data or set {name}")
    return [record for _, record in located], [where for where, _ in located]


def through_chat_template(tokenizer, use_chat_template: bool) -> bool:
    """Whether a prompt is rendered through the tokenizer's chat template (asked for, and the tokenizer has one)."""
    return bool(use_chat_template and getattr(tokenizer, "chat_template", None))


def build_prompt(tokenizer, problem: str, template: str = "paper", use_chat_template: bool = True) -> str:
    """The prompt text for `problem`: `template` ("paper", "plain" or a string with {problem}) as one user turn
    through the tokenizer's chat template (with the generation prompt), or the bare text without one."""
    fmt = TEMPLATES.get(template, template)
    if "{problem}" not in fmt:
        raise ValueError(f"data.template must be 'paper', 'plain' or contain '{{problem}}', got {template!r}")
    content = fmt.replace("{problem}", problem.strip())
    if through_chat_template(tokenizer, use_chat_template):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    return content


def encode_prompt(tokenizer, problem: str, template: str = "paper",
                  use_chat_template: bool = True) -> tuple[str, list[int]]:
    """(prompt text of `build_prompt`, its token ids): one encoding for training and evaluation alike. A chat
    template writes the special tokens it wants (a BOS among them) into the text, so that text is tokenized without
    the tokenizer's own; bare text gets them (Llama's or Gemma's BOS), as TRL's `tokenizer(prompt)` and a text
    prompt to vLLM do: a BOS-trained model scored without its BOS sees a prompt it never saw. An EOS that the
    tokenizer appends to bare text (`add_eos_token=True`, kept from SFT) is left out: a prompt ending in EOS asks for
    no response."""
    prompt = build_prompt(tokenizer, problem, template, use_chat_template)
    bare = not through_chat_template(tokenizer, use_chat_template)
    ids = tokenizer(prompt, add_special_tokens=bare)["input_ids"]
    eos = tokenizer.eos_token
    if bare and ids and eos is not None and ids[-1] == tokenizer.eos_token_id and not prompt.endswith(eos):
        ids = ids[:-1]
    return prompt, ids


@dataclass
class PromptSet:
    """Tokenized training prompts; `records[i]` keeps the dataset columns (passed to reward functions)."""
    records: list[dict]
    prompts: list[str]
    prompt_ids: list[list[int]]
    answers: list[str]


def prompt_set_identity(prompt_set: PromptSet) -> dict:
    """What a run trains on, as it uses it: {"prompts": Q, "prompt_ids": sha256 (hex, 32 chars) of the Q prompts'
    token ids in order, "answers": sha256 of their gold answers in order}. From the ids already tokenized (no second
    tokenization): a data file, `data.*` setting, template or tokenizer that changes a prompt, the order or which rows
    are kept (`data.skip_invalid`) changes it."""
    def digest(values: list) -> str:
        return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:32]
    return {"prompts": len(prompt_set.prompt_ids), "prompt_ids": digest(prompt_set.prompt_ids),
            "answers": digest(prompt_set.answers)}


def dataset_rows_digest(prompt_set: PromptSet) -> str:
    """sha256 (hex, 32 chars) of the dataset rows the prompts were built from (`records`, in order), not of the
    prompts: a reference cache records it to tell a changed dataset from a changed way of building prompts."""
    text = json.dumps(prompt_set.records, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def tokenize_prompts(tokenizer, records: list[dict], *, problem_field: str, answer_field: str, template: str,
                     use_chat_template: bool, max_prompt_length: int, skip_invalid: bool,
                     where: list[str] | None = None) -> PromptSet:
    """Render and tokenize every record; its gold answer is read by `erpo.tasks.gold` (`PromptSet.answers`: one
    string each). Empty problems, missing or empty answers, several alternative answers and prompts longer than
    `max_prompt_length` tokens are a UserError listing the first offenders, or dropped with one warning when
    `skip_invalid`. where[i] names record i in messages (default "record i+1")."""
    where = where or [f"record {i}" for i in range(1, len(records) + 1)]
    kept, problems = PromptSet([], [], [], []), []
    for i, record in zip(where, records):
        problem = record.get(problem_field)
        if not isinstance(problem, str) or not problem.strip():
            problems.append(f"{i}: empty or non-text {problem_field!r} ({problem!r:.40})")
            continue
        if record.get(answer_field) is None:
            problems.append(f"{i}: missing {answer_field!r}")
            continue
        try:   # read as `erpo eval` reads a benchmark's answers, so that both grade against the same gold
            answers = gold_answers(record, record[answer_field], answer_field)
        except ValueError as err:
            problems.append(f"{i}: {err}")
            continue
        if len(answers) > 1:
            problems.append(f"{i}: {answer_field!r} holds {len(answers)} alternative answers {answers!r:.60}; the "
                            "math reward compares with one: keep the one to reward")
            continue
        problem = asked_problem(*question_parts(problem, record.get("unit")), template)   # as `erpo eval` asks it
        prompt, ids = encode_prompt(tokenizer, problem, template, use_chat_template)
        if len(ids) > max_prompt_length:
            problems.append(f"{i}: prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}")
            continue
        if len(ids) < 2:
            problems.append(f"{i}: prompt has {len(ids)} token(s); at least 2 are needed for ell(q)")
            continue
        kept.records.append(record)
        kept.prompts.append(prompt)
        kept.prompt_ids.append(ids)
        kept.answers.append(answers[0])
    if problems:
        summary = "; ".join(problems[:5]) + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
        if not skip_invalid:
            raise UserError(f"{len(problems)} invalid training record(s): {summary}. Fix the data or set "
                             "data.skip_invalid=true to drop them.")
        warnings.warn(f"dropped {len(problems)} invalid training record(s): {summary}")
    if not kept.prompts:
        raise UserError("no valid training prompts left; check data.source and data.max_prompt_length")
    return kept


def load_prompt_set(cfg, tokenizer) -> PromptSet:
    """The training prompts of a Config (`cfg.data`): records from the source, rendered and tokenized."""
    d = cfg.data
    if d.source == "arithmetic":
        records = arithmetic_dataset(d.num_examples or 1000, seed=cfg.trainer.seed,
                                     max_operand=d.arithmetic_max_operand)
        where = None
        problem_field, answer_field = "problem", "answer"
    else:
        records, where = load_dataset_records(d.source, d.split, d.problem_field, d.answer_field)
        if d.num_examples is not None:
            records, where = records[:d.num_examples], where[:d.num_examples]
        where = [f"{d.source} {w}" for w in where]
        problem_field, answer_field = d.problem_field, d.answer_field
    return tokenize_prompts(tokenizer, records, problem_field=problem_field, answer_field=answer_field,
                            template=d.template, use_chat_template=d.use_chat_template,
                            max_prompt_length=d.max_prompt_length, skip_invalid=d.skip_invalid, where=where)
