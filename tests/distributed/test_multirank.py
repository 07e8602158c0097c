"""Data-parallel correctness under DeepSpeed on CPU (gloo): one ERPO update on 2 ranks equals 1 rank.

The cases run in one launch of tests/workers/multirank_worker.py with torchrun (2 processes) on a tiny Qwen2 model
saved locally; each is compared with the same update done in this process by plain torch on the whole batch.
The 2-rank run also checks the frozen reference model (a partitioned inference engine at ZeRO-3), the vLLM
weight sync against a fake vLLM, the DeepSpeed checkpoint round trip (model, ZeRO optimizer state, LR
scheduler, RNG) and the ZeRO-3 gathered Hugging Face export. The later tests run `erpo train` itself under
the deepspeed launcher and torchrun: a SIGKILLed launcher (its ranks run on; a second writer is refused), a SIGKILLed
rank (the job ends; a truncated shard of rank 1 is skipped on resume) and a full disk on rank 1 during a save of the
deepspeed launcher's run resumed under torchrun (every rank stops in one line; the previous checkpoint resumes
exactly).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)

from transformers import AutoModelForCausalLM  # noqa: E402

from damage import truncate  # noqa: E402
from erpo.models.tiny import build_model, build_tokenizer  # noqa: E402
from paths import WORKERS, worker_pythonpath  # noqa: E402
from process_group import kill_group, run_group, wait_gone  # noqa: E402
from rank_update import make_optimizer, rank_loss  # noqa: E402
from run_metrics import assert_same_metrics, metrics_by_step  # noqa: E402
from torchrun import RANKS_LIMIT_S, free_port, run_worker  # noqa: E402

WORKER = WORKERS / "multirank_worker.py"
GROUPS, GROUP_SIZE, LENGTH = 4, 2, 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved tiny model and a global batch of 4 prompt groups x 2 responses, with reference log-probs
    taken from the initial model plus noise (so the KL terms are small but non-zero)."""
    root = tmp_path_factory.mktemp("multirank")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64)
    model.save_pretrained(root / "model")
    g = torch.Generator().manual_seed(0)
    samples = GROUPS * GROUP_SIZE
    ids = torch.randint(3, len(tokenizer), (samples, LENGTH), generator=g)
    mask = torch.ones(samples, LENGTH, dtype=torch.long)
    response = torch.zeros(samples, LENGTH, dtype=torch.long)
    for s in range(samples):  # right padding, prompts of 3-5 tokens, responses of 2-7 tokens
        prompt_len, response_len = 3 + s % 3, 2 + (s * 5) % 6
        mask[s, prompt_len + response_len:] = 0
        response[s, prompt_len:prompt_len + response_len] = 1
    with torch.no_grad():
        logp = model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)
    token_logp = torch.zeros(samples, LENGTH)
    token_logp[:, :-1] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    query_rows = torch.zeros(samples, LENGTH, dtype=torch.bool)
    query_rows[:, :-1] = mask[:, 1:].bool() & mask[:, :-1].bool() & ~response[:, 1:].bool()
    batch = dict(group_size=GROUP_SIZE, input_ids=ids, attention_mask=mask, response_mask=response,
                 rewards=torch.rand(samples, generator=g),
                 ref_query_logp=(token_logp * query_rows).sum(1) + 0.3 * torch.randn(samples, generator=g),
                 query_weight=torch.rand(samples, generator=g) * 2,
                 ref_logp=token_logp + 0.2 * torch.randn(samples, LENGTH, generator=g),
                 initial_token_logp=token_logp)
    torch.save(batch, root / "batch.pt")
    return root


# The cases of test_two_ranks_match_one_rank, in the order one 2-rank job runs them (ZeRO-3's partitioned model
# creation last: it leaves DeepSpeed's patches in the process)
UPDATE_CASES = [(2, "token-mean"), (3, "seq-mean-token-mean")]


@pytest.fixture(scope="module")
def two_rank_updates(setup) -> dict:
    """Every UPDATE_CASES case's update on 2 ranks, in one torchrun job of tests/workers/multirank_worker.py: rank 0's
    results by case ("STAGE:LOSS_AGG"), each case's checkpoint and export in setup/zSTAGE-ckpt."""
    # the ZeRO-3 case's partitioned creation (transformers' HfDeepSpeedConfig) needs it
    pytest.importorskip("accelerate", exc_type=ModuleNotFoundError)
    cases = [arg for stage, loss_agg in UPDATE_CASES for arg in ("--case", f"{stage}:{loss_agg}")]
    return run_worker(WORKER, setup / "updates.pt", *cases, "--model-dir", str(setup / "model"), "--batch",
                      str(setup / "batch.pt"), "--ckpt-root", str(setup), nproc=2)


def assert_params_close(actual: dict, expected: dict, atol: float, rtol: float):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def single_process_update(root: Path, loss_agg: str) -> dict:
    """The reference: one update on the full batch, one process, no DeepSpeed."""
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    optimizer, scheduler = make_optimizer(model)
    batch = torch.load(root / "batch.pt", weights_only=True)
    loss = rank_loss(model, batch, torch.arange(batch["input_ids"].shape[0]), loss_agg)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    optimizer.step()
    scheduler.step()
    return {"loss": loss.item(), "grad_norm": grad_norm.item(),
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("zero_stage,loss_agg", UPDATE_CASES)
def test_two_ranks_match_one_rank(setup, two_rank_updates, zero_stage, loss_agg):
    initial = AutoModelForCausalLM.from_pretrained(setup / "model").state_dict()
    one = single_process_update(setup, loss_agg)
    two = two_rank_updates[f"{zero_stage}:{loss_agg}"]

    # The update is real (not a no-op) and the same on both layouts.
    moved = max((one["params"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert_params_close(two["params"], one["params"], atol=1e-6, rtol=1e-5)
    assert two["born_partitioned"] == (zero_stage == 3)

    # Frozen reference model: partitioned at ZeRO-3, same log-probs as the unpartitioned initial model.
    assert two["reference_partitioned"] == (zero_stage == 3)
    assert two["reference_max_error"] < 1e-5

    # vLLM weight sync (recording fake vLLM): every parameter, gathered whole from the ZeRO shards.
    named = dict(AutoModelForCausalLM.from_pretrained(setup / "model").named_parameters())
    assert sorted(two["vllm_loaded"]) == sorted(named)
    for name, tensor in two["vllm_loaded"].items():
        assert torch.equal(tensor, two["params"][name]), name
    assert two["vllm_init"]["distributed_executor_backend"] == "external_launcher"

    # DeepSpeed checkpoint round trip on 2 ranks: resuming from step 1 repeats step 2 bit for bit.
    assert two["loaded_state"] == {"prompts_consumed": GROUPS, "step": 1}
    assert torch.equal(two["rng_after_load"], two["rng_after_save"])
    assert_params_close(two["step2_resumed"], two["step2"], atol=0.0, rtol=0.0)
    assert max((two["step2"][k] - two["params"][k]).abs().max().item() for k in initial) > 1e-4

    # ZeRO-gathered export loads in transformers with the trained weights.
    exported = AutoModelForCausalLM.from_pretrained(setup / f"z{zero_stage}-ckpt" / "final").state_dict()
    assert_params_close(exported, two["step2_resumed"], atol=0.0, rtol=0.0)


# No trainer.updater: with several ranks (or --zero-stage 3) the automatic choice must be DeepSpeed.
TRAIN_SETTINGS = ["--zero-stage", "3", "--seed", "3", "--save-steps", "1", "--set",
                  "tiny.sft_steps=5", "tiny.sft_examples=64", "data.num_examples=32", "trainer.rollout_batch_size=4",
                  "trainer.update_batch_size=2", "trainer.micro_batch_size=4", "trainer.min_lr_ratio=1.0",
                  "rollout.n=2", "rollout.max_new_tokens=8", "logging.tensorboard=false",
                  "logging.progress_bar=false", "logging.plot=false"]


def train_command_2ranks(launcher: str, out: Path, cache: Path, *extra: str) -> tuple[list[str], dict]:
    """Command and environment of `erpo train` on 2 CPU ranks at ZeRO-3, launched as documented for `launcher`."""
    if launcher == "deepspeed":  # without --no_local_rank: the launcher inserts --local_rank=N before `train`
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--module", "erpo"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "erpo"]
    cmd += ["train", "--output-dir", str(out), *extra, *TRAIN_SETTINGS, f"model.cache_dir={cache}"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=worker_pythonpath())
    return cmd, env


def erpo_train_2ranks(launcher: str, out: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    """`erpo train` on 2 CPU ranks at ZeRO-3, with the documented launch command of `launcher`; it must succeed."""
    cmd, env = train_command_2ranks(launcher, out, cache, *extra)
    proc = run_group(cmd, env, RANKS_LIMIT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def torchrun_until_checkpoint(out: Path, cache: Path, step: int, log: Path) -> tuple[subprocess.Popen, list[int]]:
    """A 3-step `erpo train` under torchrun, once its checkpoint `step` exists: the launcher and its 2 ranks' pids.
    The launcher leads a session of its own: the caller ends what is left of the job with `kill_group(launcher)`."""
    cmd, env = train_command_2ranks("torchrun", out, cache, "--max-steps", "3")
    with open(log, "w") as stderr:   # the launcher keeps its own copy of the descriptor
        launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / f"step-{step}").is_dir():
            assert launcher.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        ranks = child_pids(launcher.pid)
        assert len(ranks) == 2, ranks
        return launcher, sorted(ranks, key=rank_of)
    except BaseException:
        kill_group(launcher)
        raise


def child_pids(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return children


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(item for item in environ if item.startswith(b"RANK=")).split(b"=")[1])


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """2 rollout steps of `erpo train` under the deepspeed launcher (2 CPU ranks, ZeRO-3)."""
    root = tmp_path_factory.mktemp("cli2")
    erpo_train_2ranks("deepspeed", root / "run", root / "cache", "--max-steps", "2")
    return root


@pytest.fixture(scope="module")
def three_step_run(two_step_run):
    """The uninterrupted 3-step run (under torchrun) the resumed ones must reproduce: `.dir`. Its launcher is
    SIGKILLed once step 1 is saved; torchrun's ranks outlive it and run on undisturbed to the end. While they are
    held (SIGSTOP), a second `erpo train --resume` of that directory is tried: `.second` (the CompletedProcess),
    `.ranks` (pids, in rank order)."""
    root = two_step_run
    out = root / "full"
    launcher, ranks = torchrun_until_checkpoint(out, root / "cache", 1, root / "full.log")
    try:
        launcher.kill()
        assert launcher.wait(timeout=30) == -signal.SIGKILL
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)      # alive and holding the lock: no race with the run's own end
        try:
            cmd, env = train_command_2ranks("torchrun", out, root / "cache", "--max-steps", "3", "--resume")
            second = subprocess.run([sys.executable, "-m", "erpo", *cmd[cmd.index("train"):]], env=env,
                                    capture_output=True, text=True, timeout=RANKS_LIMIT_S)
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        wait_gone(ranks, timeout=RANKS_LIMIT_S)
    finally:   # the orphaned ranks, where the test failed before they finished
        kill_group(launcher)
    assert (out / "final" / "config.json").is_file(), (root / "full.log").read_text()[-6000:]
    return SimpleNamespace(dir=out, second=second, ranks=ranks)


def test_erpo_train_under_deepspeed_launcher_zero3(two_step_run):
    """The documented launch trains, checkpoints with DeepSpeed and exports a whole model."""
    out = two_step_run / "run"
    records = metrics_by_step(out)
    assert len(records) == 4                                   # written once (rank 0), 2 updates per rollout
    assert all(r["num_samples"] == 4 for r in records.values())  # global counts: 2 prompts x 2 responses
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
    engine_files = sorted(p.name for p in (out / "checkpoints" / "step-2" / "engine").iterdir())
    assert any("rank_1" in name for name in engine_files)      # DeepSpeed's partitioned optimizer states
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert all(p.numel() > 0 for p in final.parameters())      # gathered, not ZeRO-3 placeholders


def test_killing_the_launcher_leaves_its_ranks_running_and_a_second_writer_out(three_step_run):
    """torchrun SIGKILLed: its ranks do not die with it (they finished the run: see the fixture), so a re-submitted
    `erpo train --resume` meanwhile must not write the same directory: refused in one line naming rank 0."""
    second = three_step_run.second
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr[-4000:]
    [line] = [line for line in second.stderr.splitlines() if line.startswith("erpo train:")]
    assert f"erpo train: --output-dir {three_step_run.dir}: another run is writing it (host " in line
    assert f", pid {three_step_run.ranks[0]}, since " in line
    assert sorted(metrics_by_step(three_step_run.dir)) == list(range(1, 7))
    assert not (three_step_run.dir / "run.lock").exists()


def test_a_killed_rank_ends_the_job_and_a_truncated_shard_of_rank_1_is_skipped(two_step_run, three_step_run):
    """Rank 1 SIGKILLed after checkpoint step 2: torchrun ends the whole job within seconds. Then rank 1's ZeRO
    optimizer shard of step 2 is cut in half (what a full disk or a preempted copy leaves): on --resume both ranks
    check their share of the files before DeepSpeed loads anything, agree, and resume from step 1 with one warning
    line naming the file; the run then logs what the uninterrupted one logs."""
    root = two_step_run
    run = root / "killed"
    launcher, ranks = torchrun_until_checkpoint(run, root / "cache", 2, root / "killed.log")
    try:
        os.kill(ranks[1], signal.SIGKILL)
        assert launcher.wait(timeout=60) != 0
        assert wait_gone(ranks, timeout=60) < 60
    finally:
        kill_group(launcher)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")) == [
        "step-1", "step-2"]
    [shard] = (run / "checkpoints" / "step-2" / "engine").glob("*rank_1*optim_states.pt")
    truncate(shard)
    proc = erpo_train_2ranks("torchrun", run, root / "cache", "--max-steps", "3", "--resume")
    warnings = [line for line in proc.stderr.splitlines() if " is damaged " in line]
    assert len(warnings) == 1, warnings                          # rank 0 says it, once
    assert f"checkpoint {run / 'checkpoints' / 'step-2'} is damaged (engine/{shard.name}: " in warnings[0]
    assert "Traceback" not in proc.stderr
    assert_same_metrics(metrics_by_step(run), metrics_by_step(three_step_run.dir))
    assert not (run / "run.lock").exists()                       # rank 0 held it, and released it


def test_a_full_disk_on_rank_1_stops_every_rank_in_one_line_and_the_previous_checkpoint_resumes(two_step_run,
                                                                                                  three_step_run):
    """The 2-step run (a copy) resumed to 3 steps under torchrun, where rank 1 alone finds the disk full while
    DeepSpeed writes its ZeRO optimizer shard of checkpoint step 3 (ENOSPC injected into its torch.save): the ranks
    agree after the save's writes, so none waits in a collective for a rank that gave up. Each rank's stderr (torchrun
    --redirects keeps them apart) holds one line and no traceback: rank 1 the file and the cause, rank 0 that the save
    stopped on rank 1; the half-written step-3 is removed, the lock released, torchrun reports the failed ranks (its
    own ChildFailedError report, the only traceback). --resume from step 2 then logs what the uninterrupted 3-step run
    logs: the exact resume of ZeRO-3 on 2 ranks (DeepSpeed's partitioned model/optimizer/scheduler state, every rank's
    RNG and the data position, saved under the deepspeed launcher, loaded under torchrun)."""
    root = two_step_run
    run, logs = root / "full-disk", root / "full-disk-logs"
    shutil.copytree(root / "run", run)
    cmd, env = train_command_2ranks("torchrun", run, root / "cache", "--max-steps", "3", "--resume")
    module = cmd.index("erpo") - 1   # `-m erpo` becomes the script that injects the fault, each rank's stderr a file
    cmd[module:module + 2] = ["--log-dir", str(logs), "--redirects", "2", str(WORKERS / "enospc_rank_train.py")]
    env.update(ERPO_TEST_ENOSPC_RANK="1", ERPO_TEST_ENOSPC_STEP="3")
    proc = run_group(cmd, env, RANKS_LIMIT_S)
    assert proc.returncode == 1, proc.stderr[-6000:]
    stderr = {rank: next(logs.glob(f"*/attempt_0/{rank}/stderr.log")).read_text() for rank in (0, 1)}
    shard = run / "checkpoints" / ".tmp-step-3" / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    advice = "the previous checkpoints are intact: free space or fix the storage, then continue with --resume"
    expected = {1: f"erpo train: saving checkpoint step-3 failed: {shard}: No space left on device; {advice}",
                0: (f"erpo train: saving checkpoint step-3 stopped: rank 1 could not write its files ({shard}: "
                    f"No space left on device); {advice}")}
    for rank, text in stderr.items():
        assert "Traceback" not in text, (rank, text[-6000:])
        errors = [line for line in text.splitlines() if line.startswith("erpo train:") or " ERROR " in line]
        assert errors == [expected[rank]], (rank, text[-3000:])
    launcher = proc.stderr   # torchrun's report of a failed child: a traceback of its own, naming rank 1 first
    assert launcher.count("Traceback") == 1 and "ChildFailedError" in launcher, launcher[-6000:]
    assert "Root Cause (first observed failure)" in launcher
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert not (run / "run.lock").exists()
    erpo_train_2ranks("torchrun", run, root / "cache", "--max-steps", "3", "--resume")
    assert_same_metrics(metrics_by_step(run), metrics_by_step(three_step_run.dir))


def test_a_nonfinite_loss_on_one_rank_skips_the_step_everywhere(tmp_path):
    """Rank 1 alone sees a NaN loss: both ranks still run every backward (ZeRO-3 reduces inside it, so a rank
    that skipped one would leave the other waiting forever), the step is discarded on both and training goes on."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(WORKERS / "nan_rank_train.py"), "train",
           "--output-dir", str(out), "--max-steps", "1", *TRAIN_SETTINGS, f"model.cache_dir={tmp_path / 'cache'}"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=worker_pythonpath())
    proc = run_group(cmd, env, RANKS_LIMIT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    records = metrics_by_step(out)
    assert records[1]["nonfinite_skipped"] == 1 and records[1]["grad_norm"] is None
    assert records[2]["nonfinite_skipped"] == 1 and records[2]["grad_norm"] is not None


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_lora_grpo_on_two_ranks(tmp_path, zero_stage):
    """LoRA under DeepSpeed ZeRO-2 / ZeRO-3 on 2 ranks, with GRPO's Policy-KL against the policy's adapters switched
    off: it trains, the adapters are exported, and the merged model is theta0 wherever no adapter sits."""
    reward = tmp_path / "varied_reward.py"   # the barely warm-started model is never correct: a reward that varies
    reward.write_text("def varied(prompts, completions, **columns):\n"
                      "    return [sum(map(ord, c)) % 7 / 7 for c in completions]\n")
    out = tmp_path / "run"
    erpo_train_2ranks("torchrun", out, tmp_path / "cache", "--max-steps", "1", "--algorithm", "grpo", "--set",
                      "model.lora.rank=4", "model.lora.export_merged=true", f"trainer.zero_stage={zero_stage}",
                      "trainer.lr=0.01", f"reward.functions=[{reward}:varied]")
    records = metrics_by_step(out)
    assert sorted(records) == [1, 2] and records[1]["policy_kl"] == pytest.approx(0.0, abs=1e-6)
    assert records[2]["policy_kl"] > 0 and records[2]["qkl"] is not None and records[2]["reward"] is not None
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    theta0 = dict(AutoModelForCausalLM.from_pretrained(adapter["base_model_name_or_path"]).named_parameters())
    merged = dict(AutoModelForCausalLM.from_pretrained(out / "final" / "merged").named_parameters())
    adapted = {name for name in theta0 if name.split(".")[-2] in adapter["target_modules"]
               and name.endswith(".weight")}
    assert adapted and all(not torch.equal(merged[n], theta0[n]) for n in adapted)
    assert all(torch.equal(merged[n], theta0[n]) for n in theta0.keys() - adapted)
