"""Evaluation benchmarks: problems with gold answers from local files, the Hub, or a built-in set.

A benchmark spec (CLI ``--benchmarks a,b,...``, or ``load_benchmark(spec)``) is::

    [NAME=]SOURCE[#key=value#key=value...]

SOURCE is one of
- ``synthetic``: the built-in offline arithmetic benchmark (``erpo.tasks.data.arithmetic_dataset``, operands
  up to the trainer's default ``data.arithmetic_max_operand``, seed 1234), the default when no benchmark is
  named. With small operands it overlaps the tiny default's training problems: it checks that the pipeline
  and the model work, it is not a held-out test;
- ``heldout``: built-in arithmetic problems the tiny default's training never samples (``held_out_benchmark``):
  the same "a+b" / "a-b" form with operands up to ``max_operand`` (default twice ``larger_than``) and the larger
  operand above ``larger_than`` (default: the trainer's default ``data.arithmetic_max_operand``), seed 1234.
  A run trained with a larger ``data.arithmetic_max_operand`` M needs ``#larger_than=M``;
- a local ``.jsonl`` / ``.json`` / ``.parquet`` file in a common public format (MATH500, AIME24,
  AIME25, AMC, Minerva, OlympiadBench, verl-style ``prompt``/``reward_model``);
- a short name (``math500``, ``aime24``, ``aime25``, ``amc``, ``minerva``, ``olympiadbench``) resolved
  to a public Hub dataset, or any Hub dataset name ``owner/name`` (needs ``pip install datasets`` and
  network access).

Options after ``#``: ``problem=FIELD``, ``answer=FIELD`` (dotted paths reach nested fields, e.g.
``answer=reward_model.ground_truth``), ``split=``, ``config=`` (Hub only), ``limit=N``, ``n=N`` and
``seed=S``, ``max_operand=M`` (synthetic and heldout),
``larger_than=T`` (heldout only). Without ``problem``/``answer`` the fields are detected from the common formats
(see ``PROBLEM_FIELDS`` / ``ANSWER_FIELDS``).

Gold answers are a list of alternatives, any of which counts as correct, read by ``erpo.tasks.gold`` (as
training reads its answer column). A problem is asked as training asks it (``erpo.tasks.data.question_parts`` and
``asked_problem``): OlympiadBench rows with a ``unit`` get a sentence naming the unit after the problem (the gold
answer is the bare value, as OlympiadBench's own prompt asks for it); problem texts that already end with a known
instruction (the paper's suffix, as in the official ERPO files; verl's and Qwen2.5-Math's \\boxed{} instructions,
as in verl-style parquet prompts) are stored without it, and the instruction beside them (``instruction``): a
template that brings its own (paper, qwen-math) is filled with the problem alone, one that brings none (plain) with
the problem and its instruction (``problem_as_asked``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

from erpo.config import DataConfig
from erpo.records import RECORD_SUFFIXES, read_hub_records, read_records
from erpo.tasks.data import arithmetic_dataset, asked_problem, question_parts
from erpo.tasks.gold import gold_answers

# Candidate fields, first present wins. "solution" is last: its answer is the last \boxed{...}.
PROBLEM_FIELDS = ("problem", "question", "Problem", "Question", "prompt", "input")
ANSWER_FIELDS = (
    "answer", "final_answer", "Answer", "expected_answer", "ground_truth", "reward_model.ground_truth",
    "target", "solution",
)

# Short names of the paper's six benchmarks -> (Hub dataset, config, split).
HUB_BENCHMARKS = {
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "aime25": ("math-ai/aime25", None, "test"),
    "amc": ("AI-MO/aimo-validation-amc", None, "train"),
    "minerva": ("math-ai/minervamath", None, "test"),
    "olympiadbench": ("math-ai/olympiadbench", None, "test"),
}

SYNTHETIC_SIZE = 64
SYNTHETIC_SEED = 1234
_OPTION_KEYS = {"problem", "answer", "split", "config", "limit", "n", "seed", "max_operand", "larger_than"}


@dataclass
class Benchmark:
    """A named list of problems; each problem is ``{"id": int, "problem": str, "answers": list[str]}`` (gold answer
    alternatives, any of which is correct), and ``"instruction": str`` where one was removed from the problem (with
    the white space before it)."""

    name: str
    source: str
    problems: list[dict] = field(default_factory=list)


def parse_benchmark_spec(spec: str) -> tuple[str, str, dict]:
    """Split ``[NAME=]SOURCE[#key=value...]`` into (name, source, options: dict[str, str])."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"benchmark spec must be a non-empty string, got {spec!r}")
    body, *opts = spec.strip().split("#")
    options = {}
    for item in filter(None, (part.strip() for part in opts)):
        key, eq, value = item.partition("=")
        if not eq or key not in _OPTION_KEYS:
            raise ValueError(
                f"benchmark spec {spec!r}: bad option {item!r}; expected key=value with key in {sorted(_OPTION_KEYS)}"
            )
        options[key] = value
    name, eq, source = body.partition("=")
    if not eq:
        source = body
        name = _default_name(source)
    if not name or not source:
        raise ValueError(f"benchmark spec {spec!r}: empty name or source")
    return name, source, options


def _default_name(source: str) -> str:
    base = os.path.basename(source.rstrip("/"))
    for ext in RECORD_SUFFIXES:
        if base.endswith(ext):
            return base[: -len(ext)]
    return base


def _get_field(record: dict, dotted: str):
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _problem_text(value, fieldname: str) -> str:
    """The problem as text (a chat list: its last user message)."""
    if isinstance(value, list):  # chat format: the last user message
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if not users or not isinstance(users[-1], str):
            raise ValueError(f"field {fieldname!r} is a list without a user message with string content")
        value = users[-1]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {fieldname!r} must be a non-empty string, got {value!r}")
    return value


def problem_as_asked(problem: dict, template: str) -> str:
    """The text of `problem` (a Benchmark problem) that `template` is filled with: without the instruction its file
    held where the template brings its own, with it otherwise (a run trained on such prompts with `plain` read it
    there): one instruction either way."""
    return asked_problem(problem["problem"], problem.get("instruction", ""), template)


def _detect(record: dict, candidates: tuple[str, ...], what: str, source: str) -> str:
    for name in candidates:
        if _get_field(record, name) is not None:
            return name
    raise ValueError(
        f"{source}: cannot find the {what} field among {list(candidates)}; keys are {sorted(record)}. "
        f"Name it with '#{what}=FIELD' in the benchmark spec."
    )


def records_to_problems(
    records: list[dict], source: str, problem_field: str | None = None, answer_field: str | None = None
) -> list[dict]:
    """Map raw rows to ``{"id", "problem", "answers"}`` using the given or detected field names."""
    if not records:
        raise ValueError(f"{source}: holds no records")
    problem_field = problem_field or _detect(records[0], PROBLEM_FIELDS, "problem", source)
    answer_field = answer_field or _detect(records[0], ANSWER_FIELDS, "answer", source)
    problems, with_system = [], 0
    for index, record in enumerate(records):
        value = _get_field(record, problem_field)
        with_system += isinstance(value, list) and any(isinstance(m, dict) and m.get("role") == "system" for m in value)
        try:
            problem, instruction = question_parts(_problem_text(value, problem_field), record.get("unit"))
            answers = gold_answers(record, _get_field(record, answer_field), answer_field)
        except ValueError as err:
            raise ValueError(f"{source}: record {index}: {err}") from err
        problems.append({"id": index, "problem": problem, "answers": answers,
                         **({"instruction": instruction} if instruction else {})})
    if with_system:   # erpo's templates ask the problem as one user turn (as training does); say what is lost
        warnings.warn(f"{source}: {with_system} of {len(records)} chat prompts hold a system message, which is left "
                      "out: the model is asked the last user message through its template (--template)",
                      stacklevel=2)
    return problems


def synthetic_benchmark(n: int = SYNTHETIC_SIZE, seed: int = SYNTHETIC_SEED,
                        max_operand: int | None = None) -> Benchmark:
    """The built-in offline benchmark: n arithmetic problems from ``erpo.tasks.data.arithmetic_dataset`` with
    operands in [0, max_operand] (default: the trainer's default ``data.arithmetic_max_operand``)."""

    if max_operand is None:
        max_operand = DataConfig().arithmetic_max_operand
    records = arithmetic_dataset(n, seed, max_operand=max_operand)
    return Benchmark("synthetic", f"synthetic#n={n}#seed={seed}#max_operand={max_operand}",
                     records_to_problems(records, "synthetic"))


def held_out_benchmark(n: int = SYNTHETIC_SIZE, seed: int = SYNTHETIC_SEED, larger_than: int | None = None,
                       max_operand: int | None = None) -> Benchmark:
    """n arithmetic problems disjoint from every training problem of ``data.arithmetic_max_operand=larger_than``:
    operands in [0, max_operand] with the larger one above ``larger_than`` (default: the trainer's default
    ``data.arithmetic_max_operand``; ``max_operand`` defaults to twice it). Same form and answer check as the
    training problems, so a skill the model had at theta0 beyond its training range can be seen forgotten."""
    if larger_than is None:
        larger_than = DataConfig().arithmetic_max_operand
    if max_operand is None:
        max_operand = 2 * larger_than
    if max_operand <= larger_than:
        raise ValueError(f"heldout: max_operand ({max_operand}) must be above larger_than ({larger_than}); "
                         "raise #max_operand=")
    records = arithmetic_dataset(n, seed, max_operand=max_operand, larger_than=larger_than)
    return Benchmark("heldout", f"heldout#n={n}#seed={seed}#larger_than={larger_than}#max_operand={max_operand}",
                     records_to_problems(records, "heldout"))


def _int_option(options: dict, key: str, spec: str) -> int | None:
    if key not in options:
        return None
    try:
        value = int(options[key])
    except ValueError as err:
        raise ValueError(f"benchmark spec {spec!r}: {key} must be an int, got {options[key]!r}") from err
    lowest = 0 if key in ("seed", "max_operand", "larger_than") else 1
    if value < lowest:
        raise ValueError(f"benchmark spec {spec!r}: {key} must be >= {lowest}, got {value}")
    return value


def load_benchmark(spec: str) -> Benchmark:
    """Load one benchmark from a spec (module docstring). Raises ValueError on a bad spec or file."""
    name, source, options = parse_benchmark_spec(spec)
    limit = _int_option(options, "limit", spec)
    if "larger_than" in options and source != "heldout":
        raise ValueError(f"benchmark spec {spec!r}: larger_than applies to the heldout set only")
    if source in ("synthetic", "arithmetic", "heldout"):
        n = _int_option(options, "n", spec) or SYNTHETIC_SIZE
        seed = _int_option(options, "seed", spec)
        seed = SYNTHETIC_SEED if seed is None else seed
        max_operand = _int_option(options, "max_operand", spec)
        if source == "heldout":
            bench = held_out_benchmark(n, seed, _int_option(options, "larger_than", spec), max_operand)
        else:
            bench = synthetic_benchmark(n, seed, max_operand)
        bench.name = name
    else:
        if os.path.exists(source) or source.endswith(RECORD_SUFFIXES):
            records = read_records(source)
        elif source.lower() in HUB_BENCHMARKS:
            hub_name, config, split = HUB_BENCHMARKS[source.lower()]
            records = read_hub_records(hub_name, config=options.get("config", config),
                                       split=options.get("split", split))
        elif "/" in source:
            records = read_hub_records(source, config=options.get("config"), split=options.get("split", "test"))
        else:
            raise ValueError(
                f"benchmark {source!r} is not a file, not 'synthetic' or 'heldout', not one of "
                f"{sorted(HUB_BENCHMARKS)} and not a Hub dataset name owner/name"
            )
        problems = records_to_problems(records, source, options.get("problem"), options.get("answer"))
        bench = Benchmark(name, source, problems)
    if limit is not None:
        bench.problems = bench.problems[:limit]
    return bench


def load_benchmarks(specs: list[str] | None) -> list[Benchmark]:
    """Load several benchmarks (default: the built-in synthetic one); names must be unique."""
    benches = [load_benchmark(spec) for spec in (specs or ["synthetic"])]
    names = [b.name for b in benches]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark names must be unique, got {names}; rename with NAME=SOURCE")
    return benches
