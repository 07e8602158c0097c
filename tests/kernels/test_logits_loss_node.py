"""The logits path's loss as one autograd node (erpo_kernels/triton_logits_loss.py), taken where nothing traces: the
same loss, outputs, metrics and d logits, bit for bit, as the two ops in a row (what torch.compile and any dispatch
mode get, `direct_ops.traced`), with one Triton launch fewer (the objective's gradient kernel, folded into dlogits)."""
import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from erpo_kernels import erpo_loss
from erpo_kernels.triton_logits import forward_variant
from helpers import random_batch
from test_objective_kernels import FUSED_CASES, call_arguments


class TwoOps(TorchDispatchMode):
    """A dispatch mode that changes nothing but sends erpo_loss through the two ops (`direct_ops.traced`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def triton_launches():
    """Counter of the Triton kernels launched in the block, by name (no dispatch mode: the one node's path)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    names = Counter()
    saved = [(launcher, launcher.run) for launcher in (JITFunction, InterpretedFunction)]

    def counting(original):
        def run(kernel, *args, **kwargs):
            if not kwargs.get("warmup"):
                names[kernel.fn.__name__] += 1
            return original(kernel, *args, **kwargs)
        return run

    for launcher, original in saved:
        launcher.run = counting(original)
    try:
        yield names
    finally:
        for launcher, original in saved:
            launcher.run = original


def loss_and_grad(batch, case, two_ops: bool, **extra):
    tensors, options = call_arguments(batch, case)
    logits = batch["logits"].clone().requires_grad_(True)
    with TwoOps() if two_ops else contextlib.nullcontext():
        out = erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend="triton",
                        **tensors, **options, **extra)
        node = type(out.loss.grad_fn).__name__
        out.loss.backward()
    return out, logits.grad if logits.grad is not None else logits.detach(), node


def assert_bit_equal(one, two):
    (out, grad, node), (two_out, two_grad, two_node) = one, two
    assert node.startswith("_LogitsLoss") and not two_node.startswith("_LogitsLoss"), (node, two_node)
    assert torch.equal(out.loss, two_out.loss)
    assert torch.equal(grad, two_grad)
    for name in ("token_logp", "query_logp", "response_logp", "entropy"):
        assert torch.equal(getattr(out, name), getattr(two_out, name)), name
    assert list(out.metrics) == list(two_out.metrics)
    for name, value in two_out.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("case", FUSED_CASES.values(), ids=FUSED_CASES.keys())
def test_one_node_equals_the_two_ops_bit_for_bit(case, device, fma_as_compiled):
    batch = random_batch(device=device)
    assert_bit_equal(*(loss_and_grad(batch, case, two_ops) for two_ops in (False, True)))


@pytest.mark.parametrize("variant", ["block", "log2-1024"])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_one_node_keeps_the_variant_and_the_inplace_backward(variant, inplace_backward, device, fma_as_compiled):
    """The backward kernel of the forward that ran (the variant in force then), written into the logits in place
    when asked; bf16 logits, the soft-cap and a temperature."""
    batch = random_batch(device=device, dtype=torch.bfloat16)
    case = dict(logit_softcap=5.0, temperature=0.8, entropy_coef=0.05)
    with forward_variant(variant):
        results = [loss_and_grad(batch, case, two_ops, inplace_backward=inplace_backward) for two_ops in (False, True)]
    assert_bit_equal(*results)


def test_one_node_launches_one_triton_kernel_fewer(device):
    """Forward: the row checks, logp / entropy, the objective's two; backward: dlogits alone (the two ops: the
    objective's gradient kernel too). The aten operators are the same (LaunchCounter, a dispatch mode, counts the two
    ops' path: test_objective_kernels.py)."""
    batch = random_batch(device=device)
    for two_ops, expected in ((False, 5), (True, 6)):
        loss_and_grad(batch, {}, two_ops)  # compiled first on a GPU
        with triton_launches() as names:
            loss_and_grad(batch, {}, two_ops)
        assert sum(names.values()) == expected, names
        assert names["_objective_grad_kernel"] == int(two_ops), names
