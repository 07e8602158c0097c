"""The fwd+bwd every timing tool times (`bench.contenders.Prepared.step`: the bench's fwd+bwd, the fused probe, the
kernel profile), on ours on the fused path: the gradients of `torch.autograd.grad` bit for bit, no `.grad` left behind
or added to, and a backward that queues only autograd's seed and the two scale passes (issue 32's benchfair: what
else could the bench's fwd -> fwd+bwd step time)."""
from collections import Counter

import torch

from bench.contenders import CONTENDERS, ERPO_OPTIONS
from bench.problem import SMOKE_SHAPE, build_problem
from launch_counts import LaunchCounter


def _ours_on_the_fused_path(device):
    problem = build_problem("fused", SMOKE_SHAPE, 64, rows_per_sample=32, query_frac=0.25, dtype=torch.float32,
                            device=device, seed=0, chunk_rows=64, clip_low=ERPO_OPTIONS["clip_low"],
                            clip_high=ERPO_OPTIONS["clip_high"])
    (contender,) = [c for c in CONTENDERS if c.key == "erpo" and c.path == "fused"]
    return contender.prepare(problem)


def test_the_step_gives_autograd_grads_and_leaves_no_grad(device):
    prepared = _ours_on_the_fused_path(device)
    expected = torch.autograd.grad(prepared.run(), prepared.inputs)
    for tensor in prepared.inputs:  # a trainer's last step left gradients: the step sets them to None first
        tensor.grad = torch.ones_like(tensor)
    grads = prepared.step()
    assert len(grads) == len(expected) == 2
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)
    assert all(tensor.grad is None for tensor in prepared.inputs)


def test_the_steps_backward_queues_the_seed_and_two_scale_passes_only(device):
    prepared = _ours_on_the_fused_path(device)
    prepared.step()  # compiled / interpreted once
    counts = {}
    for name, call in (("forward", prepared.run), ("step", prepared.step)):
        with LaunchCounter(device) as counter:
            call()
        counts[name] = (Counter(counter.names), counter.syncs)
    (forward, forward_syncs), (step, step_syncs) = counts["forward"], counts["step"]
    # autograd's seed (a one-element fill: `.backward()` of a 0-dim loss) and d hidden's and d weight's scale pass;
    # no cast, copy, zero fill or accumulation into an old `.grad`, and no host read
    assert step - forward == Counter({"aten.ones_like": 1, "triton._scale_kernel": 2})
    assert not forward - step and step_syncs == forward_syncs == 1
