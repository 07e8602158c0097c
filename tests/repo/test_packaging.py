"""setup.py, read without installing anything: the base install is the loss alone (torch, numpy, Triton on Linux)
and the trainer's dependencies are the `train` extra; the entry points name importable objects (a fresh install
writes a script that imports exactly these strings). `import erpo_kernels` works without Triton, and the `erpo`
command without the trainer's dependencies says in one line what to install. The README's commands and CI's agree."""
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
LOSS_PACKAGES = {"torch", "numpy", "triton"}
TRAINER_PACKAGES = {"transformers", "tokenizers", "safetensors", "pyyaml", "tqdm", "matplotlib", "tensorboard",
                    "math-verify", "antlr4-python3-runtime", "numpy", "packaging"}


@pytest.fixture(scope="module")
def setup_arguments() -> dict:
    """The keyword arguments setup.py passes to setuptools.setup (setup.py run with setup() captured)."""
    captured = {}
    original, cwd = setuptools.setup, Path.cwd()
    setuptools.setup = captured.update
    try:
        os.chdir(REPO)  # setup.py reads README.md relative to its folder
        exec(compile((REPO / "setup.py").read_text(), "setup.py", "exec"), {"__name__": "__main__"})
    finally:
        setuptools.setup = original
        os.chdir(cwd)
    return captured


def names(requirements) -> set:
    return {Requirement(line).name.lower() for line in requirements}


def test_base_install_is_the_loss_alone(setup_arguments):
    requirements = [Requirement(line) for line in setup_arguments["install_requires"]]
    assert {r.name for r in requirements} == LOSS_PACKAGES
    (triton,) = [r for r in requirements if r.name == "triton"]
    assert triton.marker is not None
    assert triton.marker.evaluate({"platform_system": "Linux"})
    assert not triton.marker.evaluate({"platform_system": "Darwin"})  # no Triton wheels there: the torch reference
    (torch_requirement,) = [r for r in requirements if r.name == "torch"]
    assert "2.5" in torch_requirement.specifier and "2.4" not in torch_requirement.specifier  # torch.library ops


def test_trainer_dependencies_are_the_train_extra(setup_arguments):
    extras = setup_arguments["extras_require"]
    assert names(extras["train"]) == TRAINER_PACKAGES
    assert TRAINER_PACKAGES <= names(extras["test"])  # CI runs the trainer's tests
    for extra in ("trl", "verl", "vllm", "deepspeed", "lora"):  # the trainer's extras bring the trainer along
        assert TRAINER_PACKAGES <= names(extras[extra]), extra


def test_the_test_extra_runs_the_trainer_on_the_train_extra_s_versions(setup_arguments):
    # `.[train]` and `.[test]` in one environment, in either order, leave the trainer on the versions CI tested: the
    # test extra takes the train extra's requirements as they are and puts no other bound on those packages
    train, test = setup_arguments["extras_require"]["train"], setup_arguments["extras_require"]["test"]
    assert test[:len(train)] == train
    assert not names(test[len(train):]) & names(train), names(test[len(train):]) & names(train)
    pins = {Requirement(line).name.lower(): Requirement(line).specifier for line in train}
    assert "5.11" in str(pins["transformers"]) and not pins["transformers"].contains("5.11.0")  # verl 0.9.1's bound
    assert pins["numpy"].contains("2.3.5") and not pins["numpy"].contains("2.4.0")   # Triton 3.6's interpreter
    assert pins["antlr4-python3-runtime"].contains("4.9.3") and not pins["antlr4-python3-runtime"].contains("4.13.2")


def test_console_script_names_an_importable_function(setup_arguments):
    (script,) = setup_arguments["entry_points"]["console_scripts"]
    name, target = script.split("=")
    module, attr = target.split(":")
    assert name == "erpo"
    assert callable(getattr(importlib.import_module(module), attr))


def test_verl_plugin_names_a_module(setup_arguments):
    for spec in setup_arguments["entry_points"]["verl.plugins"]:
        module = spec.split("=")[1]
        assert importlib.util.find_spec(module) is not None, module


def run_without(modules: list[str], code: str, argv: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where importing any of `modules` fails (ModuleNotFoundError); `argv`:
    its sys.argv[1:]."""
    block = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in modules)
    return subprocess.run([sys.executable, "-c", block + code, *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


def test_erpo_kernels_without_triton_runs_the_torch_reference():
    code = """
import torch
import erpo_kernels
from erpo_kernels import erpo_loss, fused_linear_token_logprobs, token_logprobs
logits = torch.randn(4, 7)
targets = torch.tensor([1, 2, 3, -100])
expected = torch.log_softmax(logits, -1)[torch.arange(3), targets[:3]]
torch.testing.assert_close(token_logprobs(logits, targets)[:3], expected)
out = erpo_loss(logits, targets.clamp_min(0), torch.tensor([1, 2, 2, 0]), torch.zeros(4, dtype=torch.long),
                advantages=torch.ones(1), ref_query_logp=torch.tensor([-2.0]))
assert torch.isfinite(out.loss)
for call in (lambda: token_logprobs(logits, targets, backend="triton"),
             lambda: fused_linear_token_logprobs(torch.randn(4, 3), torch.randn(7, 3), targets, backend="triton")):
    try:
        call()
    except ImportError as exc:
        print("ImportError:", exc)
assert not any(name.startswith("erpo_kernels.triton") for name in sys.modules), sorted(sys.modules)
"""
    result = run_without(["triton"], code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    for line in lines:
        assert "backend='triton' needs the triton package (pip install triton" in line


TRAIN_EXTRA_IMPORTS = ["yaml", "transformers", "tokenizers", "safetensors", "tqdm", "matplotlib", "tensorboard",
                       "math_verify"]   # what the light install lacks (the train extra's import names)


def test_cli_without_trainer_dependencies_helps_and_names_the_extra():
    code = "from erpo.cli import main; sys.exit(main(sys.argv[1:]))"
    for argv in (["--help"], ["train", "--help"]):
        result = run_without(TRAIN_EXTRA_IMPORTS, code, argv)
        assert result.returncode == 0 and result.stdout.startswith("usage: erpo"), (argv, result.stderr)
    assert "--max-steps" in result.stdout   # train's own options
    # the light install, or one package of the extra missing
    for missing, argv in [(TRAIN_EXTRA_IMPORTS, argv) for argv in (["train", "--max-steps", "1"], ["precompute-ref"],
                          ["compare", "--max-steps", "2"], ["eval", "--model", "runs/x"], ["plot", "runs/x"])] + \
                         [(["yaml"], ["train"])]:
        result = run_without(missing, code, argv)
        assert result.returncode == 1, (argv, missing, result.stderr)
        assert result.stderr.strip().splitlines() == [
            f"erpo {argv[0]} needs the trainer's packages (the 'train' extra): pip install \"erpo[train]\""], \
            (argv, missing)


def test_readme_commands_install_the_trainer_and_match_ci():
    readme = (REPO / "README.md").read_text()
    install, test_command = readme.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert install == 'pip install torch==2.13.0 -e ".[train]" && erpo train'
    ci_command = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command == test_command  # CI runs exactly the README's test command
