"""verl keeps one platform per process, chosen at the first import that asks for it, and bench/verl_engine.py sets
its CPU platform before that: whatever order pytest runs the verl test files in, whatever imports verl first. Until
2026-11-27 test_verl_step_time.py imported verl itself with its plugins on, so that verl chose 'nvidia' for the run
and every later verl test died in `torch._C._cuda_setDevice`."""
import os
import subprocess
import sys

import pytest

from paths import REPO, worker_pythonpath

pytest.importorskip("bench.verl_engine", exc_type=ModuleNotFoundError)   # verl and tensordict


def clean_env(tmp_path, **values) -> dict:
    """This process's environment without verl's platform and plugin settings (verl's defaults) and without
    TORCH_CUDA_ARCH_LIST, plus `values`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_PLUGINS", "TORCH_CUDA_ARCH_LIST")}
    return {**env, "PYTHONPATH": worker_pythonpath(), "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", **values}


def test_the_step_time_file_first_leaves_the_verl_tests_on_the_cpu(tmp_path):
    """The order that failed: the step-time file collected first, then an engine built by the integration file."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'run'}",
               "tests/integrations/test_verl_step_time.py", "tests/integrations/test_verl_integration.py",
               "-k", "usage_error or test_equals_verl_ppo_loss and token-mean and rmpad"]
    done = subprocess.run(command, cwd=REPO, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.splitlines()[-1].startswith("3 passed"), (   # 1 + 2 (rmpad)
        done.stdout[-4000:] + done.stderr[-2000:])


def test_imported_after_verl_chose_another_platform_it_says_so(tmp_path):
    """verl imported with erpo's plugin (here named in VERL_USE_EXTERNAL_MODULES, as without the entry point) has
    chosen 'nvidia' on a machine without a GPU: importing bench.verl_engine then stops in one line."""
    done = subprocess.run([sys.executable, "-c", "import verl; import bench.verl_engine"], cwd=tmp_path,
                          env=clean_env(tmp_path, VERL_USE_EXTERNAL_MODULES="erpo.integrations.verl_trainer"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "RuntimeError: bench.verl_engine: verl already chose its 'cuda' platform in this process (`import verl` "
        "with its plugins on does): import bench.verl_engine before verl")


# One fresh process (verl keeps the platform it chose for the process; in the suite's, an earlier verl test file may
# have built an engine already) answers the two tests below: its line "imported: ..." after the imports, "built: ..."
# after an engine was built
VERL_FIRST_SCRIPT = """import os, tempfile
import bench.verl_engine as v
import erpo.integrations.verl_trainer
from verl.plugin.platform import get_platform
from verl.workers.engine.fsdp import transformer_impl
print('imported:', get_platform().device_name, transformer_impl.device_name,
      os.environ.get('VERL_USE_EXTERNAL_PLUGINS'), os.environ.get('VERL_PLATFORM'),
      os.environ.get('TORCH_CUDA_ARCH_LIST'))
from erpo.models.tiny import build_tokenizer, save_model_dir
from verl.models.transformers import monkey_patch
from verl.utils import import_utils
keys = ('MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK')
before = {k: os.environ.get(k) for k in keys}
engine = v.build_engine(save_model_dir(tempfile.mkdtemp(), build_tokenizer(), seed=0))
print('built:', {k: os.environ.get(k) for k in keys} == before,
      monkey_patch.is_trl_available is import_utils.is_trl_available, type(engine.module).__name__)
"""


@pytest.fixture(scope="module")
def verl_first(tmp_path_factory) -> list[list[str]]:
    """VERL_FIRST_SCRIPT's two lines, split, without their names, from a fresh process without the launcher
    variables."""
    tmp_path = tmp_path_factory.mktemp("verl_first")
    env = {k: v for k, v in clean_env(tmp_path).items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", VERL_FIRST_SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()   # build_engine prints lines of its own
    return [next(line.split()[1:] for line in lines if line.startswith(f"{what}: ")) for what in ("imported", "built")]


def test_verl_imported_first_keeps_the_cpu_platform_and_the_environment(verl_first):
    """bench.verl_engine first, then erpo's verl plugin (which imports verl's engine modules): they keep device "cpu";
    the environment verl reads its plugin setting from is as it was (a child verl loads its plugins), and verl's
    engine import, which sets TORCH_CUDA_ARCH_LIST for its Megatron engine, leaves it unset without Megatron."""
    assert verl_first[0] == ["cpu", "cpu", "None", "None", "None"]


def test_building_an_engine_leaves_the_environment_and_verl_as_they_were(verl_first):
    """`build_engine` sets up its one-rank gloo group and has verl build the actor without TRL's value-head patch,
    and leaves neither behind: the launcher variables (RANK, MASTER_PORT, ...) a later test's `erpo train` or
    torchrun would inherit (a port that this process's group held), verl's `is_trl_available` its own again."""
    same_env, verl_check, built = verl_first[1]
    assert built.endswith("Qwen2ForCausalLM") and [same_env, verl_check] == ["True", "True"], verl_first
