"""One SGD step with the fused-linear ERPO loss under DeepSpeed, for each ZeRO stage of the command line in turn (one
launch, its imports paid once), launched by tests/distributed/test_zero3.py through torchrun with 2 CPU processes
(gloo).

For a tiny LM with an untied biased lm_head and one whose lm_head is tied to the input embedding, every rank
computes hidden states on its own rows, the fused loss with `whole_lm_head` (ZeRO-3: `gathered_lm_head`),
`engine.backward` inside the block, and `engine.step()`. Rank 0 writes the gathered parameters after the step, the
global loss, and what the lm_head looked like outside the block (an empty shard under ZeRO-3) to --out, and the
error a backward run after the block gets.
"""
import argparse

import deepspeed
import torch
import torch.distributed as dist

from erpo.deepspeed_internals import skip_cpu_shm_op
from erpo_kernels.lm_head import whole_lm_head
from lm_head_workers import DIM, GRADED_OPTIONS, TinyLM, batch_loss, rank_batch
from torchrun import finish_worker


class MixLM(TinyLM):
    """Embedding -> MLP block -> hidden states; `lm_head` is not used by forward (as with `model.model(...)`)."""

    def add_body(self):
        self.mix = torch.nn.Linear(DIM, DIM)

    def forward(self, ids):
        return torch.tanh(self.mix(self.embed(ids)))


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


def one_step(tied: bool, stage: int) -> dict:
    torch.manual_seed(0)
    model = MixLM(tied)
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(stage))
    batch = rank_batch(dist.get_rank())
    hidden = engine(batch["ids"][:-1])
    shard = engine.module.lm_head.weight  # read outside any forward: an empty shard under ZeRO-3
    shard_numel, shard_error = shard.numel(), ""
    if shard_numel == 0:
        try:
            batch_loss(hidden, shard, batch)
        except ValueError as error:
            shard_error = str(error)
    with whole_lm_head(engine) as (weight, bias):
        gathered_shape = tuple(weight.shape)
        out = batch_loss(hidden, weight, batch, bias=bias, **GRADED_OPTIONS)
        engine.backward(out.loss)
    engine.step()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    params = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            params[name] = param.detach().clone()
    return {"loss": loss / dist.get_world_size(), "params": params, "initial": initial, "shard_numel": shard_numel,
            "shard_error": shard_error,
            "gathered_shape": gathered_shape, "backward_outside_error": backward_outside_block(engine, batch)}


def backward_outside_block(engine, batch) -> str:
    """The error a backward after the block gets (ZeRO-3 re-partitioned the weight); '' when it runs."""
    hidden = engine(batch["ids"][:-1])
    with whole_lm_head(engine) as (weight, bias):
        loss = batch_loss(hidden, weight, batch, bias=bias, backend="torch").loss
    try:
        engine.backward(loss)
    except RuntimeError as error:
        return str(error)
    finally:
        engine.optimizer.zero_grad()
    return ""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero-stages", type=int, nargs="+", required=True, help="run in this order")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    skip_cpu_shm_op()   # DeepSpeed's comm layer without its shared-memory op: nothing to build on the CPU
    deepspeed.init_distributed(dist_backend="gloo")
    result = {stage: {tied: one_step(tied, stage) for tied in (False, True)} for stage in args.zero_stages}
    finish_worker(result, args.out)


if __name__ == "__main__":
    main()
