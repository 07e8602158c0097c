"""Every documented setting of ERPOTrainer trains, saves and resumes: each case runs train() for 2 optimizer steps with
a checkpoint after each, then a new trainer resumes from checkpoint-1 and logs at step 2 what the uninterrupted run
logged, ending with its weights. The cases cover each TRL loss type, the Query-KL on and off, each query-weight mode,
the fused-linear path (with a loss workspace other than the default) and the logits path, a LoRA adapter
(peft_config), bf16 autocast and gradient accumulation."""
import math

import datasets
import pytest
import torch

pytest.importorskip("trl", exc_type=ModuleNotFoundError)

from erpo.integrations.trl import ERPOConfig, ERPOTrainer  # noqa: E402
from trl_runs import PROMPTS, reward_length  # noqa: E402

GA = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)
CASES = {
    "grpo-qkl-static-fused-workspace": dict(loss_type="grpo", qkl_coef=0.5, query_weight="static",
                                            loss_workspace_mib=2),
    "bnpo-off-none-logits-accumulation": dict(loss_type="bnpo", qkl_coef=0.0, query_weight="none",
                                              fused_linear=False, **GA),
    "dr_grpo-qkl-current-fused-bf16": dict(loss_type="dr_grpo", qkl_coef=0.5, query_weight="current", bf16=True),
    "dapo-off-current-logits": dict(loss_type="dapo", qkl_coef=0.0, query_weight="current", fused_linear=False),
    "luspo-qkl-none-fused-lora": dict(loss_type="luspo", qkl_coef=0.5, query_weight="none", lora=True),
    "cispo-off-static-logits-bf16": dict(loss_type="cispo", epsilon_high=1.0, qkl_coef=0.0, query_weight="static",
                                         fused_linear=False, bf16=True),
    "sapo-qkl-static-fused-accumulation": dict(loss_type="sapo", qkl_coef=0.5, query_weight="static", **GA),
    "vespo-qkl-static-logits": dict(loss_type="vespo", qkl_coef=0.5, query_weight="static", fused_linear=False),
}


def trainer_for(tiny, output_dir, lora=False, **settings):
    args = ERPOConfig(**{**dict(output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=2,
                                max_completion_length=4, report_to=[], use_cpu=True, logging_steps=1,
                                save_strategy="steps", save_steps=1, seed=0, bf16=False, learning_rate=3e-2,
                                max_steps=2, temperature=1.0), **settings})
    peft_config = None
    if lora:
        peft = pytest.importorskip("peft", exc_type=ModuleNotFoundError)
        peft_config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS]
    return ERPOTrainer(model=tiny[0], reward_funcs=reward_length, args=args, processing_class=tiny[1],
                       train_dataset=datasets.Dataset.from_list(rows), peft_config=peft_config)


def logged(trainer) -> dict[int, dict]:
    return {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}


@pytest.mark.parametrize("case", list(CASES))
def test_setting_trains_saves_and_resumes(tiny, tmp_path, case):
    trainer = trainer_for(tiny, tmp_path, **CASES[case])
    trainer.train()
    full = logged(trainer)
    assert sorted(full) == [1, 2] and all(math.isfinite(entry["loss"]) for entry in full.values())
    assert (tmp_path / "checkpoint-2").is_dir()
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}

    resumed = trainer_for(tiny, tmp_path, **CASES[case])
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    again = logged(resumed)   # step 1's entry comes from checkpoint-1, step 2's from the resumed train()
    assert sorted(again) == [1, 2] and resumed.state.global_step == 2
    for key in ("loss", "qkl", "grad_norm", "reward"):
        if key in full[2]:
            assert again[2][key] == pytest.approx(full[2][key], rel=1e-4, abs=1e-6), key
    for name, p in resumed.model.named_parameters():   # the optimizer's state came back too
        torch.testing.assert_close(p.detach(), weights[name], rtol=1e-4, atol=1e-6, msg=name)
