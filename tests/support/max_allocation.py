"""The largest tensor or allocation made under a context, for tests that a path never builds [N, V]: `MaxAllocation`
(the tensors the ops create, as a dispatch mode sees them: a torch.library custom op, as erpo_kernels' fused ops, is
one op whose outputs alone it sees) and `LargestAllocation` (every allocation, inside custom ops too)."""
import contextlib

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


class LargestAllocation(contextlib.AbstractContextManager):
    """Records the bytes of the largest single allocation (`largest_bytes`) and the number of allocations and frees
    (`events`) made under it by any code, custom ops' insides included: torch.profiler's allocator events (CPU, and
    CUDA's caching allocator where a GPU is present)."""

    def __enter__(self):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        self._profile.__exit__(*exc)
        sizes = [event.nbytes() for event in self._profile.profiler.kineto_results.events()
                 if event.name() == "[memory]"]   # an allocation's bytes, a free's negated
        self.events = len(sizes)
        self.largest_bytes = max(sizes, default=0)
        return False
