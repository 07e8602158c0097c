"""Count what one call costs on the device, on any machine (the counts do not depend on N or V): aten operators that
launch a kernel (a TorchDispatchMode: allocations and views launch none), Triton kernel launches (a hook on the
launcher's `run`, compiled or interpreted), and host-device synchronizations (operators that read a device value
on the host).

    with LaunchCounter() as counter:
        loss = erpo_loss(...).loss
        loss.backward()
    counter.launches, counter.syncs, counter.names, counter.masked_indexing

The Triton kernels' own work under the interpreter (its copies to numpy and back) is not counted: one launch is one.
A torch.library custom op is a wrapper, not a launch: the operators and kernels inside it are counted.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operators that read a device value on the host (a synchronization on CUDA)
SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose", "unique", "_unique2",
            "masked_select", "repeat_interleave"}
# aten operators that index by a list of tensors (args[1]); a boolean one is read on the host to find its rows
MASK_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
# aten operators that allocate without filling, or alias their input: no kernel launch
NO_LAUNCH_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
                 "lift_fresh", "_unsafe_view", "set_", "resize_", "sym_size", "sym_stride",
                 "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"}


def _triton_launchers():
    """The classes whose `run` launches a Triton kernel: the compiled path's JITFunction and the interpreter's."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    return JITFunction, InterpretedFunction


class LaunchCounter(TorchDispatchMode):
    """launches: aten kernels + Triton launches; syncs: host reads; names: Counter of what was launched;
    masked_indexing: indexing by a boolean mask (aten.index / index_put), whose device-to-host read on CUDA happens
    inside the operator and is not in `syncs`."""

    def __init__(self):
        super().__init__()
        self.names: Counter = Counter()
        self.syncs = 0
        self.masked_indexing = 0
        self._inside_triton = 0
        self._saved_runs = []
        self._depth = 0

    @property
    def launches(self) -> int:
        return sum(self.names.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace not in ("aten", "prims") and not self._inside_triton:
            with self:  # a custom op: run its implementation (below this mode's dispatch key) and count inside
                return func.redispatch(_backend_keys(args), *args, **kwargs)
        if not self._inside_triton:
            name = func.overloadpacket.__name__
            if name in SYNC_OPS:
                self.syncs += 1
            if name in MASK_INDEX_OPS and any(isinstance(index, torch.Tensor) and index.dtype == torch.bool
                                              for index in args[1]):
                self.masked_indexing += 1
            if not (name in NO_LAUNCH_OPS or name == "_local_scalar_dense" or func.is_view):  # a read: no kernel
                self.names[f"aten.{name}"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        if self._depth == 0:  # the outermost entry (a custom op re-enters the mode around its implementation)
            for launcher in _triton_launchers():
                self._saved_runs.append((launcher, launcher.run))
                launcher.run = self._counting_run(launcher.run)
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for launcher, original in self._saved_runs:
                launcher.run = original
            self._saved_runs = []
        return super().__exit__(*exc)

    def _counting_run(self, original):
        counter = self

        def run(kernel, *args, **kwargs):
            counter.names[f"triton.{getattr(kernel, '__name__', 'kernel')}"] += 1
            counter._inside_triton += 1
            try:
                return original(kernel, *args, **kwargs)
            finally:
                counter._inside_triton -= 1
        return run



def _backend_keys(args) -> torch._C.DispatchKeySet:
    """The dispatch key of the device the tensors in `args` live on (a custom op's implementation)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    on_cuda = any(t.is_cuda for t in tensors)
    return torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA if on_cuda else torch._C.DispatchKey.CPU)
