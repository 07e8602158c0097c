"""The two queues of the fused path's pipelined chunk loop (`fused_linear_loss.run_pipelined`), and the cuBLASLt SM
carveout its logits GEMMs may run under.

On CUDA the main queue is the current stream (the logits GEMMs, the groups' GEMMs) and the side queue a stream from
torch's pool (the row work), ordered by events alone: `on_side` runs the host code that queues the work under
`torch.cuda.stream(side)`, `record_*` records an event at the end of a queue, `*_waits` makes one queue wait for the
other's event, `join` makes the main stream wait for all the side has. Elsewhere there is one queue: work runs as
it is queued and events order nothing, so the same loop, with the same buffers, runs on the CPU (tests/kernels'
deferred queues replay it with one queue held back, to catch a missing wait there).

Memory: a tensor the side uses that the main stream's caching-allocator pool holds must outlive the side's use (or
be `record_stream`-ed); the loop's tensors live until after `join`, which the loop runs also on an exception.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch


class ChunkStreams:
    """Two CUDA streams ordered by events, or on another device one queue (module docstring). An event is an opaque
    value of `record_main` / `record_side`; None (no work recorded yet) is waited for at no cost."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.main = torch.cuda.current_stream(device) if self.cuda else None
        self.side = torch.cuda.Stream(device) if self.cuda else None
        if self.cuda:
            self.side.wait_stream(self.main)  # all the op queued before the loop (the buffers' and vectors' setup)

    def on_main(self, work: Callable[[], None]) -> None:
        """Run `work`, host code queuing device work, on the main queue (the current stream)."""
        work()

    def on_side(self, work: Callable[[], None]) -> None:
        """Run `work`, host code queuing device work, on the side queue (no value comes back: the host must not
        read what the side computes)."""
        if not self.cuda:
            work()
            return
        with torch.cuda.stream(self.side):
            work()

    def record_main(self):
        """An event at the end of the main queue's work so far."""
        return self._record(self.main)

    def record_side(self):
        """An event at the end of the side queue's work so far."""
        return self._record(self.side)

    def main_waits(self, event) -> None:
        """The main queue's later work waits for `event` (a side event, or None)."""
        if self.cuda and event is not None:
            self.main.wait_event(event)

    def side_waits(self, event) -> None:
        """The side queue's later work waits for `event` (a main event, or None)."""
        if self.cuda and event is not None:
            self.side.wait_event(event)

    def join(self) -> None:
        """The main queue's later work waits for all the side's."""
        if self.cuda:
            self.main.wait_stream(self.side)

    def _record(self, stream):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event


@contextlib.contextmanager
def sm_carveout(sms: int):
    """cuBLASLt's matmuls queued in the block target all but `sms` of the device's SMs
    (`torch._C._set_sm_carveout_experimental`, torch's experimental knob: nothing when this torch lacks it or
    sms == 0); the previous setting is put back after the block, also on an exception. cuBLAS's non-Lt kernels
    ignore it: whether a GEMM heeded it shows in its time alone (bench.fused_probe part 3)."""
    setter: Optional[Callable] = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if not sms or setter is None:
        yield
        return
    saved = torch._C._get_sm_carveout_experimental()
    setter(sms)
    try:
        yield
    finally:
        setter(saved)
