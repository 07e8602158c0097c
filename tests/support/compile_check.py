"""Ahead-of-time compilation of Triton kernels for a Hopper GPU (sm_90) on a machine without one.

Triton ships ptxas, so `triton.compile` lowers a kernel to a cubin with no GPU present. This catches what the
interpreter cannot (type errors in loop-carried values, ops without a GPU lowering, shared-memory overflow)
on the Triton version CI installs, which is the GPU image's (3.6). Works whether or not TRITON_INTERPRET is set.
"""
import contextlib
import importlib
import inspect
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from launch_counts import watched_launches

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_LIMIT = 227 * 1024  # bytes per block on H100/H200
# pytest-timeout's limit on a test that runs a compile script (the test_compile_hopper files' mark; CI runs them, the
# GPU lease's tier leaves them out since 2026-11-27: cpu_only): CPU-bound work in one process (Triton's passes,
# ptxas), slow on a cold Triton cache (a lease's machine starts with one), slower beside other busy workers. The
# logits script, on this project's shared 2-core CPU (2026-11-27, nice 5, load about 6): 76 s with a cold cache (47 s
# of CPU, pytest's start included), 28 s with a warm one, 81 s cold beside the fused script under the GPU tier's flags
# on 2 xdist workers (passing there under this mark). On the GPU lease's hosts beside 11 other workers: 63 s (H100,
# 2026-11-26) and more than 90 s (H200, 2026-11-27, stopped by the tier's 90 s then; 30 s alone right after, its cache
# by then partly warm). 130 s is about 2.8 times its cold CPU time here.
COMPILE_TIMEOUT_S = 130


# triton_objective._objective_sample_kernel: its option flags (constexpr branches) and its signature, pointers and
# float settings, as both paths launch it (tests/workers/logits_compile_check.py, fused_compile_check.py)
OBJECTIVE_SAMPLE_FLAGS = (
    "HAS_ENTROPY", "HAS_QKL_REFERENCE", "HAS_QUERY_WEIGHT", "HAS_OLD", "HAS_REF_LOGP", "HAS_TOKEN_WEIGHT",
    "HAS_ROLLOUT", "HAS_IS_CAP", "HAS_DUAL", "HAS_PG_CLAMP", "HAS_KL_CLAMP", "USE_QKL", "USE_POLICY_KL",
    "ENTROPY_IN_TERM", "SEQUENCE_RATIO", "BIAS_CORRECTION", "PER_TOKEN_MEAN", "HAS_OFF_POLICY", "HAS_ENTROPY_FILTER")
_OBJECTIVE_SAMPLE_POINTERS = (
    "logp_ptr", "entropy_ptr", "advantages_ptr", "ref_query_logp_ptr", "query_weight_ptr", "old_logp_ptr",
    "ref_logp_ptr", "token_weight_ptr", "rollout_logp_ptr", "entropy_threshold_ptr", "partials_ptr", "query_logp_ptr",
    "response_logp_ptr", "coef_logp_ptr", "coef_entropy_ptr")
_OBJECTIVE_SAMPLE_SCALARS = (
    "clip_low", "clip_high", "dual_clip", "pg_log_ratio_clamp", "log_ratio_clamp", "kl_clamp", "log_rollout_is_cap",
    "qkl_coef", "qkl_linear_beyond", "policy_kl_coef", "entropy_coef", "cispo_clip_max", "sapo_temperature_pos",
    "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
    "off_policy_mask_threshold")
OBJECTIVE_SAMPLE_SIGNATURE = dict({name: "*fp32" for name in _OBJECTIVE_SAMPLE_POINTERS}, kind_ptr="*i64",
                                  order_ptr="*i64", starts_ptr="*i64", sample_ptr="*i64", sample_ids_ptr="*i64",
                                  **{name: "fp32" for name in _OBJECTIVE_SAMPLE_SCALARS})


def compile_for_hopper(kernel, signature: dict, constexprs: dict, divisible_by_16=(), **options):
    """Compile `kernel` (@triton.jit, possibly in interpreter mode) for sm_90; returns the compiled kernel.
    constexprs: every constexpr parameter's value (a ValueError names those left out; one with a default takes it
    when left out, as a launch does), and None for a pointer the launch passes as None.
    divisible_by_16: the arguments the launcher would specialize as multiples of 16 (aligned pointers, strides and
    sizes such as V = 152064), which lets Triton vectorize the loads as it does at run time."""
    python_fn = getattr(kernel, "fn", kernel)
    jit_fn = python_fn if isinstance(python_fn, JITFunction) else JITFunction(python_fn)
    constexprs = {**{param.name: param.default for param in jit_fn.params if param.is_constexpr and param.has_default},
                  **constexprs}
    missing = [param.name for param in jit_fn.params if param.is_constexpr and param.name not in constexprs]
    if missing:  # triton.compile would compile the kernel without them (a branch on a missing flag drops silently)
        raise ValueError(f"compile_for_hopper: {jit_fn.__name__}'s constexpr parameters {', '.join(missing)} are not "
                         f"given; pass each in constexprs, as the launch would")
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    attrs = {(jit_fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible_by_16}
    compiled = triton.compile(ASTSource(fn=jit_fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=HOPPER, options=options)
    assert compiled.asm["cubin"], "no cubin produced"
    assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT, f"shared memory {compiled.metadata.shared} B"
    return compiled


@contextlib.contextmanager
def launch_specializations(kernel_names):
    """Yields a list that gets, for each launch in the block of a Triton kernel whose name is in `kernel_names`
    (compiled or interpreted; the launch goes on), how the compiled launcher specializes it (Triton 3.6's
    `native_specialize_impl` with the CUDA backend, as `JITFunction.run` calls it): a dict of the kernel's module and
    name, num_warps, each parameter's signature type (constexprs, None and integers equal to 1 as "constexpr"), the
    constexpr values, and the pointers and integers it takes as multiples of 16. `compile_launch` compiles it."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    launches = []

    def record(kernel, args, kwargs):
        if kernel.fn.__name__ in kernel_names:
            parameters = inspect.signature(kernel.fn).parameters
            bound = inspect.signature(kernel.fn).bind(*args, **{name: value for name, value in kwargs.items()
                                                               if name in parameters})
            bound.apply_defaults()
            signature, constexprs, divisible = {}, {}, []
            for name, value in bound.arguments.items():
                if "constexpr" in str(parameters[name].annotation):
                    signature[name], constexprs[name] = "constexpr", value
                    continue
                kind, key = native_specialize_impl(CUDABackend, value, False, True, True)
                signature[name] = kind
                if kind == "constexpr":
                    constexprs[name] = key
                elif key == "D":
                    divisible.append(name)
            launches.append(dict(module=kernel.fn.__module__, kernel=kernel.fn.__name__,
                                 num_warps=kwargs.get("num_warps", 4), signature=signature,
                                 constexprs=constexprs, divisible_by_16=divisible))

    with watched_launches(record):
        yield launches


def compile_launch(launch: dict):
    """Compile for sm_90 one launch `launch_specializations` recorded, as the launcher would compile it."""
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    signature = {name: kind for name, kind in launch["signature"].items() if kind != "constexpr"}
    return compile_for_hopper(kernel, signature, launch["constexprs"], divisible_by_16=launch["divisible_by_16"],
                              num_warps=launch["num_warps"])


def reduction_layouts(ttgir: str) -> dict:
    """The layouts (their #ttg definitions) in a kernel's TTGIR that fix the order of its sums on the GPU: of each
    tensor a `tl.sum` / `tl.max` reduces ("reduced"; a constant's left out: zeros sum to zero in any order), and
    of each tensor a loop carries (its accumulators, "carried"). A thread first adds the lanes it holds, in
    register order, then the threads' sums are combined by warp shuffles and across warps: the same layout, the
    same order, the same bits."""
    definitions = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, flags=re.MULTILINE))
    reduced, carried = set(), set()
    operand = None
    for line in ttgir.splitlines():
        opening = re.search(r'"tt\.reduce"\((%[\w#]+)\)', line)
        if opening:
            operand = opening.group(1)
            continue
        closing = re.match(r"\s*\}\) : \(tensor<[^,]+, (#\w+)>\)", line)
        if operand is not None and closing:
            if not operand.startswith("%cst"):
                reduced.add(definitions[closing.group(1)])
            operand = None
        if "scf.while" in line or "scf.for" in line:
            carried.update(definitions[alias] for alias in re.findall(r"tensor<\d+xf32, (#\w+)>", line))
    return dict(reduced=sorted(reduced), carried=sorted(carried))


def loop_layout_conversions(ttgir: str) -> list:
    """The layout conversions (`ttg.convert_layout`) in each outermost loop (`scf.while` / `scf.for`) of a kernel's
    TTGIR, in the loops' order (a loop nested in another counts in its outer one). Each one inside a loop is a
    shuffle, often through shared memory, at every step: what a store or load whose pointer the compiler cannot prove
    as aligned as the loop's others costs (`triton_objective._node_regions`)."""
    counts, depth, loop_depth = [], 0, None
    for line in ttgir.splitlines():
        if loop_depth is None and re.search(r"\bscf\.(while|for)\b", line):
            loop_depth = depth
            counts.append(0)
        if loop_depth is not None and "ttg.convert_layout" in line:
            counts[-1] += 1
        depth += line.count("{") - line.count("}")
        if loop_depth is not None and depth <= loop_depth:
            loop_depth = None
    return counts


def register_usage(compiled) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) of a compiled kernel, from `ptxas -v` on its PTX (Triton runs the
    same ptxas but keeps its report only on a cache miss). Spills to local memory cost a kernel its speed."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([get_ptxas(HOPPER.arch).path, "-v", f"--gpu-name=sm_{HOPPER.arch}a", str(ptx),
                                 "-o", str(Path(folder) / "kernel.cubin")], capture_output=True, text=True,
                                check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return registers, spills


def disassembler() -> Optional[str]:
    """The nvdisasm Triton uses (triton.knobs: $TRITON_NVDISASM_PATH, else the one in triton/backends/nvidia/bin), or
    None where there is none. Not the one beside ptxas: $TRITON_PTXAS_PATH may name another CUDA's ptxas (on the GPU
    image, 2026-11-26, ptxas was torch's, torch/bin/ptxas, with no nvdisasm beside it)."""
    from triton import knobs

    try:
        return knobs.nvidia.nvdisasm.path
    except RuntimeError:  # "Cannot find nvdisasm"
        return None


def loop_instructions(compiled, nvdisasm: str) -> int:
    """SASS instructions in the longest loop of a compiled kernel (a backward branch's span, from the `nvdisasm` at
    that path: `disassembler()`): for a row kernel, what one step of its loop over the vocabulary costs every
    thread."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    address = {}  # label -> address of the instruction after it
    pending = []
    instructions = []  # (address, text)
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        at = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if at:
            for name in pending:
                address[name] = int(at.group(1), 16)
            pending = []
            instructions.append((int(at.group(1), 16), line))
    longest = 0
    for here, line in instructions:
        target = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", line)
        if target and address.get(target.group(1), here) < here:
            start = address[target.group(1)]
            longest = max(longest, sum(start <= at <= here for at, _ in instructions))
    return longest


def run_compile_script(script: str, *arguments: str) -> str:
    """Run tests/workers/`script` (with `arguments`) in a fresh process without TRITON_INTERPRET (under the
    interpreter, triton.language's own @jit helpers and tensor methods cannot be compiled); returns its stdout,
    asserting it exited 0."""
    import os
    import subprocess
    import sys

    from paths import WORKERS, worker_pythonpath

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = worker_pythonpath()
    proc = subprocess.run([sys.executable, str(WORKERS / script), *arguments], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout
