"""erpo.cli: the parser, flag -> config mapping, config errors, precompute-ref, delegated subcommands."""
import json
import logging
import os
import subprocess
import sys

import pytest

from erpo.cli.args import config_from_args, shipped_config
from erpo.cli.commands import build_parser, main
from paths import worker_pythonpath
from test_user_errors import fake_run


def test_train_flags_map_onto_the_config(tmp_path):
    args = build_parser().parse_args([
        "train", "--config", "qwen25_math_7b_erpo", "--output-dir", str(tmp_path), "--max-steps", "5",
        "--algorithm", "grpo", "--seed", "7", "--zero-stage", "2", "--save-steps", "3",
        "--set", "trainer.lr=2e-6", "rollout.n=4", "--resume"])
    cfg = config_from_args(args)
    assert cfg.output_dir == str(tmp_path) and cfg.trainer.max_steps == 5 and cfg.trainer.seed == 7
    assert cfg.trainer.zero_stage == 2 and cfg.trainer.save_steps == 3 and args.resume
    assert cfg.algorithm.name == "grpo" and cfg.algorithm.policy_kl_coef == 0.01
    assert cfg.trainer.lr == 2e-6 and cfg.rollout.n == 4
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-Math-7B"


def test_no_config_is_the_tiny_default():
    cfg = config_from_args(build_parser().parse_args(["train"]))
    assert cfg.model.name_or_path == "tiny" and cfg.algorithm.name == "erpo"


def test_config_errors_exit_2_with_a_message(capsys, tmp_path):
    assert main(["train", "--set", "trainer.nope=1"]) == 2
    assert "unknown config key 'trainer.nope'" in capsys.readouterr().err
    # a near miss, by --set and in a YAML file: one line naming the nearest key
    assert main(["train", "--set", "model.lora.alhpa=16"]) == 2
    assert capsys.readouterr().err == ("erpo train: config error: unknown config key 'model.lora.alhpa': did you mean "
                                       "'model.lora.alpha'?\n")
    (tmp_path / "near.yaml").write_text("algorithm:\n  qkl_cof: 0.02\n")
    assert main(["train", "--config", str(tmp_path / "near.yaml")]) == 2
    assert capsys.readouterr().err == ("erpo train: config error: unknown config key 'algorithm.qkl_cof': did you mean "
                                       "'algorithm.qkl_coef'?\n")
    assert main(["train", "--config", "no_such_config"]) == 2
    assert "not a shipped config" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"erpo train: config error: --config {tmp_path}: is a directory; give a "
                                               "YAML file or a shipped config's name")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--algorithm", "ppo"])


def test_precompute_ref_writes_the_cache(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="erpo")
    out = tmp_path / "run"
    argv = ["precompute-ref", "--output-dir", str(out), "--set", f"model.cache_dir={tmp_path / 'theta0'}",
            "tiny.hidden_size=16", "tiny.intermediate_size=32", "tiny.num_layers=1", "tiny.num_heads=2",
            "tiny.num_kv_heads=1", "tiny.sft_steps=5", "tiny.sft_examples=16", "data.num_examples=8"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == str(out / "reference_cache.json")   # the config is not dumped on the terminal
    # its summary line names no resolved config.yaml: precompute-ref writes none (erpo train does)
    assert "erpo precompute-ref: erpo on tiny" in caplog.text and "config.yaml" not in caplog.text
    assert not (out / "config.yaml").exists()
    cache = json.loads((out / "reference_cache.json").read_text())
    assert cache["entries"] and cache["template"].startswith("plain|chat=True")
    distinct = len(cache["entries"])
    assert f"computing ell_theta0(q) for the training set's 8 prompts ({distinct} distinct)" in caplog.text
    assert main(argv) == 0  # an existing matching cache is reused
    assert f"({distinct} distinct prompts; the training set's 8 read from it)" in caplog.text


# What parsing does not need: the trainer's and evaluation's packages, loaded when a command runs (seconds of imports
# that `erpo --help`, and every error in a command line, no longer wait for).
HEAVY_MODULES = ("matplotlib", "torch", "erpo_kernels", "triton", "numpy", "transformers", "tokenizers",
                 "huggingface_hub", "safetensors", "deepspeed", "yaml", "tqdm", "tensorboard")


def without_interpreter(environ) -> dict:
    """`environ` without TRITON_INTERPRET: a launched process then imports what a user's does (with it, the suite's
    tests/support/interpreter_site patches Triton's interpreter at start-up, importing triton and numpy)."""
    return {key: value for key, value in environ.items() if key != "TRITON_INTERPRET"}


def test_the_parser_and_every_help_import_nothing_heavy():
    """Building the parser, every `--help` and a command line's error load none of HEAVY_MODULES (in a fresh process:
    this one has them all)."""
    code = """
import sys
from erpo.cli import main
for argv in ([], ["--help"], ["train", "--help"], ["precompute-ref", "--help"], ["compare", "--help"],
             ["eval", "--help"], ["plot", "--help"], ["train", "--max-step", "5"]):
    try:
        main(argv)
    except SystemExit:
        pass
print("loaded:", *sorted({name.split(".")[0] for name in sys.modules} & set(sys.argv[1:])))
"""
    done = subprocess.run([sys.executable, "-c", code, *HEAVY_MODULES], capture_output=True, text=True, timeout=120,
                          env={**without_interpreter(os.environ), "PYTHONPATH": worker_pythonpath()})  # this erpo
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("usage: erpo") == 6   # each help was printed
    assert done.stdout.splitlines()[-1] == "loaded:", done.stdout.splitlines()[-1]


# What `erpo train` and `erpo precompute-ref` load only once the config and what it alone decides are checked: the
# trainer's modules and transformers (its modeling code pulls in torch._dynamo: most of the seconds before a run).
TRAINER_MODULES = ("erpo.train.loop", "erpo.reference.setup", "erpo.models.loading", "transformers")


def test_a_mistake_the_config_decides_is_one_line_before_the_trainer_loads(tmp_path):
    """A config mistake, a run directory that cannot start the run, a reference cache path that cannot hold the
    cache and a reward function that cannot be loaded: each one line with its exit status, in a fresh process that
    has loaded none of TRAINER_MODULES when it answers (`erpo.cli` main, one command after another), and no log line
    before it."""
    finished = fake_run(tmp_path / "finished", finished=True)
    run, cache_dir = tmp_path / "run", tmp_path / "cache_dir"
    cache_dir.mkdir()
    cases = [  # (argv, exit status, the line's start)
        (["train", "--set", "trainer.lr=abc"], 2,
         "erpo train: config error: config key 'trainer.lr': expected a number, got 'abc'"),
        (["train", "--config", str(tmp_path / "nonexist.yaml")], 2,
         f"erpo train: config error: --config {tmp_path / 'nonexist.yaml'}: no such file, and not a shipped config"),
        (["train", "--output-dir", str(finished)], 1, f"erpo train: --output-dir {finished}: holds a finished run"),
        (["train", "--output-dir", str(run), "--resume"], 1, "erpo train: --resume: no complete checkpoint under"),
        (["train", "--output-dir", str(run), "--set", f"reference.cache_path={cache_dir}"], 1,
         f"erpo train: reference.cache_path {cache_dir}: is a directory; give the cache file's path"),
        (["train", "--output-dir", str(run), "--set", f"reward.functions=[{tmp_path / 'nofile.py'}:score]"], 1,
         f"erpo train: reward function '{tmp_path / 'nofile.py'}:score': no such file"),
        (["precompute-ref", "--output-dir", str(run), "--set", f"reference.cache_path={cache_dir}"], 1,
         f"erpo precompute-ref: reference.cache_path {cache_dir}: is a directory; give the cache file's path"),
    ]
    code = """
import contextlib, io, json, logging, sys
logging.basicConfig(stream=sys.stderr)   # erpo's log lines, if any, go to this process's stderr
from erpo.cli import main
answers = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stderr(io.StringIO()) as err:
        status = main(argv)
    answers.append([status, err.getvalue(), [name for name in json.loads(sys.argv[2]) if name in sys.modules]])
print(json.dumps(answers))
"""
    done = subprocess.run([sys.executable, "-c", code, json.dumps([argv for argv, _, _ in cases]),
                           json.dumps(TRAINER_MODULES)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**without_interpreter(os.environ), "PYTHONPATH": worker_pythonpath()})  # this erpo
    assert done.returncode == 0 and done.stderr == "", done.stderr
    for (argv, status, start), (got_status, err, loaded) in zip(cases, json.loads(done.stdout), strict=True):
        assert (got_status, loaded) == (status, []), (argv, got_status, loaded, err)
        assert err.startswith(start) and err.count("\n") == 1, (argv, err)
    assert not run.exists()


def test_a_fresh_machine_s_first_line_is_not_matplotlib_s(tmp_path):
    """matplotlib builds its font cache on its first import (here: a new MPLCONFIGDIR), logging "generated new
    fontManager" at INFO; the CLI quiets it before any command imports matplotlib (here `erpo plot`)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "reward": 0.1 * step, "accuracy": 0.5,
                                                           "qkl": 1e-3 * step, "entropy": 1.0}) + "\n"
                                               for step in range(1, 4)))
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl"), "PYTHONPATH": worker_pythonpath()}
    done = subprocess.run([sys.executable, "-m", "erpo", "plot", str(run), "-o", str(tmp_path / "dyn.png")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == str(tmp_path / "dyn.png"), done.stderr
    assert (tmp_path / "mpl").is_dir()  # matplotlib did build its cache in this run
    assert "fontManager" not in done.stderr, done.stderr


def test_eval_and_plot_are_registered():
    sub = build_parser()._subparsers._group_actions[0].choices
    assert {"train", "precompute-ref", "eval", "plot"} <= set(sub)
    assert sub["plot"].format_help() != sub["eval"].format_help()


@pytest.mark.parametrize("module", ["erpo", "erpo.cli"])
def test_python_dash_m_erpo_help(module):
    """`python -m erpo` and `python -m erpo.cli` are both the `erpo` command."""
    result = subprocess.run([sys.executable, "-m", module, "train", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: erpo train")
    for flag in ("--config", "--output-dir", "--max-steps", "--algorithm", "--seed", "--zero-stage", "--save-steps",
                 "--resume", "--set"):
        assert flag in result.stdout
    # where the reward functions' call (TRL's, trainer_state) and the reward metrics are told
    assert "trainer_state" in result.stdout and result.stdout.rstrip().endswith("docs/training.md.")


def test_shipped_config_paths():
    assert shipped_config("tiny").endswith("configs/tiny.yaml")
    assert shipped_config("tiny.yaml") == shipped_config("tiny")


@pytest.fixture
def fake_training(monkeypatch):
    """erpo.train.loop.train and the checks before it (`preflight.check_run`, what it hands train: "checked")
    replaced by recorders, train optionally raising, and the process-group teardown recorded."""
    import erpo.distributed
    import erpo.train.loop
    import erpo.train.preflight
    calls = {"train": [], "destroy": 0, "raise": None}

    def train(cfg, resume=False, force=False, checked=None):
        assert checked == ("checked", cfg.output_dir, resume)
        calls["train"].append((cfg.output_dir, resume, os.environ.get("LOCAL_RANK")))
        if calls["raise"]:
            raise calls["raise"]

    def destroy():
        calls["destroy"] += 1
    monkeypatch.setattr(erpo.train.loop, "train", train)
    monkeypatch.setattr(erpo.train.preflight, "check_run", lambda cfg, resume: ("checked", cfg.output_dir, resume))
    monkeypatch.setattr(erpo.distributed, "destroy_distributed", destroy)
    monkeypatch.setenv("LOCAL_RANK", "0")   # recorded first: teardown then removes the LOCAL_RANK the CLI sets from
    monkeypatch.delenv("LOCAL_RANK")        # --local_rank, which would otherwise reach later tests
    return calls


def test_train_tears_down_the_process_group_also_after_an_error(fake_training):
    assert main(["train", "--output-dir", "a"]) == 0
    assert fake_training["train"] == [("a", False, None)] and fake_training["destroy"] == 1
    fake_training["raise"] = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        main(["train", "--output-dir", "b", "--resume"])
    assert fake_training["train"][-1] == ("b", True, None) and fake_training["destroy"] == 2


@pytest.mark.parametrize("argv", [["--local_rank=1", "train"], ["train", "--local_rank=1"],
                                  ["--local-rank", "1", "train"]])
def test_local_rank_inserted_by_the_deepspeed_launcher_is_accepted(fake_training, argv):
    """`deepspeed --module erpo train` without --no_local_rank runs `python -m erpo --local_rank=N train ...`."""
    assert main(argv + ["--output-dir", "r"]) == 0
    assert fake_training["train"] == [("r", False, "1")]


def test_local_rank_flag_does_not_override_the_launcher_environment(fake_training, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert main(["--local_rank=1", "train", "--output-dir", "r"]) == 0
    assert fake_training["train"] == [("r", False, "3")]
    assert "local_rank" not in vars(build_parser().parse_args(["train"]))


def test_cpu_threads_default_to_the_cores_and_are_recorded(monkeypatch):
    from erpo.config import dump_yaml
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cores = len(os.sched_getaffinity(0))
    cfg = config_from_args(build_parser().parse_args(["train"]))
    assert cfg.trainer.cpu_threads == cores and f"cpu_threads: {cores}\n" in dump_yaml(cfg)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")                      # two ranks on this node share the cores
    assert config_from_args(build_parser().parse_args(["train"])).trainer.cpu_threads == max(1, cores // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert config_from_args(build_parser().parse_args(["train"])).trainer.cpu_threads == 3
    args = build_parser().parse_args(["train", "--set", "trainer.cpu_threads=1"])
    assert config_from_args(args).trainer.cpu_threads == 1
