"""What users copy from the docs names what exists: every `erpo SUBCOMMAND ...` line in README.md, docs/*.md and
bench/README.md (code blocks and inline code; `python -m erpo`, torchrun's `-m erpo` and DeepSpeed's `--module erpo`
too) uses options its subcommand's parser knows, with no word the parser would refuse, and every `--set key=value`
names a config key; every signature docs/API.md lists names the parameters its function has. Cheap: nothing runs."""
import dataclasses
import inspect
import re
import shlex
from pathlib import Path

import erpo_kernels
from erpo.cli.commands import build_parser
from erpo.config import RENAMED_KEYS, Config
from erpo_kernels import LossOptions

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
SHELL_BLOCKS = ("", "bash", "sh", "console")
ELIDED = re.compile(r"^\.\.\.|^\(|\)$")   # `...` and a parenthesized aside stand for what a line leaves out


def doc_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command text) of `text`: each shell code block's lines (a `\\` continuation joined, `# comment`
    dropped) and each inline code span elsewhere."""
    found, block, pending = [], None, None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
            continue
        if block is None:
            found += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
        elif block in SHELL_BLOCKS:
            line = re.sub(r"(?:^|\s)#.*$", "", line).rstrip()
            start, joined = pending or (number, "")
            if line.endswith("\\"):
                pending = (start, joined + line[:-1] + " ")
            else:
                pending = None
                found.append((start, joined + line))
    return found


def erpo_argvs(command: str) -> list[list[str]]:
    """The arguments after `erpo` of each erpo invocation in a shell line (`erpo ...`, `python -m erpo ...`, a
    launcher's `-m erpo` / `--module erpo`)."""
    argvs = []
    for part in re.split(r"&&|;|\|", command):
        try:
            words = [word.strip("[]") for word in shlex.split(part)]
        except ValueError:   # an unbalanced quote: prose, not a command
            continue
        for i, word in enumerate(words):
            launched = i > 0 and words[i - 1] in ("-m", "--module")
            if word == "erpo" and (launched or i == 0 or re.fullmatch(r"\w+=\S*|nice|nohup|-n|\d+", words[i - 1])):
                argvs.append(words[i + 1:])
                break
    return argvs


CONFIG_KEYS = set(RENAMED_KEYS)


def _collect_keys(section, prefix: str = "") -> None:
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if dataclasses.is_dataclass(value):
            _collect_keys(value, f"{prefix}{field.name}.")
        else:
            CONFIG_KEYS.add(prefix + field.name)


_collect_keys(Config())


def argv_problems(parser, argv: list[str]) -> list[str]:
    """What `erpo ARGV` as a doc writes it gets wrong: an unknown subcommand or option, a word no option takes where
    the subcommand has no positional argument, a `--set` key that is not a config key. Placeholders (N, DIR) pass:
    only names are checked. An error message quoted in the docs (`erpo train: error: ...`) is no command."""
    if not argv or argv[0].endswith(":") or argv[0].isupper() or ELIDED.search(argv[0]) or argv[0] == "--help":
        return []
    if argv[0] not in parser.commands:
        return [f"no subcommand {argv[0]!r}"]
    command = parser.commands[argv[0]]
    takes_positionals = any(not action.option_strings for action in command._actions)
    problems, i, words = [], 1, argv
    while i < len(words):
        word = words[i]
        i += 1
        if ELIDED.search(word):
            continue
        if not word.startswith("-") or re.fullmatch(r"-[\d.]+", word):
            if not takes_positionals:
                problems.append(f"stray word {word!r} (erpo {argv[0]} takes no positional argument)")
            continue
        flag, has_value, _ = word.partition("=")
        action = command._option_string_actions.get(flag)
        if action is None:   # its values, whatever its arity, are no stray words
            problems.append(f"unknown option {flag}")
            while i < len(words) and not words[i].startswith("-"):
                i += 1
            continue
        if has_value or action.nargs == 0:
            continue
        values = []
        while i < len(words) and not words[i].startswith("-") and (action.nargs in ("+", "*") or not values):
            values.append(words[i])
            i += 1
        if flag == "--set":
            keys = [value.split("=")[0] for value in values if re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+=.*", value)]
            problems += [f"unknown config key {key}" for key in keys if key not in CONFIG_KEYS]
    return problems


def doc_erpo_problems(path: Path, text: str) -> list[str]:
    parser = build_parser()
    return [f"{path.name}:{number}: {problem}: {command.strip()}"
            for number, command in doc_lines(text) for argv in erpo_argvs(command)
            for problem in argv_problems(parser, argv)]


def test_the_checker_finds_an_unknown_option_a_stray_word_and_an_unknown_key():
    """The checks below can fail: each broken line is caught, and its correct twin is not."""
    good = ("```bash\nerpo train --max-steps 8 --set trainer.lr=1e-3 \\\n    logging.tensorboard=false   # 8 steps\n"
            "erpo eval --model RUN_DIR@all --k 8\n```\nthen `python -m erpo plot runs/a runs/b -o out.png`.\n")
    assert doc_erpo_problems(Path("good.md"), good) == []
    bad = ("```bash\nerpo train --max-step 8 --set trainer.lr=1e-3 \\\n    logging.tensorboards=false\n"
           "erpo eval RUN_DIR@all --k 8\n```\nthen `torchrun --nproc_per_node 2 -m erpo trian`.\n")
    assert doc_erpo_problems(Path("bad.md"), bad) == [
        "bad.md:2: unknown option --max-step: erpo train --max-step 8 --set trainer.lr=1e-3      "
        "logging.tensorboards=false",
        "bad.md:2: unknown config key logging.tensorboards: erpo train --max-step 8 --set trainer.lr=1e-3      "
        "logging.tensorboards=false",
        "bad.md:4: stray word 'RUN_DIR@all' (erpo eval takes no positional argument): erpo eval RUN_DIR@all --k 8",
        "bad.md:6: no subcommand 'trian': torchrun --nproc_per_node 2 -m erpo trian"]


def test_every_erpo_command_in_the_docs_is_one_the_parser_takes():
    problems = [problem for path in DOCS for problem in doc_erpo_problems(path, path.read_text())]
    assert not problems, "\n".join(problems)


def test_the_docs_hold_erpo_commands_of_every_subcommand():
    """The check above sees the commands (a change to how the docs are written must not make it pass on nothing)."""
    seen = {argv[0] for path in DOCS for _, command in doc_lines(path.read_text()) for argv in erpo_argvs(command)
            if argv}
    assert set(build_parser().commands) <= seen


API_SIGNATURE = re.compile(r"^(\w+)\((.*?)\)(?: -> .*)?$", flags=re.S | re.M)


def api_signatures() -> list[tuple[str, list[str]]]:
    """(function name, parameter names) of each signature in docs/API.md's python blocks that lists them (a line
    `name(a, b, *, c=1, **options) -> T`, continued over the following indented lines)."""
    text = (REPO / "docs" / "API.md").read_text()
    found = []
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        statements = re.split(r"\n(?=\S)", block)
        for statement in statements:
            match = API_SIGNATURE.match(statement.split("\n#")[0].strip())
            if match and hasattr(erpo_kernels, match.group(1)):
                names = [re.split(r"[=:]", part)[0].strip() for part in match.group(2).split(",")]
                found.append((match.group(1), [name for name in names if name and name != "*"]))
    return found


def test_api_signatures_name_the_parameters_the_functions_have():
    """docs/API.md's signature of each erpo_kernels function names its parameters, `**options` standing for the loss
    options (LossOptions) and only where the function takes them."""
    signatures = api_signatures()
    assert {"token_logprobs", "erpo_loss", "fused_linear_erpo_loss", "padded_erpo_loss", "logprob_erpo_loss"} <= \
        {name for name, _ in signatures}
    options = {field.name for field in dataclasses.fields(LossOptions)}
    for name, documented in signatures:
        actual = list(inspect.signature(getattr(erpo_kernels, name)).parameters)
        if "**options" in documented:
            documented = [p for p in documented if p != "**options"] + [p for p in actual if p in options]
        assert sorted(documented) == sorted(actual), \
            f"docs/API.md's {name}: missing {sorted(set(actual) - set(documented))}, " \
            f"not a parameter {sorted(set(documented) - set(actual))}"
