"""erpo.sequences.call_as_forward: a computation run as a module's own forward, so that the hooks on the module
(DeepSpeed ZeRO-3's gather and release; tests/distributed/test_openrlhf_zero3.py runs them) run around it; the
module's forward is its own again afterwards, also when the computation raises."""
import pytest
import torch

from erpo.sequences import call_as_forward


def hooked_linear(calls: list) -> torch.nn.Linear:
    """A Linear whose forward pre-hook, forward hook and output hook append to `calls` what they saw."""
    head = torch.nn.Linear(4, 6)
    head.register_forward_pre_hook(lambda module, args: calls.append(("pre", tuple(a.shape for a in args))))

    def after(module, args, output):
        outputs = output if isinstance(output, tuple) else (output,)
        calls.append(("post", tuple(o.shape for o in outputs)))
        for tensor in outputs:
            if tensor.requires_grad:
                tensor.register_hook(lambda grad: calls.append("backward"))

    head.register_forward_hook(after)
    return head


def test_the_hooks_run_around_the_computation_and_its_backward():
    calls = []
    head = hooked_linear(calls)
    rows = torch.randn(3, 4, requires_grad=True)
    targets = torch.tensor([1, 5, 0])

    def norms(hidden, chosen):   # reads the head's weight, as the fused kernel does, not its [3, 6] logits
        return (hidden @ head.weight[chosen].t()).diagonal(), head.weight.norm(dim=1)[chosen]

    first, second = call_as_forward(head, norms, rows, targets)
    assert calls == [("pre", ((3, 4), (3,))), ("post", ((3,), (3,)))]
    expected = (rows * head.weight[targets]).sum(1)
    torch.testing.assert_close(first, expected)
    (first.sum() + second.sum()).backward()
    assert calls[2:] == ["backward", "backward"]
    torch.testing.assert_close(rows.grad, head.weight[targets].detach())
    assert "forward" not in head.__dict__ and head(rows).shape == (3, 6)


def test_the_forward_is_put_back_also_when_the_computation_raises():
    head = torch.nn.Linear(4, 6)
    wrapper_forward = head.forward   # an instance's own forward, as a wrapper (accelerate's hooks) sets one
    head.forward = wrapper_forward

    def fails(hidden):
        raise ValueError("the computation's error")

    with pytest.raises(ValueError, match="the computation's error"):
        call_as_forward(head, fails, torch.randn(2, 4))
    assert head.__dict__["forward"] is wrapper_forward
    assert call_as_forward(head, lambda hidden: hidden * 2, torch.ones(2, 4)).eq(2).all()
    assert head.__dict__["forward"] is wrapper_forward
