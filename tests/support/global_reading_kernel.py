"""A Triton kernel that reads one module-level constexpr itself and one through the jit function it calls: what
bench.kernel_globals must list (tests/kernels/test_host_cost.py)."""
import triton
import triton.language as tl

KERNEL_GLOBAL = tl.constexpr(2)
HELPER_GLOBAL = tl.constexpr(3)


@triton.jit
def _times_helper_global(x):
    return x * HELPER_GLOBAL


@triton.jit
def reads_two_globals(out_ptr):
    tl.store(out_ptr, _times_helper_global(KERNEL_GLOBAL))
