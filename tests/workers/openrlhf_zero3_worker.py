"""OpenRLHF's actor step on the lean path under DeepSpeed ZeRO-3, launched by tests/distributed/test_openrlhf_zero3.py
through torchrun with 2 CPU processes (gloo).

For a tiny Qwen2 with an untied lm_head and one tied to the input embedding (fp32), every rank: scores the reference
cache's prompts at theta0 (`openrlhf_reference.score_prompts`, what `load_or_build_query_reference` scores) on the
lean path under ZeRO-3, on the logits path under ZeRO-3 and on the lean path unsharded; then, on a copy of theta0
moved far from it, runs OpenRLHF 0.11.2's actor step as docs/integrations.md's recipe has it (`actor_logprobs`,
`ERPOPolicyLoss` with the Query-KL against the cache and w(q), OpenRLHF's entropy loss through its own
`aggregate_loss`, then OpenRLHF's own `DeepspeedStrategy.backward` and `optimizer_step`: engine.backward(loss) and
engine.step() after the scoring has returned) with OpenRLHF's own `Actor` around a ZeRO-3 engine, on each path, and
the same step's loss and gradient on the unsharded model. Rank 0 writes to --out, per head: the caches; per run the
action log-probs, ell_theta(q) and loss of each rank, the whole gradient of every parameter (ZeRO-3: DeepSpeed's
`safe_get_full_grad` before the step; unsharded: the ranks' gradients averaged, as DeepSpeed averages them), the
parameters after the step, and whether the lm_head was partitioned again (an empty shard) once the scoring returned
and once the backward had run.
"""
import argparse
import copy
import sys

import deepspeed
import torch
import torch.distributed as dist
import transformers
from deepspeed.utils import safe_get_full_grad

from bench.openrlhf_memory import ring_attention_stand_in
from torchrun import finish_worker

sys.modules["openrlhf.models.ring_attn_utils"] = ring_attention_stand_in()   # it imports flash-attn at its top
from openrlhf.models import Actor, aggregate_loss  # noqa: E402
from openrlhf.utils.deepspeed import DeepspeedStrategy  # noqa: E402

from erpo.deepspeed_internals import skip_cpu_shm_op  # noqa: E402
from erpo.integrations.openrlhf import ERPOPolicyLoss, actor_logprobs  # noqa: E402
from erpo.integrations.openrlhf_reference import score_prompts  # noqa: E402
from erpo_kernels.zero3 import find_lm_head  # noqa: E402

VOCAB, TEMPERATURE, LR = 96, 0.7, 0.5
SAMPLES = 3   # per rank
# (name, under ZeRO-3, on the lean path) of the scorings and steps compared
RUNS = (("zero3-lean", True, True), ("zero3-logits", True, False), ("unsharded-lean", False, True))
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)


def zero3_config() -> dict:
    """ZeRO-3 that partitions every parameter (no persistence threshold) and releases each as soon as its module is
    done (no reuse distance, no prefetch): a head left gathered shows."""
    return {"train_micro_batch_size_per_gpu": SAMPLES, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


def theta0_of(tied: bool) -> torch.nn.Module:
    """theta0: the tiny Qwen2, seeded (the same on every rank), its head scaled so the logits spread over nats."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG, tie_word_embeddings=tied,
                                                                   attn_implementation="sdpa"))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def far_from(theta0: torch.nn.Module) -> torch.nn.Module:
    """A copy of theta0 with every parameter moved by a third of its spread (seeded): ell(q) moves by nats."""
    model = copy.deepcopy(theta0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() / 3)
    return model


def rank_batch(rank: int):
    """This rank's micro-batch as OpenRLHF 0.11's step holds it: sequences from column 0, right-padded, action_mask
    over the T - 1 scored positions; prompts of 3 to 6 tokens, responses of 2 to 5, one with a tool output."""
    gen = torch.Generator().manual_seed(10 + rank)
    pairs = [(torch.randint(3, VOCAB, (3 + (rank + s) % 4,), generator=gen).tolist(),
              torch.randint(3, VOCAB, (2 + (2 * s + rank) % 4,), generator=gen).tolist()) for s in range(SAMPLES)]
    width = 6 + 5   # the longest prompt and response: one shape on every rank
    sequences = torch.tensor([p + r + [0] * (width - len(p) - len(r)) for p, r in pairs])
    attention_mask = (torch.arange(width)[None] < torch.tensor([len(p) + len(r) for p, r in pairs])[:, None]).long()
    actions = [[0] * len(p) + [1] * len(r) + [0] * (width - len(p) - len(r)) for p, r in pairs]
    actions[0][len(pairs[0][0]) + 1] = 0   # a tool output inside the first response
    action_mask = torch.tensor(actions, dtype=torch.bool)[:, 1:]
    return (sequences, action_mask, attention_mask), [p for p, _ in pairs]


def prepared(model: torch.nn.Module, zero3: bool) -> Actor:
    """OpenRLHF's Actor around a copy of `model`, its `model` the ZeRO-3 engine as `strategy.prepare` leaves it."""
    actor = Actor(copy.deepcopy(model), temperature=TEMPERATURE)
    actor.packing_samples = False
    if zero3:
        optimizer = torch.optim.SGD(actor.model.parameters(), lr=LR)
        actor.model, _, _, _ = deepspeed.initialize(model=actor.model, optimizer=optimizer, config=zero3_config())
    return actor


def head_partitioned(actor) -> bool:
    """True when every parameter of the actor's lm_head is an empty ZeRO-3 shard (gathered by nobody)."""
    head = find_lm_head(actor.model)
    return all(p.numel() == 0 for p in head.parameters())


def full_parameters(actor) -> dict:
    """Every parameter of the actor's model, whole (gathered one at a time under ZeRO-3)."""
    model = getattr(actor.model, "module", actor.model)
    params = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            params[name] = param.detach().clone()
    return params


def actor_step(actor, batch, step_inputs: dict, *, fused_linear: bool, zero3: bool) -> dict:
    """The recipe's training_step on one micro-batch (module docstring): the scores, the loss and every parameter's
    whole gradient; under ZeRO-3 OpenRLHF's strategy runs the backward and the optimizer step after the scoring has
    returned, the parameters after the step and the head's state recorded too."""
    sequences, action_mask, attention_mask = batch
    actor.train()
    scores = actor_logprobs(actor, sequences, action_mask, attention_mask, return_entropy=True,
                            fused_linear=fused_linear)
    released_after_scoring = head_partitioned(actor) if zero3 else None
    loss_batch_info = step_inputs["loss_batch_info"]
    loss, *_ = ERPOPolicyLoss(qkl_coef=0.05)(
        scores.action_log_probs, step_inputs["old"], step_inputs["advantages"], action_mask=action_mask,
        query_logp=scores.query_logp, ref_query_logp=step_inputs["ref_query_logp"],
        query_weight=step_inputs["query_weight"], **loss_batch_info)
    entropy_loss = aggregate_loss(scores.output.entropy[:, -action_mask.shape[1]:], action_mask, **loss_batch_info)
    loss = loss - 0.01 * entropy_loss
    result = {"action_log_probs": scores.action_log_probs.detach(), "query_logp": scores.query_logp.detach(),
              "loss": loss.detach()}
    if not zero3:
        actor.zero_grad(set_to_none=True)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in actor.model.named_parameters()}
        for grad in grads.values():
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
        return dict(result, grads=grads)
    strategy = DeepspeedStrategy.__new__(DeepspeedStrategy)   # its backward and optimizer_step read no state
    strategy.backward(loss, actor, None)
    released_after_backward = head_partitioned(actor)
    grads = {name: safe_get_full_grad(p).clone() for name, p in actor.model.module.named_parameters()}
    strategy.optimizer_step(None, actor, None)
    return dict(result, grads=grads, params=full_parameters(actor), released_after_scoring=released_after_scoring,
                released_after_backward=released_after_backward)


def gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `tensor` (the same shape on each)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def one_head(tied: bool) -> dict:
    """Rank 0's record for one head (module docstring): every rank's caches, scores and losses, the gradients and
    parameters, theta0 moved far from itself (`initial`) and how far each prompt's ell(q) moved (`drift`)."""
    rank = dist.get_rank()
    batch, prompts = rank_batch(rank)
    theta0 = theta0_of(tied)
    caches = {}
    for name, zero3, fused in RUNS:
        actor = prepared(theta0, zero3)
        caches[name] = torch.tensor(score_prompts(actor, prompts, pad_id=0, batch_size=2, fused_linear=fused))
        if zero3:
            caches[name + "-released"] = head_partitioned(actor)
    action_mask = batch[1]
    num_actions = action_mask.sum().float()
    dist.all_reduce(num_actions)
    step_inputs = dict(
        ref_query_logp=caches["unsharded-lean"], query_weight=torch.tensor([0.6, 1.8, 1.2]),
        advantages=(torch.tensor([1.0, -0.5, 0.3])[:, None] * action_mask).contiguous(),
        loss_batch_info=dict(dp_size=dist.get_world_size(), batch_num_tokens=num_actions,
                             global_batch_size=torch.tensor(float(SAMPLES * dist.get_world_size()))))
    model = far_from(theta0)
    with torch.no_grad():
        scored = actor_logprobs(prepared(model, False), *batch, fused_linear=True).action_log_probs
    step_inputs["old"] = (scored - 0.25 * torch.linspace(-1, 1, action_mask.shape[1])) * action_mask
    runs = {}
    for name, zero3, fused in RUNS:
        run = actor_step(prepared(model, zero3), batch, step_inputs, fused_linear=fused, zero3=zero3)
        runs[name] = dict(run, **{key: gathered(run[key]) for key in ("action_log_probs", "query_logp", "loss")})
    drift = caches["unsharded-lean"] - runs["unsharded-lean"]["query_logp"][rank]
    return {"lr": LR, "runs": runs, "drift": gathered(drift),
            "caches": {name: gathered(cache) if torch.is_tensor(cache) else cache for name, cache in caches.items()},
            "initial": {name: p.detach().clone() for name, p in model.named_parameters()},
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    skip_cpu_shm_op()   # DeepSpeed's comm layer without its shared-memory op: nothing to build on the CPU
    deepspeed.init_distributed(dist_backend="gloo")
    finish_worker({tied: one_head(tied) for tied in (False, True)}, args.out)


if __name__ == "__main__":
    main()
