"""Gold answers of a dataset row, read one way for training (`erpo.tasks.data`) and evaluation
(`erpo.eval.problem_sets`): a list of alternatives, any of which is correct.

- a list holds alternatives (Minerva in Dr.GRPO's evaluation suite), except where the row says
  ``is_multiple_answer: true`` (OlympiadBench), whose list is the parts of one answer, joined with ", ";
- a string that is a Python list of strings (the official ERPO JSONL files' ``ground_truth``, e.g.
  ``"['9.6\\n', '9.7']"``) is read as that list;
- a number is printed as an int when integral (AMC's ``25.0``), a float otherwise by its digits (``1.5e-05`` is
  ``0.000015``), and must be finite; surrounding ``$`` are removed; a field named ``solution`` gives the last
  \\boxed{} of that solution.
"""
from __future__ import annotations

import ast
import math
from decimal import Decimal

from erpo.tasks.rewards import extract_boxed


def answer_text(value, fieldname: str) -> str:
    """One gold answer as a string: ints/integral floats printed as ints, other floats by their digits, surrounding
    ``$`` removed, last \\boxed{} of a full solution taken. ValueError naming `fieldname` when it is no such answer."""
    if isinstance(value, bool) or value is None or isinstance(value, list):
        raise ValueError(f"field {fieldname!r} must be a string or a number, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"field {fieldname!r} must be a finite number, got {value!r}")
        # str() writes a float below 1e-4 as 1.5e-05, which math-verify parses as 1.5 (inside $...$, as 1.5 e - 5,
        # Euler's e): the digits of its shortest repr, positionally, are the number the dataset holds
        value = int(value) if value.is_integer() else format(Decimal(repr(value)), "f")
    text = str(value).strip()
    if fieldname.split(".")[-1] == "solution":
        boxed = extract_boxed(text)
        if boxed is None:
            raise ValueError(f"field {fieldname!r} holds a solution without \\boxed{{...}}")
        text = boxed.strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    if not text:
        raise ValueError(f"field {fieldname!r} is empty")
    return text


def _string_list_literal(value) -> list[str] | None:
    """The list a string like "['2', '3\\n']" spells (a Python list of strings), else None."""
    if not (isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]")):
        return None
    try:
        parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return None
    return parsed if isinstance(parsed, list) and parsed and all(isinstance(v, str) for v in parsed) else None


def gold_answers(record: dict, value, fieldname: str) -> list[str]:
    """Gold answer alternatives of one row (module docstring), `value` being its `fieldname` field: a list or a
    Python-list string gives several, unless the row says is_multiple_answer (one answer of several parts, joined
    with ", "). ValueError naming `fieldname` when it holds no answer."""
    if not isinstance(value, list):
        value = _string_list_literal(value) or value
    if not isinstance(value, list):
        return [answer_text(value, fieldname)]
    if not value:
        raise ValueError(f"field {fieldname!r} is an empty list")
    parts = [answer_text(v, fieldname) for v in value]
    if record.get("is_multiple_answer") is True:
        return [", ".join(parts)]
    return list(dict.fromkeys(parts))
