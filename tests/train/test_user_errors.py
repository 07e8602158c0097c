"""A user's mistake is one line on stderr naming the culprit and what to do, exit status 1 (2 for config and option
errors), no traceback; --debug or ERPO_DEBUG=1 shows the traceback. Model names, data files, run directories and
options."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import erpo
from erpo.cli.commands import main
from erpo.errors import UserError
from erpo.models.source import resolve_model_source

REPO = Path(__file__).resolve().parents[2]
SMALL = ["tiny.hidden_size=16", "tiny.intermediate_size=32", "tiny.num_layers=1", "tiny.num_heads=2",
         "tiny.num_kv_heads=1", "tiny.sft_steps=5", "tiny.sft_examples=16"]


def one_error_line(capsys, command: str) -> str:
    """The single stderr line of a failed command (and nothing on stdout: no config dump before it)."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"erpo {command}: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


# ----------------------------------------------------------------------------------------------- model names
def test_a_name_that_is_no_directory_and_no_hub_name_fails_at_once(tmp_path):
    for name in ("nonexistent-model", str(tmp_path / "runs" / "erpo-tny"), "./runs/erpo-tny"):
        with pytest.raises(UserError, match=r"--model .*: no such local directory, and not a Hub name \(org/name\)"):
            resolve_model_source(name)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        resolve_model_source(str(tmp_path / "file"), "model.name_or_path")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_source(str(tmp_path)) == str(tmp_path)


def test_hub_names_offline_fail_fast_unless_cached(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("erpo.models.source._hub_problem", lambda name: pytest.fail("no Hub request when offline"))
    started = time.time()
    with pytest.raises(UserError, match=r"model.name_or_path runs/erpo-tny: no such local directory, and the Hub is "
                                        r"offline \(HF_HUB_OFFLINE\)"):
        resolve_model_source("runs/erpo-tny", "model.name_or_path")
    assert time.time() - started < 5
    monkeypatch.setattr("erpo.models.source._in_hub_cache", lambda name: name == "org/cached")
    assert resolve_model_source("org/cached") == "org/cached"


def test_hub_names_online_take_one_request(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("erpo.models.source._in_hub_cache", lambda name: False)
    asked = []
    def hub_problem(name):
        asked.append(name)
        return None if name == "org/real" else "no Hub model of that name"
    monkeypatch.setattr("erpo.models.source._hub_problem", hub_problem)
    assert resolve_model_source("org/real") == "org/real"
    with pytest.raises(UserError, match="--model org/typo: no such local directory, and no Hub model of that name"):
        resolve_model_source("org/typo")
    assert asked == ["org/real", "org/typo"]


def test_eval_with_a_mistyped_path_is_one_line(capsys, tmp_path):
    """`erpo eval` goes through the one user-error path: one line and status 1, the traceback with --debug."""
    argv = ["eval", "--model", "nonexistent-model", "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 1
    assert re.match(r"^erpo eval: --model nonexistent-model: no such local directory[^\n]*\n$", capsys.readouterr().err)
    with pytest.raises(UserError, match="--model nonexistent-model: no such local directory"):
        main(argv + ["--debug"])
    assert not (tmp_path / "out").exists()


def test_train_checks_the_model_name_before_anything_loads(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--set", "model.name_or_path=runs/missing-model"]) == 1
    assert "model.name_or_path runs/missing-model: no such local directory" in one_error_line(capsys, "train")
    assert not run.exists()   # nothing written for a run that cannot start


@pytest.mark.parametrize("files, setting, message", [
    ((), "model.name_or_path={dir}",
     r"model.name_or_path \S+/model: this directory holds no model \(none of config.json, adapter_config.json\); give "
     r"a directory that a model's save_pretrained wrote, or a Hub name org/name$"),
    (("config.json",), "model.name_or_path={dir}",
     r"model.name_or_path \S+/model: this directory holds no tokenizer \(none of tokenizer_config.json, "
     r"tokenizer.json, tokenizer.model, vocab.json\); save the model's tokenizer there, or set model.tokenizer to "
     r"one$"),
    (("config.json", "tokenizer_config.json"), "model.tokenizer={dir}/../nothing",
     r"model.tokenizer \S+/nothing: this directory holds no tokenizer \(none of .*\); give a directory that a "
     r"tokenizer's save_pretrained wrote, or a Hub name org/name$"),
])
def test_a_directory_that_holds_no_model_or_no_tokenizer_is_one_line(capsys, tmp_path, files, setting, message):
    """A local directory given as the model (or the tokenizer) that holds none was transformers' traceback ("Couldn't
    instantiate the backend tokenizer ... sentencepiece or tiktoken"), after the run's first log line; in `erpo eval`
    a model directory without a tokenizer too."""
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "nothing").mkdir()
    for name in files:
        (model / name).write_text("{}")
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--set", "model.name_or_path=" + str(model),
                 setting.format(dir=model)]) == 1
    assert re.search(message, one_error_line(capsys, "train"))
    assert not run.exists()
    if files == ("config.json",):   # erpo eval --model likewise (a directory without config.json it refused)
        assert main(["eval", "--model", str(model), "--output-dir", str(tmp_path / "out")]) == 1
        line = one_error_line(capsys, "eval")
        assert line == (f"erpo eval: --model {model}: this directory holds no tokenizer (none of tokenizer_config.json,"
                        " tokenizer.json, tokenizer.model, vocab.json); save the model's tokenizer there"), line
        assert not (tmp_path / "out").exists()


def test_one_check_of_what_a_model_directory_holds(tmp_path):
    """`erpo.models.source.require` is the one check of a local directory's model or tokenizer, for the trainer's
    model.name_or_path / model.tokenizer and erpo eval's --model (the messages above): one line naming the option,
    the path, the files looked for and the fix; nothing for a Hub name or a directory that holds one."""
    from erpo.errors import UserError
    from erpo.models.source import require
    (tmp_path / "config.json").write_text("{}")
    require(str(tmp_path), "model", "--model", "unused")
    require("org/name", "tokenizer", "--model", "unused")   # a Hub repository: not checked here
    with pytest.raises(UserError) as error:
        require(str(tmp_path), "tokenizer", "--model", "save the model's tokenizer there")
    assert str(error.value) == (f"--model {tmp_path}: this directory holds no tokenizer (none of "
                                "tokenizer_config.json, tokenizer.json, tokenizer.model, vocab.json); save the model's "
                                "tokenizer there")


# ------------------------------------------------------------------------------------------------------ data
@pytest.mark.parametrize("content,message", [
    ('{"problem": "1+1=?", "answer": "2"}\n\n{"problem": "2+2=?"}\n',
     r"data.jsonl: line 3 has no field 'answer' \(data.answer_field\).*set data.answer_field"),
    ('{"problem": "1+1=?", "answer": "2"}\n{oops\n', r"data.jsonl:2: not valid JSON"),
    (None, r"no such file .*data.jsonl; check the path"),
])
def test_data_errors_are_one_line(capsys, tmp_path, content, message):
    data = tmp_path / "data.jsonl"
    if content is not None:
        data.write_text(content)
    argv = ["precompute-ref", "--output-dir", str(tmp_path / "run"), "--set", f"model.cache_dir={tmp_path / 'c'}",
            f"data.source={data}", *SMALL]
    assert main(argv) == 1
    line = one_error_line(capsys, "precompute-ref")
    assert re.search(message, line), line



def test_a_dataset_name_nothing_holds_is_one_line(capsys, tmp_path, monkeypatch):
    """A data.source that is no local file goes to `datasets`: a directory without data files (or, offline, a Hub
    name) was its traceback."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "no_data_files").mkdir()
    for source in (tmp_path / "no_data_files", "org/no-such-dataset"):
        argv = ["precompute-ref", "--output-dir", str(tmp_path / "run"), "--set", f"model.cache_dir={tmp_path / 'c'}",
                f"data.source={source}", *SMALL]
        assert main(argv) == 1
        line = one_error_line(capsys, "precompute-ref")
        assert line.startswith(f"erpo precompute-ref: dataset '{source}': ") and "check the name" in line, line



@pytest.mark.parametrize("setting, message", [
    ("data.source={dir}/notes.txt", r"notes.txt must end in .jsonl, .json or .parquet"),   # was a Hub lookup
    ("reference.cache_path={dir}", r"reference.cache_path .*: is a directory; give the cache file's path"),
    # was a FileExistsError traceback once ell_theta0(q) had been computed (as with --output-dir FILE)
    ("reference.cache_path={dir}/notes.txt/cache.json",
     r"reference.cache_path \S+/notes.txt/cache.json: \S+/notes.txt is a file, not a directory; give a cache path "
     r"\(or an --output-dir\) where a directory can be made$"),
])
def test_a_local_path_of_the_wrong_kind_is_one_line(capsys, tmp_path, monkeypatch, setting, message):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "notes.txt").write_text("1+1=2\n")
    argv = ["precompute-ref", "--output-dir", str(tmp_path / "run"), "--set", f"model.cache_dir={tmp_path / 'c'}",
            setting.format(dir=tmp_path), *SMALL]
    assert main(argv) == 1
    assert re.search(message, one_error_line(capsys, "precompute-ref"))


# -------------------------------------------------------------------------------------------- run directories
def fake_run(run: Path, *, finished: bool, schedule_steps: int = 5) -> Path:
    step = run / "checkpoints" / "step-5"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 5, "state": {"lr_schedule_steps": schedule_steps}}))
    if finished:
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
    return run


@pytest.fixture
def no_training(monkeypatch):
    """The run directory is checked first thing in train(): nothing after it (process group, seeds, data,
    models) may start."""
    import erpo.distributed
    monkeypatch.setattr(erpo.distributed, "init_distributed",
                        lambda *args, **kwargs: pytest.fail("training must not start"))


def test_run_directory_errors(capsys, tmp_path, no_training):
    finished = fake_run(tmp_path / "finished", finished=True)
    assert main(["train", "--output-dir", str(finished)]) == 1
    assert "holds a finished run (final/); choose another --output-dir" in one_error_line(capsys, "train")
    unfinished = fake_run(tmp_path / "unfinished", finished=False)
    assert main(["train", "--output-dir", str(unfinished)]) == 1
    assert "holds checkpoints of an unfinished run" in one_error_line(capsys, "train")
    assert main(["train", "--output-dir", str(tmp_path / "empty"), "--resume"]) == 1
    assert "--resume: no complete checkpoint" in one_error_line(capsys, "train")
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    # was "cannot write it (File exists)" / "(Not a directory)" (erpo compare's runs too), once the data and models
    # had loaded
    for out_dir, resume in ((notes, []), (notes, ["--resume"]), (notes / "run", [])):
        assert main(["train", "--output-dir", str(out_dir), *resume]) == 1
        assert one_error_line(capsys, "train") == (f"erpo train: --output-dir {out_dir}: {notes} is a file, not a "
                                                   "directory; give the run's directory (a new one, or a run's to "
                                                   "--resume)")
    assert main(["train", "--output-dir", str(unfinished), "--resume", "--max-steps", "7"]) == 1
    line = one_error_line(capsys, "train")
    assert "spans 5 optimizer steps, but this config's spans 7" in line and "resume with --max-steps 5" in line


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(tmp_path, no_training, monkeypatch, how):
    finished = fake_run(tmp_path / "finished", finished=True)
    argv = ["train", "--output-dir", str(finished)]
    if how == "flag":
        argv.append("--debug")
    else:
        monkeypatch.setenv("ERPO_DEBUG", "1")
    with pytest.raises(UserError, match="holds a finished run"):
        main(argv)


def test_config_errors_exit_2_without_a_config_dump(capsys):
    assert main(["train", "--set", "trainer.lr=-1"]) == 2
    assert "config error: trainer.lr must be > 0" in one_error_line(capsys, "train")


@pytest.mark.parametrize("setting, message", [
    ("rollout.importance_sampling_cap=null", "config key 'rollout.importance_sampling_cap': expected a number"),
    ("algorithm.pg_objective=grpo", "config key 'algorithm.pg_objective' = 'grpo'; expected one of ppo-clip"),
    ("algorithm.top_entropy_quantile=1.5", "top_entropy_quantile must be a number in [0, 1]"),
    ("trainer.loss_workspace_mib=0", "config key 'trainer.loss_workspace_mib' must be > 0, got 0")])
def test_loss_option_errors_are_one_line(capsys, setting, message):
    """No cap for the importance weight (null), out-of-range policy options and no loss workspace are one line, exit
    2."""
    assert main(["train", "--set", setting]) == 2
    assert message in one_error_line(capsys, "train")


# ------------------------------------------------------------------------------------------------------ options
def argparse_error_line(capsys, argv: list[str]) -> str:
    """The one stderr line of `erpo ARGV` refused by the parser (exit status 2, argparse's), nothing on stdout."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and captured.err.endswith("\n"), captured.err
    return captured.err.rstrip("\n")


@pytest.mark.parametrize("argv, unknown", [
    (["train", "--max-step", "5"], "--max-step 5"),              # no option may be abbreviated
    (["train", "--lr-foo", "1"], "--lr-foo 1"),
    (["--local_rank=1", "train", "--no-such-option"], "--no-such-option"),
    (["precompute-ref", "--overwrite", "yes"], "yes"),
    (["eval", "--model", "x", "--temperature", "1"], "--temperature 1"),
    (["compare", "--seed", "1"], "--seed 1"),
    (["plot", "runs/a", "--smooth-weight", "0.5"], "--smooth-weight 0.5")])
def test_an_unknown_option_is_one_line_naming_it_and_the_help(capsys, argv, unknown):
    command = next(word for word in argv if not word.startswith("-"))
    assert argparse_error_line(capsys, argv) == (f"erpo {command}: error: unrecognized arguments: {unknown} "
                                                 f"(see erpo {command} --help)")


@pytest.mark.parametrize("argv, culprit", [
    ([], "the following arguments are required: COMMAND"),               # missing
    (["--foo", "train"], "unrecognized arguments: --foo"),                # before the command: the top level's
    (["trian"], "argument COMMAND: invalid choice: 'trian'"),             # bad choice
    (["--local_rank", "x", "train"], "argument --local_rank/--local-rank: invalid int value: 'x'"),   # bad type
    (["--debug"], "the following arguments are required: COMMAND"),
    (["--versoin"], "unrecognized arguments: --versoin"),                 # without a command: was "COMMAND required"
    (["--foo", "--debug"], "unrecognized arguments: --foo")])
def test_a_top_level_error_is_one_line(capsys, argv, culprit):
    line = argparse_error_line(capsys, argv)
    assert line.startswith(f"erpo: error: {culprit}") and line.endswith(" (see erpo --help)"), line


def test_version_is_erpo_s(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"erpo {erpo.__version__}\n"


def test_unknown_options_before_and_after_the_command_are_all_named_in_one_line(capsys):
    assert argparse_error_line(capsys, ["--foo", "train", "--bar", "--max-steps", "2", "--baz=1"]) == (
        "erpo: error: unrecognized arguments: --foo, and erpo train's --bar --baz=1 "
        "(see erpo --help, erpo train --help)")


@pytest.mark.parametrize("argv, culprit", [
    (["train", "--max-steps"], "argument --max-steps: expected one argument"),                # missing value
    (["train", "--algorithm", "ppo"], "argument --algorithm: invalid choice: 'ppo'"),         # bad choice
    (["train", "--zero-stage", "5"], "argument --zero-stage: invalid choice: 5"),
    (["train", "--seed", "x"], "argument --seed: invalid int value: 'x'"),                    # bad type
    (["precompute-ref", "--set"], "argument --set: expected at least one argument"),
    (["eval"], "the following arguments are required: --model"),                              # missing option
    (["eval", "--model", "m", "--k", "two"], "argument --k: invalid int value: 'two'"),
    (["eval", "--model", "m", "--engine", "sglang"], "argument --engine: invalid choice: 'sglang'"),
    (["compare", "--algorithms", "ppo"], "argument --algorithms: invalid choice: 'ppo'"),
    (["compare", "--window"], "argument --window: expected one argument"),
    (["plot"], "the following arguments are required: RUN_DIR"),
    (["plot", "runs/a", "--smooth", "high"], "argument --smooth: invalid float value: 'high'")])
def test_a_subcommand_s_error_is_one_line_naming_the_option_and_its_help(capsys, argv, culprit):
    line = argparse_error_line(capsys, argv)
    assert line.startswith(f"erpo {argv[0]}: error: {culprit}") and line.endswith(f" (see erpo {argv[0]} --help)"), line


def test_the_process_s_argparse_error_is_its_only_line():
    """`python -m erpo` end to end: nothing before the parser's line (no log, no warning), exit status 2."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "erpo", "train", "--lr-foo", "1e-5"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "erpo train: error: unrecognized arguments: --lr-foo 1e-5 (see erpo train --help)\n"


def test_the_command_line_prints_one_line_and_no_traceback(tmp_path):
    """The installed entry point end to end (`python -m erpo`): stderr holds the one line only."""
    finished = fake_run(tmp_path / "finished", finished=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "erpo", "train", "--output-dir", str(finished)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"erpo train: --output-dir {finished}: holds a finished run (final/); choose "
                                   "another --output-dir (e.g. runs/erpo-tiny-2), or delete that directory to train it "
                                   "again"), proc.stderr


# ------------------------------------------------------------------------------- config files, rewards, devices
def test_a_config_file_that_is_not_yaml_is_one_line(capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  lr: 1e-5\n  max_steps: [3\n")
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "run")]) == 2
    line = one_error_line(capsys, "train")
    assert line.startswith(f"erpo train: config error: {config}:4: not valid YAML (") and "fix the file" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("spec, message", [
    ("bleu", r"reward function 'bleu': expected 'math', 'format' or 'path/to/file.py:function_name'"),
    ("{dir}/missing.py:fn", r"reward function '.*/missing.py:fn': no such file .*/missing.py; check the path"),
    ("{dir}/my_reward.py:nope", r"reward function '.*/my_reward.py:nope': .*/my_reward.py has no callable named "
                                r"'nope'; check the name"),
])
def test_a_mistyped_reward_function_is_one_line_before_any_model_loads(capsys, tmp_path, monkeypatch, spec, message):
    (tmp_path / "my_reward.py").write_text("def mine(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    monkeypatch.setattr("erpo.train.loop.model_path_for", lambda cfg: pytest.fail("no model may load"))
    run = tmp_path / "run"
    argv = ["train", "--output-dir", str(run), "--set", f"reward.functions=[math,{spec.format(dir=tmp_path)}]"]
    assert main(argv) == 1
    assert re.search(message, one_error_line(capsys, "train"))
    assert not run.exists()


def test_a_missing_optional_package_is_one_line(capsys, tmp_path, monkeypatch):
    """rollout.engine=vllm without vLLM (as on a CPU machine) says what to install, in one line."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    argv = ["train", "--output-dir", str(tmp_path / "run"), "--set", f"model.cache_dir={tmp_path / 'c'}",
            "rollout.engine=vllm", *SMALL]
    assert main(argv) == 1
    assert "rollout.engine 'vllm' needs vLLM on a CUDA machine: pip install 'erpo[vllm]'" in one_error_line(capsys,
                                                                                                             "train")


@pytest.mark.parametrize("device, message", [
    ("gpu", "--device gpu: not a torch device"),
    pytest.param("cuda", "--device cuda: this machine has no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has a CUDA device")),
])
def test_eval_on_a_device_this_machine_lacks_is_one_line(capsys, tmp_path, device, message):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json"):   # a model dir as far as --model goes: the device is next
        (model / name).write_text("{}")
    assert main(["eval", "--model", str(model), "--device", device, "--output-dir", str(tmp_path / "out")]) == 1
    assert message in one_error_line(capsys, "eval")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options, message", [
    (["--k", "0"], "--k must be an integer >= 1 (samples per problem), got 0"),
    (["--temperatures", "0.6,7"], "--temperatures: each temperature must be in (0, 5], got 7"),
    (["--k", "4", "--pass-k", "2,8"], "--pass-k must lie in [1, --k=4], got [2, 4, 8]"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1 (prompts per generate call), got 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1] (1: no nucleus cut), got 1.5"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an integer >= 1, got 0"),
    (["--gpu-memory-utilization", "1.5"],   # the auto engine (no vLLM here) ignored it; with vLLM its message named
     "--gpu-memory-utilization must be a fraction in (0, 1] (vLLM's share of each GPU's memory), got 1.5"),
    (["--engine", "vllm", "--gpu-memory-utilization", "0"],   # the trainer's rollout.gpu_memory_utilization
     "--gpu-memory-utilization must be a fraction in (0, 1] (vLLM's share of each GPU's memory), got 0.0"),
    (["--engine", "hf", "--tensor-parallel-size", "2"],   # checked by the engine's builder (a traceback before)
     "--tensor-parallel-size 2 needs the vLLM engine (--engine vllm, pip install 'erpo[vllm]')"),
])
def test_eval_sampling_options_are_named_as_typed(capsys, tmp_path, options, message):
    """`erpo eval`'s sampling checks name the option the user typed (`--k`, not the library's `k`), in one line, with
    what to give; `evaluate()` called from Python names its own keywords."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (model / name).write_text("{}")
    assert main(["eval", "--model", str(model), *options, "--output-dir", str(tmp_path / "out")]) == 1
    assert one_error_line(capsys, "eval") == f"erpo eval: {message}"
    assert not (tmp_path / "out").exists()
    from erpo.eval.evaluate import check_eval_arguments
    with pytest.raises(ValueError, match=r"^k must be an integer >= 1 \(samples per problem\), got 0$"):
        check_eval_arguments(k=0, temperatures=[1.0], pass_ks=None, batch_size=1, top_p=1.0)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization must be a fraction in \(0, 1\]"):
        check_eval_arguments(k=1, temperatures=[1.0], pass_ks=None, batch_size=1, top_p=1.0, gpu_memory_utilization=2)


def test_eval_into_a_file_is_one_line(capsys, tmp_path):
    """An --output-dir that is a file was a NotADirectoryError traceback once the first model had sampled."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (model / name).write_text("{}")
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    for out_dir in (notes, notes / "results"):
        assert main(["eval", "--model", str(model), "--output-dir", str(out_dir)]) == 1
        assert one_error_line(capsys, "eval") == (f"erpo eval: --output-dir {out_dir}: {notes} is a file, not a "
                                                  "directory; give the directory for the results and the sample "
                                                  "cache")


def test_eval_with_a_template_that_is_none_is_one_line(capsys, tmp_path):
    """A mistyped LABEL=TEMPLATE (no such label) is no template: refused before any model loads, not by the first
    prompt built."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (model / name).write_text("{}")
    argv = ["eval", "--model", f"mine={model}", "--template", "mien=plain", "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 1
    line = one_error_line(capsys, "eval")
    assert "--template mien=plain: not a template name (paper, plain, qwen-math) and no {problem} in it" in line
    assert "LABEL one of mine" in line

