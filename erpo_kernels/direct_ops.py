"""The Triton passes' torch.library custom ops, called without torch.library's Python layers outside torch.compile.

A custom op is what torch.compile needs: a graph node with a fake implementation and a registered backward. An
eager call also pays for torch.library's Python layers (its autograd wrapper, the redispatch to the backend, the
filling of default arguments): about 40 us a call with autograd on and 15 us without, on the host that launches
the kernels (`python -m bench.host_cost`). `DirectOp` calls the op itself while torch.compile traces (or any other
dispatch mode is active: FakeTensorMode, AOTAutograd's tracing of the backward, a launch counter; or a torch.func
transform) and otherwise the op's own implementation, through a torch.autograd.Function built from the op's own
setup_context and backward when a gradient is needed: the same code and the same results, two layers fewer.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def traced() -> bool:
    """Whether something traces or transforms the ops called now: torch.compile, a dispatch mode (FakeTensorMode,
    AOTAutograd, a launch counter), a torch.func transform (grad, vmap: the op's own support). Then the ops are
    called, else their implementations."""
    return (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or torch._C._are_functorch_transforms_active())


class DirectOp:
    """`op` (a torch.library custom op) called as `implementation(*args)` where nothing traces (module docstring).

    implementation: the function the op was made from; setup_context(ctx, inputs, output) and backward(ctx,
    *grads): the ones registered with op.register_autograd (None for an op without a gradient)."""

    def __init__(self, op, implementation: Callable, setup_context: Optional[Callable] = None,
                 backward: Optional[Callable] = None):
        self.op = op
        self.implementation = implementation
        self.function = None
        if backward is not None:
            def forward(ctx, *args):  # forward with ctx, not a separate setup_context: apply() then skips
                output = implementation(*args)  # binding the arguments to forward's signature (inspect, ~25 us)
                setup_context(ctx, args, output)
                return output
            self.function = type(f"{implementation.__name__}_function", (torch.autograd.Function,), {
                "forward": staticmethod(forward), "backward": staticmethod(backward)})

    def __call__(self, *args):
        if traced():
            return self.op(*args)
        if self.function is not None and torch.is_grad_enabled() and any(
                isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args):
            return self.function.apply(*args)
        return self.implementation(*args)
