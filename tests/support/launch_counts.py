"""Count what one call costs on the device, on any machine (the counts do not depend on N or V): aten operators that
launch a kernel (a TorchDispatchMode: allocations and views launch none), Triton kernel launches (a hook on the
launcher's `run`, compiled or interpreted), and host-device synchronizations: the reads of a device value on the
host, and the blocking copies from the host, each counted as it would happen on CUDA. The aten operators the host
runs on host memory (a batch built from Python lists, `torch.zeros(n)` without a device) launch nothing on the
device: they are host work, counted apart (`host_ops`, `host_names`).

    with LaunchCounter() as counter:
        loss = erpo_loss(...).loss
        loss.backward()
    counter.launches, counter.syncs, counter.names, counter.sync_names, counter.order, counter.host_ops,
    counter.host_names

The Triton kernels' own work under the interpreter (its copies to numpy and back) is not counted: one launch is one.
A torch.library custom op is a wrapper, not a launch: the operators and kernels inside it are counted. Inside one
(its body runs below autograd) a composite operator reaches the counter whole, before it decomposes: one whose
result may alias its input (`to` and so `.float()`, `contiguous`, `reshape`: `func.is_view` by their schema) counts
as one launch when it copies (its result is not a view of its input: `aten.to` for a cast), none when it returns its
input or a view of it, as outside an op its copy (`aten._to_copy`, `aten.clone`) is counted and its alias is not.

Left out on purpose, so that the counts are CUDA's on the CPU too: the fused path's copies of bf16 / fp16 GEMM
operands to fp32 off CUDA (`fused_linear_loss.cpu_fp32_operand`: the hidden rows and the weight of each logits GEMM,
d weight's two operands per group, d hidden's with GRAD_HIDDEN_FP32). On CUDA those GEMMs take bf16 / fp16 operands
and write fp32 themselves (`out_dtype`), with no copy; the CPU's matmul cannot, so it copies first. Every other cast,
on either device, counts (a bf16 bias's `.float()`, once per call, a gradient's rounding `.to(dtype)`).

Host syncs. A dispatch mode alone misses most of them: on the CPU `t.cpu()` and `t.to("cpu")` return t and
`t.numpy()`, `t.tolist()` read its memory, dispatching nothing, and on any device an operator whose output shape
depends on the values (a boolean index, `unique`, `bincount`, ...) reads them inside aten. So while it is active the
counter also wraps the Tensor methods and torch functions that move data between host and device (`SYNC_METHODS`,
`HOST_FACTORIES`; `torch.cuda.Event.synchronize` on CUDA), and counts the scalar reads and data-dependent shapes by
operator (`_reads_values`). On the CPU a tensor cannot say whether it stands for device or host memory: every tensor
is taken for a device tensor (the tested tensors are on the `device` fixture's device) but those known to be host
memory: made from numpy (`torch.from_numpy`), by `torch.tensor` / `torch.as_tensor` or a factory (`torch.zeros`,
`torch.full`, ...: `HOST_FACTORIES`) without a device or with device="cpu" (the string), returned by a counted read
(`.cpu()`, `.to("cpu")`), pinned, or computed from host tensors alone. A read of a host tensor is no sync; a host
tensor's `.to(device)` and `torch.tensor(..., device=...)` are an upload, a sync unless non_blocking (a blocking copy
makes the host wait for the stream). The operators on host tensors alone are host work, not launches: on CUDA those
on CPU tensors (but a copy to the device), on the CPU those on host memory as said. Not seen: syncs inside another
library's C++ or Python (a collective, ...), `Tensor.copy_` between host and device.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from collections import Counter
from typing import Callable

import torch
import torch._dynamo  # noqa: F401  (before any counter replaces torch.tensor: `__enter__`)
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# aten operators that read device values on the host (a synchronization on CUDA), with how many reads CUDA's kernel
# makes: scalar reads, and operators whose output shape depends on the values (boolean indexing: `_reads_values`);
# bincount reads the input's min and max, repeat_interleave (without output_size) the total and whether every count
# is >= 0
SYNC_OPS = {"_local_scalar_dense": 1, "item": 1, "nonzero": 1, "is_nonzero": 1, "equal": 1, "allclose": 1,
            "unique": 1, "_unique": 1, "_unique2": 1, "unique_dim": 1, "unique_consecutive": 1,
            "unique_dim_consecutive": 1, "masked_select": 1, "repeat_interleave": 2, "bincount": 2}
# aten operators that allocate without filling, alias their input, or work on the host alone (pinning host memory,
# asking whether it is pinned): no kernel launch
NO_LAUNCH_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
                 "lift_fresh", "_unsafe_view", "set_", "resize_", "sym_size", "sym_stride",
                 "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "is_pinned",
                 "pin_memory", "_pin_memory"}
# the Tensor methods and torch functions that move data between host and device, wrapped while the mode is active
SYNC_METHODS = ("cpu", "numpy", "tolist", "to")
# the torch functions that make a tensor on the host when given no device (wrapped while the mode is active): those
# that copy given values there (an upload when given the device) ...
HOST_COPIES = ("from_numpy", "tensor", "as_tensor")
# ... and those that fill it (made on the device when given it: a launch, no upload)
HOST_FACTORIES = (*HOST_COPIES, "zeros", "ones", "full", "empty", "arange", "linspace", "eye", "rand", "randn",
                  "randint", "randperm")


def default_device() -> torch.device:
    """The device the kernel tests put their tensors on (tests/conftest.py's `device` fixture): CUDA when a GPU is
    present and the interpreter is not forced, else the CPU."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return torch.device("cuda")
    return torch.device("cpu")


def triton_launchers() -> tuple:
    """The classes whose `run` launches a Triton kernel: the compiled path's JITFunction and the interpreter's."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    return JITFunction, InterpretedFunction


@contextlib.contextmanager
def watched_launches(before: Callable[[object, tuple, dict], None]):
    """In the block, `before(kernel, args, kwargs)` is called ahead of each Triton kernel launch (warm-ups, which
    compile without launching, left out), then the kernel launches as it would have."""
    saved = [(launcher, launcher.run) for launcher in triton_launchers()]

    def watching(original):
        def run(kernel, *args, **kwargs):
            if not kwargs.get("warmup"):
                before(kernel, args, kwargs)
            return original(kernel, *args, **kwargs)
        return run

    for launcher, original in saved:
        launcher.run = watching(original)
    try:
        yield
    finally:
        for launcher, original in saved:
            launcher.run = original


class _LoggedCounter(Counter):
    """A Counter that also appends (kind, name) to `order` each time a count of it goes up."""

    def __init__(self, kind: str, order: list):
        super().__init__()
        self.kind, self.order = kind, order

    def __setitem__(self, name, count):
        if count > self[name]:
            self.order.append((self.kind, name))
        super().__setitem__(name, count)


class LaunchCounter(TorchDispatchMode):
    """launches: aten kernels + Triton launches on the device; names: Counter of what was launched; syncs: host syncs;
    sync_names: Counter of what synchronized; order: [(kind, name)] of both in the order they happened, kind "launch"
    or "sync" (where a call's host read falls among its launches); host_ops: aten operators on host memory alone;
    host_names: Counter of them. `device`: where the tested tensors live (default_device())."""

    def __init__(self, device: torch.device | str | None = None):
        super().__init__()
        self.device = torch.device(device) if device is not None else default_device()
        self.order: list = []
        self.names: Counter = _LoggedCounter("launch", self.order)
        self.sync_names: Counter = _LoggedCounter("sync", self.order)
        self.host_names: Counter = Counter()
        self._host = {}  # id -> weakref of the CPU tensors known to hold host memory (module docstring)
        self._inside_triton = 0
        self._inside_cpu_upcast = 0  # within `fused_linear_loss.cpu_fp32_operand` (module docstring)
        self._inside_host_factory = 0
        self._saved = []
        self._depth = 0

    @property
    def launches(self) -> int:
        return sum(self.names.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_names.values())

    @property
    def host_ops(self) -> int:
        return sum(self.host_names.values())

    def host_memory(self, *tensors: torch.Tensor) -> None:
        """Take `tensors`, made before the counter (a batch built on the host from Python lists), for host memory: on
        the CPU the counter takes every tensor it did not see made for a device tensor (module docstring); on CUDA a
        CPU tensor is host memory anyway."""
        for tensor in tensors:
            self._mark_host(tensor)

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` holds host memory (a read of it is no sync): a CPU tensor when the device is not the
        CPU; on the CPU one made on the host (module docstring)."""
        if tensor.device.type != "cpu":
            return False
        known = self._host.get(id(tensor))
        return self.device.type != "cpu" or (known is not None and known() is tensor) or tensor.is_pinned()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace not in ("aten", "prims") and not self._inside_triton:
            with self:  # a custom op: run its implementation (below this mode's dispatch key) and count inside
                return func.redispatch(_backend_keys(args), *args, **kwargs)
        out = func(*args, **kwargs)
        inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outputs = [a for a in pytree.tree_leaves(out) if isinstance(a, torch.Tensor)]
        # host work: a host factory's filling, or what is computed from host tensors alone (on the CPU its outputs are
        # taken for host memory: a view, ...; on CUDA they are CPU tensors, but for an upload's copy to the device)
        on_host = self._inside_host_factory > 0 or (bool(inputs) and all(self.is_host(a) for a in inputs) and (
            self.device.type == "cpu" or all(self.is_host(a) for a in outputs)))
        if not self._inside_triton:
            name = func.overloadpacket.__name__
            reads = _reads_values(name, args, kwargs)
            if reads and not (args and isinstance(args[0], torch.Tensor) and self.is_host(args[0])):
                self.sync_names[f"aten.{name}"] += reads
            aliases = func.is_view and not _copied(args, out)  # a view, or a composite returning its input (above)
            if not (name in NO_LAUNCH_OPS or name == "_local_scalar_dense" or aliases  # a read: no kernel
                    or self._inside_cpu_upcast):
                (self.host_names if on_host else self.names)[f"aten.{name}"] += 1
        if on_host and self.device.type == "cpu":
            for tensor in outputs:
                self._mark_host(tensor)
        return out

    def __enter__(self):
        # torch._dynamo is imported with this module: Dynamo records torch's functions when it is first imported, and
        # a counter's replacements (torch.tensor & co.) seen then, when a counted loss was the first to import it
        # (torch.compiler.is_compiling()), left every later torch.compile unable to trace torch.tensor
        if self._depth == 0:  # the outermost entry (a custom op re-enters the mode around its implementation)
            for launcher in triton_launchers():
                self._patch(launcher, "run", self._counting_run(launcher.run))
            from erpo_kernels import fused_linear_loss
            self._patch(fused_linear_loss, "cpu_fp32_operand",
                        self._uncounted_upcast(fused_linear_loss.cpu_fp32_operand))
            for name in SYNC_METHODS:
                self._patch(torch.Tensor, name, getattr(self, f"_{name}")(getattr(torch.Tensor, name)))
            for name in HOST_FACTORIES:
                self._patch(torch, name, self._host_factory(getattr(torch, name), copies=name in HOST_COPIES))
            if torch.cuda.is_available():
                self._patch(torch.cuda.Event, "synchronize", self._counted("event.synchronize",
                                                                           torch.cuda.Event.synchronize))
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for owner, name, original in reversed(self._saved):
                setattr(owner, name, original)
            self._saved = []
        return super().__exit__(*exc)

    def _patch(self, owner, name, replacement) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

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

    def _uncounted_upcast(self, original):
        def cpu_fp32_operand(tensor):
            self._inside_cpu_upcast += 1
            try:
                return original(tensor)
            finally:
                self._inside_cpu_upcast -= 1
        return cpu_fp32_operand

    def _counted(self, name, original):
        def synchronize(*args, **kwargs):
            self.sync_names[name] += 1
            return original(*args, **kwargs)
        return synchronize

    def _read(self, name: str, tensor: torch.Tensor) -> bool:
        """Count a host read of `tensor` under `name` unless it is a host tensor; whether it was counted."""
        if self.is_host(tensor):
            return False
        self.sync_names[name] += 1
        return True

    def _mark_host(self, tensor: torch.Tensor) -> None:
        self._host[id(tensor)] = weakref.ref(tensor)

    def _as_host(self, tensor: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """`tensor` (the result of a read of `source`) marked as host memory: on the CPU, where the read returned
        `source` itself, an alias of it, so that `source` stays a device tensor."""
        if tensor is source:
            tensor = tensor.view_as(tensor)
        self._mark_host(tensor)
        return tensor

    def _cpu(self, original):
        def cpu(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            return self._as_host(out, tensor) if self._read("Tensor.cpu", tensor) else out
        return cpu

    def _numpy(self, original):
        def numpy(tensor, *args, **kwargs):
            self._read("Tensor.numpy", tensor)
            return original(tensor, *args, **kwargs)
        return numpy

    def _tolist(self, original):
        def tolist(tensor):
            self._read("Tensor.tolist", tensor)
            return original(tensor)
        return tolist

    def _to(self, original):
        def to(tensor, *args, **kwargs):
            target, _dtype, non_blocking, _format = torch._C._nn._parse_to(*args, **kwargs)
            out = original(tensor, *args, **kwargs)
            if target is None or non_blocking:
                return out
            if self.is_host(tensor) and (target.type != "cpu" or self.device.type == "cpu"):  # an upload
                self.sync_names["upload"] += 1
                return out.view_as(out) if out is tensor else out  # on the CPU: a device tensor, not the host one
            to_host = target.type == "cpu" and (tensor.device.type != "cpu" or "cpu" in (*args, kwargs.get("device")))
            if to_host and self._read("Tensor.to(cpu)", tensor):  # on the CPU only .to("cpu") says it is a read
                return self._as_host(out, tensor)
            return out
        return to

    def _host_factory(self, original, copies: bool):
        """`original` (a torch function of HOST_FACTORIES), whose tensor is host memory, and the operators that fill
        it host work, when it is given no device or device="cpu" (on the CPU only the string says it is the host);
        given the device, a function that `copies` values from the host makes an upload."""
        def factory(*args, **kwargs):
            on_host = kwargs.get("device") in (None, "cpu")
            self._inside_host_factory += on_host
            try:
                out = original(*args, **kwargs)
            finally:
                self._inside_host_factory -= on_host
            if args and out is args[0]:  # as_tensor of a tensor: that tensor
                return out
            if on_host:
                self._mark_host(out)
            elif copies and torch.device(kwargs["device"]).type == self.device.type:  # built on the host, copied
                self.sync_names["upload"] += 1
            return out
        return factory


def _reads_values(name: str, args, kwargs) -> int:
    """How many times the aten operator `name` on these arguments reads tensor values on the host: SYNC_OPS'
    (repeat_interleave none with output_size), and once for an index by a boolean mask (but for the write of one host
    number through one mask, which aten turns into masked_fill_: no read)."""
    if name == "repeat_interleave" and kwargs.get("output_size") is not None:
        return 0
    if name in SYNC_OPS:
        return SYNC_OPS[name]
    if name not in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return 0
    indices = [i for i in (args[1] if len(args) > 1 else kwargs["indices"]) if i is not None]
    if not any(i.dtype in (torch.bool, torch.uint8) for i in indices):
        return 0
    if name == "index":
        return 1
    value = args[2] if len(args) > 2 else kwargs["values"]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return int(not (len(indices) == 1 and not accumulate and value.numel() == 1 and value.device.type == "cpu"))


def _copied(args, out) -> bool:
    """Whether an operator whose schema lets its result alias its first argument (`func.is_view`) made a new tensor
    instead: its result holds other memory than that argument (a composite such as `to` inside a custom op). Plain
    tensors only: a subclass's (a nested tensor's) storage may be none of its own, and its views are views."""
    source = args[0] if args else None
    return (type(out) is torch.Tensor and type(source) is torch.Tensor
            and out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr())


def _backend_keys(args) -> torch._C.DispatchKeySet:
    """The dispatch key of the device the tensors in `args` live on (a custom op's implementation)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    on_cuda = any(t.is_cuda for t in tensors)
    return torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA if on_cuda else torch._C.DispatchKey.CPU)
