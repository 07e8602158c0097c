"""DeepSpeed on a machine without CUDA builds no C++ op for erpo: its comm layer's shared-memory op is marked not
compatible (`erpo.deepspeed_internals.skip_cpu_shm_op`) and its AdamW is torch's (`"torch_adam": true`,
`erpo.distributed.deepspeed_config`), where it would otherwise JIT-build both into TORCH_EXTENSIONS_DIR (minutes of
CPU, and a C++ compiler on the user's machine). On CUDA the optimizer section stays DeepSpeed's (FusedAdam)."""
import os
import sys

import pytest
import torch

from erpo import distributed as D
from erpo.deepspeed_internals import skip_cpu_shm_op
from process_group import run_group
from test_resume import env, small_run_args

ADAMW = {"type": "AdamW", "params": {"lr": 1e-6, "betas": [0.9, 0.999], "weight_decay": 0.0}}


@pytest.mark.parametrize("offload", ["false", "true"], ids=["on-the-device", "optimizer-offloaded"])
def test_a_deepspeed_training_run_on_the_cpu_builds_no_op(tmp_path, offload):
    """`erpo train` at ZeRO-2 in one process on the CPU (DeepSpeed's engine, its comm layer and its AdamW), with and
    without `trainer.offload_optimizer`, with an empty TORCH_EXTENSIONS_DIR of its own: the run finishes, the folder is
    still empty (an op DeepSpeed built or began to build would be in it: fused_adam, or cpu_adam under offload), and
    the optimizer its checkpoint holds is torch's AdamW (its parameter group's keys are torch.optim.AdamW's options;
    FusedAdam's are lr, bias_correction, betas, eps and weight_decay; DeepSpeedCPUAdam's add amsgrad)."""
    pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    cmd = [sys.executable, "-m", "erpo", "train", "--output-dir", str(tmp_path / "run"),
           *small_run_args(tmp_path / "cache"), "trainer.updater=deepspeed", "trainer.zero_stage=2",
           "trainer.max_steps=1", f"trainer.offload_optimizer={offload}"]
    # a whole group: without the fix DeepSpeed's build goes on in compilers of its own after a timeout
    done = run_group(cmd, dict(env(), TORCH_EXTENSIONS_DIR=str(extensions)), timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert os.listdir(extensions) == [], f"DeepSpeed built ops on the CPU: {os.listdir(extensions)}"
    states = torch.load(tmp_path / "run" / "checkpoints" / "step-1" / "engine" /
                        "zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu", weights_only=False)
    group, = states["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]   # ZeRO-2's inner optimizer's
    assert set(group) - {"params", "initial_lr"} == set(torch.optim.AdamW([torch.zeros(1)]).defaults)


@pytest.mark.parametrize("cuda", [False, True])
def test_adam_is_torchs_without_cuda_and_deepspeeds_with_it(monkeypatch, cuda):
    """The optimizer section `deepspeed_config` writes: without CUDA an Adam / AdamW section asks for torch's
    optimizer, under optimizer offload too (a `torch_adam` the caller set is kept); with CUDA (FusedAdam, or
    DeepSpeedCPUAdam under offload) and for other optimizers, the section is the caller's as given. The caller's dict
    is never changed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    given = {"type": "AdamW", "params": dict(ADAMW["params"])}
    section = D.deepspeed_config(2, bf16=False, optimizer=given)["optimizer"]
    assert section == (ADAMW if cuda else {"type": "AdamW", "params": {"torch_adam": True, **ADAMW["params"]}})
    assert given == ADAMW
    adam = D.deepspeed_config(3, bf16=False, optimizer={"type": "adam", "params": {"lr": 1e-3}})["optimizer"]
    assert adam["params"] == ({"lr": 1e-3} if cuda else {"torch_adam": True, "lr": 1e-3})
    assert D.deepspeed_config(2, offload_optimizer=True, optimizer=given)["optimizer"] == section
    kept = {"type": "AdamW", "params": {"torch_adam": False, "lr": 1e-3}}
    assert D.deepspeed_config(2, optimizer=kept)["optimizer"] == kept
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    assert D.deepspeed_config(0, optimizer=sgd)["optimizer"] == sgd


def test_skip_cpu_shm_op_marks_only_the_shm_op_and_nothing_where_deepspeed_moved_it(monkeypatch):
    """Without CUDA the shared-memory op's entry of DeepSpeed's op compatibility turns False (the others kept); with
    CUDA nothing changes; where DeepSpeed no longer has the global, the call changes nothing and raises nothing."""
    ops = pytest.importorskip("deepspeed.ops", exc_type=ModuleNotFoundError)
    compatible = {"deepspeed_shm_comm": True, "fused_adam": True}
    monkeypatch.setattr(ops, "__compatible_ops__", compatible, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    skip_cpu_shm_op()
    assert compatible == {"deepspeed_shm_comm": True, "fused_adam": True}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    skip_cpu_shm_op()
    assert compatible == {"deepspeed_shm_comm": False, "fused_adam": True}

    def moved(name):
        raise AttributeError(f"module 'deepspeed.ops' has no attribute {name!r}")
    monkeypatch.delattr(ops, "__compatible_ops__")
    monkeypatch.setattr(ops, "__getattr__", moved, raising=False)
    skip_cpu_shm_op()
