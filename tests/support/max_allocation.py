"""`MaxAllocation`: the largest tensor the ops under it create, for tests that a path never builds [N, V]."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class MaxAllocation(TorchDispatchMode):
    """Records the element count (`largest`) and the bytes (`largest_bytes`) of the largest tensor an op creates.
    Views and in-place ops allocate nothing and are skipped (the Triton interpreter's copies of kernel arguments
    between its host and "device" buffers are in-place copy_/set_ calls on the arguments' own storage)."""

    def __init__(self):
        super().__init__()
        self.largest = self.largest_bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            for t in torch.utils._pytree.tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    self.ops += 1
                    self.largest = max(self.largest, t.numel())
                    self.largest_bytes = max(self.largest_bytes, t.numel() * t.element_size())
        return result
