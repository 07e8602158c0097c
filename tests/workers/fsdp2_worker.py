"""One forward and backward of the fused-linear ERPO loss under FSDP2 (`fully_shard` on every layer and on the
root), launched by tests/distributed/test_fsdp2.py through torchrun with 2 CPU processes (gloo).

For each lm_head layout (untied with a bias, tied to the input embedding, untied in its own `fully_shard` unit, and
accelerate's FSDP2 layout, which TRL uses: the embedding in its own unit, the head in one kept unsharded after its
forward, the backward run after the block as TRL runs it) and each parameter dtype (fp32, bf16), every rank computes
hidden states on its own rows, the fused loss with `whole_lm_head` and its backward inside the block (after it for
accelerate's layout). Each rank also runs the same model unsharded (a copy taken before `fully_shard`) on every
rank's rows, one backward per rank's rows. Rank 0 writes to --out, per case: the ranks' losses, the full gradients
FSDP2 left in the shards (`full_tensor()`), the unsharded run's losses and gradients per rank's rows, whether
lm_head.weight was a DTensor outside the block, and the error passing that DTensor to the loss gives; and the error
`whole_lm_head` gives for a DTensor lm_head no `fully_shard` holds.
"""
import argparse
import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from erpo_kernels.lm_head import is_dtensor, whole_lm_head
from lm_head_workers import DIM, GRADED_OPTIONS, ROWS_PER_RANK, VOCAB, TinyLM, batch_loss, rank_batch
from torchrun import finish_worker

LAYERS = 2
LAYOUTS = ("untied", "tied", "own_unit", "accelerate")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.mix(x))


class LayersLM(TinyLM):
    """Embedding -> residual blocks -> hidden states [N, D]. The forward also runs `lm_head` on the last position,
    whose logits nobody uses (as erpo's `final_hidden_and_output` with logits_to_keep=1); the fused loss reads
    the head's weight."""

    def add_body(self):
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        self.lm_head(x[-1:])
        return x


def loss_of(hidden, weight, bias, batch):
    return batch_loss(hidden, weight, batch, bias=bias, **GRADED_OPTIONS).loss


def sharded_error(model: LayersLM, dtype: torch.dtype) -> str:
    """The error the loss gives for lm_head.weight passed as the DTensor shard FSDP2 leaves outside the forward."""
    try:
        loss_of(torch.zeros(ROWS_PER_RANK, DIM, dtype=dtype), model.lm_head.weight, None, rank_batch(0))
    except ValueError as error:
        return str(error)
    return ""


def unowned_dtensor_error() -> str:
    """The error `whole_lm_head` gives for an lm_head whose weight is a DTensor that no `fully_shard` module holds."""
    head = torch.nn.Linear(DIM, VOCAB)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    head.weight = torch.nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))
    try:
        with whole_lm_head(head):
            pass
    except ValueError as error:
        return str(error)
    return ""


def unsharded_run(model: LayersLM) -> dict:
    """Loss and gradients of the unsharded `model` on each rank's rows, one backward per rank's rows."""
    losses, grads = [], []
    for rank in range(dist.get_world_size()):
        batch = rank_batch(rank)
        head = model.lm_head
        loss = loss_of(model(batch["ids"][:-1]), head.weight, head.bias, batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: param.grad.clone() for name, param in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return {"losses": torch.stack(losses), "grads": grads}


def one_case(layout: str, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = LayersLM(tied=layout == "tied").to(dtype)
    reference = unsharded_run(copy.deepcopy(model))
    for layer in model.layers:
        fully_shard(layer)
    if layout == "own_unit":
        fully_shard(model.lm_head)
    if layout == "accelerate":  # accelerate's fsdp2_prepare_model: embedding, layers, [final norm, lm_head], root
        fully_shard(model.embed)
        fully_shard([model.lm_head], reshard_after_forward=False)
    fully_shard(model)
    error = sharded_error(model, dtype)
    batch = rank_batch(dist.get_rank())
    hidden = model(batch["ids"][:-1])
    outside_is_dtensor = is_dtensor(model.lm_head.weight)
    with whole_lm_head(model) as (weight, bias):
        whole = (tuple(weight.shape), is_dtensor(weight), weight.dtype)
        loss = loss_of(hidden, weight, bias, batch)
        if layout != "accelerate":
            loss.backward()
    if layout == "accelerate":  # TRL: accelerator.backward(loss) after _compute_loss has returned
        loss.backward()
    losses = [torch.zeros((), dtype=loss.dtype) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach())
    grads = {name: param.grad.full_tensor() for name, param in model.named_parameters()}
    return {"losses": torch.stack(losses), "grads": grads, "reference": reference, "sharded_error": error,
            "outside_is_dtensor": outside_is_dtensor, "after_is_dtensor": is_dtensor(model.lm_head.weight),
            "whole": whole}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    result = {(layout, str(dtype)): one_case(layout, dtype)
              for layout in LAYOUTS for dtype in (torch.float32, torch.bfloat16)}
    result["unowned_dtensor_error"] = unowned_dtensor_error()
    finish_worker(result, args.out)


if __name__ == "__main__":
    main()
