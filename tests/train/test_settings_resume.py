"""Every documented setting of `erpo train` trains, saves and resumes: each case below runs 2 rollout steps (4
optimizer steps: 2 updates per rollout step) keeping a checkpoint per step, then goes back to the step-1 checkpoint
(step 2's checkpoint, metrics and export removed) and resumes: the resumed step logs what the uninterrupted one did.
Together the cases cover each preset (Query-KL on and off, the policy KL's live reference), each query-weight mode,
each policy term (pg_objective), both ratio levels, the k3-token estimator, LoRA with adapter dropout, bf16 weights,
gradient accumulation over micro-batches and a loss workspace other than the default. Adapter dropout is the one
setting here whose updates draw from the global RNG (sampling and data order are seeded from trainer.seed and the
step), so its case is the one that fails when a resume does not restore the checkpoint's RNG states. The default
setting is tests/train/test_resume.py's, whose runs are child processes as a user starts them (these run `erpo train`
in this process: the same command line; a child process would add 5 s of imports to each run and check nothing
more)."""
import json
import shutil

import pytest

from run_metrics import metrics_by_step
from test_resume import assert_same_metrics, erpo_train_here

CASES = {
    "grpo-policy-kl-seq-mean": ("algorithm.name=grpo", "algorithm.loss_agg=seq-mean-token-mean"),
    "erpo-current-cispo-accumulation-workspace": ("algorithm.query_weight=current", "algorithm.pg_objective=cispo",
                                                  "trainer.micro_batch_size=1", "trainer.loss_workspace_mib=2"),
    "grpo+qw-sapo-bf16": ("algorithm.name=grpo+qw", "algorithm.pg_objective=sapo", "model.dtype=bfloat16"),
    "grpo+qkl-unclipped-vespo-lora-dropout": ("algorithm.name=grpo+qkl", "algorithm.query_weight=current-unclipped",
                                              "algorithm.pg_objective=vespo", "model.lora.rank=4",
                                              "model.lora.dropout=0.5"),
    "erpo-k3-token-sequence-ratio": ("algorithm.qkl_estimator=k3-token", "algorithm.ratio_level=sequence",
                                     "algorithm.qkl_coef=0.5"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_setting_trains_saves_and_resumes(tmp_path, case):
    sets = CASES[case]
    run, cache = tmp_path / "run", tmp_path / "cache"
    erpo_train_here(run, cache, "--max-steps", "2", sets=sets)
    full = metrics_by_step(run)
    assert sorted(full) == [1, 2, 3, 4] and len({round(r["loss"], 12) for r in full.values()}) > 1
    assert (run / "checkpoints" / "step-2").is_dir() and exported(run)

    shutil.rmtree(run / "checkpoints" / "step-2")          # back to the end of rollout step 1
    shutil.rmtree(run / "final")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines
                                               if json.loads(line)["rollout_step"] == 1))
    erpo_train_here(run, cache, "--max-steps", "2", "--resume", sets=sets)
    resumed = metrics_by_step(run)
    assert sorted(resumed) == [1, 2, 3, 4]
    assert_same_metrics(resumed, full)
    assert (run / "checkpoints" / "step-2").is_dir() and exported(run)


def exported(run) -> bool:
    """Whether the run exported its final model (the weights, or a LoRA run's adapter)."""
    return any((run / "final" / name).is_file() for name in ("config.json", "adapter_config.json"))
