"""Rewards: math answer verification, a <think> format reward, custom TRL-style reward functions.

Every reward function has the TRL signature `fn(prompts, completions, **dataset_columns) -> list[float | None]`
(None: the function does not apply to that sample), called by keyword as TRL's GRPOTrainer calls it.
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from erpo.errors import MissingInputError, UserError
from erpo.tasks.answer_worker import TEXT_COMMANDS
from erpo.tasks.trainer_progress import TrainerProgress

RewardFn = Callable[..., list]


# \boxed or \fbox (MATH's solutions box some answers with \fbox, which lm-eval's hendrycks_math reads too), then an
# opening brace, or else the next word: `\boxed 5` boxes "5" in LaTeX, and verl's last_boxed_only_string and
# math-verify both read it so.
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*(?:(\{)|([^\s${}]+))?")


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, nested braces allowed, or the word after a
    \\boxed without braces (`\\boxed 5`); None if there is none or the last one is not closed (a completion cut
    inside its final answer has no answer, whatever an earlier box held)."""
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    last = boxes[-1]
    if last.group(1) is None:
        return last.group(2)   # a word, or None: a \\boxed followed by neither (cut right after it)
    start = last.end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


ANSWER_TIMEOUT_S = 5.0          # wall-clock seconds math-verify may spend on one answer; past it the answer is wrong
WORKER_START_TIMEOUT_S = 300.0  # importing sympy and math-verify in the checking process, on a loaded machine
log = logging.getLogger("erpo")


class AnswerChecker:
    """math-verify in one child process (`erpo.tasks.answer_worker`), one answer at a time, each bounded to
    `timeout_s` seconds of wall-clock time: an answer that takes longer (a huge or deeply nested expression) counts
    as wrong, and the process is killed and started again on the next answer; one it raises on counts as wrong. Both
    are logged with the answer. Works from any thread (a lock
    serializes them) and after a fork (the forked process starts its own)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner = 0                      # the pid that started `_proc`
        self._pending = b""                  # bytes read from the process after the last full line
        self.import_error: str | None = None  # set when math-verify cannot be imported (then never retried)
        self.version: str | None = None       # math-verify's version, as the process reported it

    def match(self, pred: str, gold: str, timeout_s: float) -> bool | None:
        """math-verify's verdict on `pred` against `gold`; None when math-verify cannot be imported."""
        with self._lock:
            if self.import_error is not None or not self._running():
                return None
            request = (json.dumps([pred, gold]) + "\n").encode()
            try:
                self._proc.stdin.write(request)
                self._proc.stdin.flush()
                reply = self._read_line(timeout_s)
            except BrokenPipeError:
                reply = None
            if reply is None:
                state = "did not answer" if self._proc.poll() is None else f"exited ({self._proc.returncode})"
                log.warning("math answer check: math-verify %s within %g s on the answer %r; counted as wrong",
                            state, timeout_s, pred[:200])
                self.close()
                return False
            if isinstance(reply, dict):
                log.warning("math answer check: math-verify raised %s on the answer %r; counted as wrong",
                            reply["error"], pred[:200])
                return False
            return bool(reply)

    def math_verify_version(self) -> str | None:
        """The version of the math-verify that judges answers; None when it cannot be imported."""
        with self._lock:
            return self.version if self.import_error is None and self._running() else None

    def _running(self) -> bool:
        """Start the process when there is none (or it was started by the process this one was forked from);
        False when math-verify cannot be imported there."""
        if self._proc is not None and self._owner == os.getpid():
            return True
        self._proc, self._owner, self._pending = None, os.getpid(), b""
        package_root = str(Path(__file__).resolve().parent.parent)   # where `erpo` imports from, for the child
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen([sys.executable, "-m", "erpo.tasks.answer_worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env)
        ready = self._read_line(WORKER_START_TIMEOUT_S)
        if not isinstance(ready, dict) or "ready" not in ready:
            self.close()
            if isinstance(ready, dict) and "import_error" in ready:
                self.import_error = ready["import_error"]
                return False
            raise RuntimeError("math answer check: the math-verify process "
                               f"({sys.executable} -m erpo.tasks.answer_worker)"
                               f" did not start within {WORKER_START_TIMEOUT_S:g} s; run it by hand to see why")
        self.version = ready["ready"]
        return True

    def _read_line(self, timeout_s: float):
        """The next JSON line from the process, or None when it is not complete within `timeout_s` (or it exited)."""
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        """Kill the process (the next answer starts a new one)."""
        if self._proc is not None and self._owner == os.getpid():
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                try:
                    pipe.close()
                except BrokenPipeError:   # a request still buffered for a process that died: no one to read it
                    pass
        self._proc = None


_checker = AnswerChecker()
atexit.register(_checker.close)
_warned_fallback = False


# erpo's own rules of judging an answer (`extract_boxed`, `collapse_nested_text`, `fallback_match`): bump it with any
# change that judges some answer otherwise, so that `erpo eval` grades again the samples it cached under the old ones.
GRADING_RULES = 2


def grader_identity() -> str:
    """What judges answers in this process: erpo's GRADING_RULES and math-verify's version, or the fallback where
    math-verify cannot be imported (`answers_match`); e.g. "erpo-rules-2 math-verify-0.9.0"."""
    version = _checker.math_verify_version()
    return f"erpo-rules-{GRADING_RULES} " + (f"math-verify-{version}" if version else "fallback_match")


def answers_match(pred: str | None, gold: str, *, timeout_s: float = ANSWER_TIMEOUT_S) -> bool:
    """True when `pred` equals the reference answer `gold`, judged by math-verify (`AnswerChecker`: within
    `timeout_s` seconds, else False). Where math-verify cannot be imported, by `fallback_match`, with one loud
    warning per process."""
    global _warned_fallback
    if pred is None:
        return False
    verdict = _checker.match(pred, gold, timeout_s)
    if verdict is not None:
        return verdict
    if not _warned_fallback:
        _warned_fallback = True
        log.warning("!" * 100 + "\nmath answer check: math-verify cannot be imported (%s), so answers are compared "
                    "by erpo.tasks.rewards.fallback_match instead. It misjudges equal answers written differently: "
                    "2\\sqrt{2} vs \\sqrt{8}, 2^{10} vs 1024, \\frac{\\pi}{2} vs \\pi/2, \\{1,2\\} vs \\{2,1\\}, "
                    "x \\in [1,3] vs [1,3], (x+1)^2 vs x^2+2x+1 all count as wrong, so rewards and evaluation "
                    "scores are too low. Install it: pip install math-verify==0.9.0\n" + "!" * 100,
                    _checker.import_error)
    return fallback_match(pred, gold)


# Used only where math-verify cannot be imported (`answers_match`): string rules for the common forms.
# Escaped forms come before their bare characters: removing "$" first would turn "\$5" into "\5".
_REMOVE = [r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\quad", r"\qquad", "^\\circ", "^{\\circ}",
           r"\displaystyle", r"\%", "%", r"\$", "$"]


_TEXT_WRAPPER = re.compile(r"\\(?:%s)\{([^{}]*)\}" % "|".join(TEXT_COMMANDS))


def _strip_text_units(s: str) -> str:
    """Unwrap \\text{...}-like commands, innermost first, so nested ones (\\text{\\textbf{A}}) unwrap fully."""
    while True:
        s, count = _TEXT_WRAPPER.subn(r"\1", s)
        if not count:
            return s


def normalize_answer(s: str) -> str:
    """Canonical string for comparing final answers (`fallback_match`): strips spaces, $, \\left/\\right, \\text{},
    trailing '.', `x =` prefixes, thousands separators; \\dfrac/\\tfrac -> \\frac, \\frac12 -> \\frac{1}{2},
    a/b -> \\frac{a}{b} for integers, 0.50 -> 0.5, 2.0 -> 2."""
    s = str(s).strip()
    s = _strip_text_units(s)
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    s = re.sub(r"^[a-zA-Z]\w*=", "", s)                       # "x=5" -> "5"
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)        # \frac12
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    m = re.fullmatch(r"-\\frac\{(\d+)\}\{(\d+)\}", s)
    if m:
        s = f"\\frac{{-{m.group(1)}}}{{{m.group(2)}}}"
    if re.fullmatch(r"-?\d+\.\d*", s):  # a digit before the point: stripping never leaves ""
        s = s.rstrip("0").rstrip(".")
        if s == "-0":
            s = "0"
    return s


def _as_number(s: str) -> float | None:
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", s)
    if m and int(m.group(2)) != 0:
        return int(m.group(1)) / int(m.group(2))
    try:
        return float(s)
    except ValueError:
        return None


def fallback_match(pred: str, gold: str) -> bool:
    """Normalized string equality or equal numeric value (fractions and decimals within 1e-9): the answer check
    where math-verify cannot be imported."""
    a, b = normalize_answer(pred), normalize_answer(gold)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def grade(completion: str, gold: str) -> tuple[str | None, bool]:
    """(answer extracted from the last \\boxed{} of `completion` or None, whether it matches `gold`)."""
    pred = extract_boxed(completion)
    return pred, answers_match(pred, gold)


def math_reward(prompts: list[str], completions: list[str], answer: list[str], **kwargs) -> list[float | None]:
    """1.0 when the last \\boxed{} of the completion matches `answer`, else 0.0 (TRL signature)."""
    if len(answer) != len(completions):
        raise ValueError(f"answer has {len(answer)} entries for {len(completions)} completions")
    return [1.0 if grade(c, str(a))[1] else 0.0 for c, a in zip(completions, answer)]


_THINK_FORMAT = re.compile(r"^\s*<think>.*?</think>.*\\boxed\{.*\}.*$", re.DOTALL)


def format_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]:
    """1.0 when the completion is `<think>...</think>` followed by an answer containing \\boxed{...}, else 0.0."""
    return [1.0 if _THINK_FORMAT.match(c) else 0.0 for c in completions]


BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward, "format": format_reward}


def load_reward_function(spec: str) -> RewardFn:
    """A built-in name ("math", "format") or "path/to/file.py:function_name" loaded from that file; a name that is
    neither, a missing file or function is a UserError (one line on the command line)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise UserError(f"reward function {spec!r}: expected 'math', 'format' or 'path/to/file.py:function_name' "
                        "(reward.functions)")
    path_str, name = spec.rsplit(":", 1)
    path = Path(path_str)
    if not path.is_file():
        raise MissingInputError(f"reward function {spec!r}: no such file {path_str}; check the path (reward.functions)")
    module_spec = importlib.util.spec_from_file_location(f"erpo_user_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"reward function {spec!r}: {path_str} has no callable named {name!r}; check the name "
                        "(reward.functions)")
    return fn


def _call_checked(fn: RewardFn, prompts: list[str], completions: list[str], columns: dict,
                  trainer_state: TrainerProgress) -> list:
    """Call `fn` on the batch by keyword (TRL's call: `completions` may be its first parameter); on an exception,
    find the first sample that raises alone and name it."""
    name = getattr(fn, "__name__", repr(fn))

    def call(rows: slice) -> list:
        return fn(prompts=prompts[rows], completions=completions[rows], **{k: v[rows] for k, v in columns.items()},
                  trainer_state=trainer_state)
    try:
        values = call(slice(None))
    except Exception as batch_exc:
        for i in range(len(completions)):
            try:
                call(slice(i, i + 1))
            except Exception as exc:
                raise RuntimeError(f"reward function {name!r} raised on sample {i} (prompt {prompts[i]!r:.120}, "
                                   f"completion {completions[i]!r:.120}): {exc!r}") from exc
        raise RuntimeError(f"reward function {name!r} raised on the batch of {len(completions)} samples but on "
                           f"no single sample: {batch_exc!r}") from batch_exc
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        raise ValueError(f"reward function {name!r} must return a list of {len(completions)} values, got "
                         f"{type(values).__name__} of length {len(values) if hasattr(values, '__len__') else '?'}")
    for i, v in enumerate(values):
        if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ValueError(f"reward function {name!r} returned {v!r} for sample {i} (prompt {prompts[i]!r:.120}); "
                             "expected a finite number or None")
    return list(values)


def compute_rewards(fns: list[RewardFn], weights: list[float] | None, prompts: list[str], completions: list[str],
                    columns: dict, *, trainer_state: TrainerProgress
                    ) -> tuple[list[float], dict[str, list[float | None]]]:
    """Weighted sum over reward functions per sample (None entries contribute nothing, as TRL's nansum), and the
    per-function values, unweighted, keyed by function name in the order of `fns` (a repeated name gets its
    position appended: `reward_1`).

    Each function gets TRL's keywords: `prompts`, `completions`, the dataset's `columns` (lists, one entry per
    sample) and `trainer_state`. A sample where every function returns None is unscorable: its total is NaN, with
    a warning naming the first one, as TRL 1.16's GRPOTrainer (which then leaves it out of the group's mean and
    std, gives it advantage 0 and leaves it out of the reward metrics: `erpo.train.advantages`). Dataset columns
    named `prompts`, `completions` or `trainer_state` are not passed on: those names are the call's own."""
    columns = {k: v for k, v in columns.items() if k not in ("prompts", "completions", "trainer_state")}
    weights = weights or [1.0] * len(fns)
    if len(weights) != len(fns):
        raise ValueError(f"weights has {len(weights)} entries for {len(fns)} reward functions")
    values = [_call_checked(fn, prompts, completions, columns, trainer_state) for fn in fns]
    per_fn = {}
    for k, (fn, fn_values) in enumerate(zip(fns, values)):
        name = getattr(fn, "__name__", f"reward_{k}")
        per_fn[name if name not in per_fn else f"{name}_{k}"] = fn_values  # two files may both define `reward`
    totals, unscorable = [], []
    for i in range(len(completions)):
        vals = [(w, v[i]) for w, v in zip(weights, values) if v[i] is not None]
        totals.append(sum(w * v for w, v in vals) if vals else math.nan)
        if not vals:
            unscorable.append(i)
    if unscorable:
        first = unscorable[0]
        log.warning("every reward function returned None for %d of %d samples, first sample %d (prompt %.120r, "
                    "completion %.120r): no reward, advantage 0, left out of the reward metrics (as TRL's "
                    "GRPOTrainer); make at least one reward function return a number for every sample",
                    len(unscorable), len(totals), first, prompts[first], completions[first])
    return totals, per_fn
