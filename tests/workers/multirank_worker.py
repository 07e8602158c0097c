"""One ERPO optimizer update under DeepSpeed, launched by tests/distributed/test_multirank.py through torchrun, for
each --case STAGE:LOSS_AGG in turn (a ZeRO stage and a loss aggregation; one launch serves several cases, its ~30 s
of imports paid once).

Each rank takes whole prompt groups of the global batch (erpo.distributed.shard), computes group-relative
advantages locally, all-reduces the token-mean normalizers and scales its loss for DeepSpeed's gradient
averaging. Rank 0 writes, per case, the updated full parameters, the global loss and the gradient norm to --out.
Each case then checks the checkpoint round trip in --ckpt-root/zSTAGE-ckpt: save after update 1, run update 2, load,
run update 2 again (both results written), and exports the final model with erpo.models.export.export_hf.
The weight sync of erpo.rollout.vllm.VLLMRollout is exercised against tests/support/fake_vllm.py; the loss and the
optimizer are tests/support/rank_update.py's.
"""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM

import fake_vllm
from erpo import distributed as D
from erpo.models.export import export_hf
from erpo.models.weights import gathered_state_dict
from erpo.rollout.vllm import VLLMRollout
from erpo.train.checkpoint import CheckpointManager
from rank_update import make_optimizer, rank_loss
from torchrun import finish_worker


def local_update(engine, batch, sample_ids, loss_agg):
    """Forward/backward/step on this rank's samples; returns the global loss (all-reduced)."""
    loss = rank_loss(engine, batch, sample_ids, loss_agg)
    engine.backward(loss * D.data_parallel_loss_scale())
    engine.step()
    return D.all_reduce_sum(loss.detach()).item()


def update_case(args, batch, sample_ids, groups, zero_stage: int, loss_agg: str) -> dict:
    """One case on this rank: the update, the reference model, the weight sync, the checkpoint round trip."""
    config = D.deepspeed_config(zero_stage, bf16=False, grad_clip=None, micro_batch=len(sample_ids))
    zero3_init = D.hf_deepspeed_config(config)  # alive while models are created: born partitioned at ZeRO-3
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    born_partitioned = all(D.is_zero3_param(p) for p in model.parameters())
    optimizer, scheduler = make_optimizer(model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)

    result = {"loss": local_update(engine, batch, sample_ids, loss_agg),
              "grad_norm": float(engine.get_global_grad_norm()), "born_partitioned": born_partitioned,
              "params": gathered_state_dict(engine.module)}
    # Reference model (frozen, ZeRO-3-partitioned inference engine at stage 3): its log-probs on this rank's
    # samples must equal the unpartitioned initial model's (computed by the test).
    reference = D.prepare_reference_model(AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32),
                                          config)
    with torch.no_grad():
        ids = batch["input_ids"][sample_ids]
        logp = reference(input_ids=ids, attention_mask=batch["attention_mask"][sample_ids]).logits.log_softmax(-1)
        ref_token_logp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref_error = (ref_token_logp - batch["initial_token_logp"][sample_ids][:, :-1]).abs().max()
    result["reference_max_error"] = float(D.all_reduce_sum(ref_error))
    result["reference_partitioned"] = all(D.is_zero3_param(p) for p in reference.parameters())
    del zero3_init
    fake_vllm.install()
    rollout = VLLMRollout(args.model_dir)  # recording fake: checks the ZeRO-gathered weight sync
    rollout.sync_weights(engine)
    result["vllm_loaded"] = rollout.llm.model.loaded
    result["vllm_init"] = {k: str(v) for k, v in rollout.llm.kwargs.items()}
    ckpt_dir = os.path.join(args.ckpt_root, f"z{zero_stage}-ckpt")
    manager = CheckpointManager(ckpt_dir, keep_last=2)
    manager.save(1, engine, {"prompts_consumed": len(groups)})
    result["rng_after_save"] = torch.rand(3)
    torch.manual_seed(1234)  # perturb the RNG: load must restore it
    local_update(engine, batch, sample_ids, loss_agg)
    result["step2"] = gathered_state_dict(engine.module)
    state = manager.load(engine)
    result["loaded_state"] = state
    result["rng_after_load"] = torch.rand(3)
    local_update(engine, batch, sample_ids, loss_agg)
    result["step2_resumed"] = gathered_state_dict(engine.module)
    export_hf(engine, None, os.path.join(ckpt_dir, "final"))
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", required=True, metavar="STAGE:LOSS_AGG",
                        help="a ZeRO stage and a loss aggregation, e.g. 3:seq-mean-token-mean; run in the given order")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--batch", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-root", required=True)
    args = parser.parse_args()

    D.init_distributed("gloo")
    batch = torch.load(args.batch, weights_only=True)
    n = batch["group_size"]
    groups = list(range(batch["input_ids"].shape[0] // n))
    sample_ids = torch.tensor([g * n + j for g in D.shard(groups, D.rank(), D.world_size()) for j in range(n)])
    results = {}
    for case in args.case:
        stage, loss_agg = case.split(":")
        results[case] = update_case(args, batch, sample_ids, groups, int(stage), loss_agg)
    finish_worker(results, args.out)


if __name__ == "__main__":
    main()
