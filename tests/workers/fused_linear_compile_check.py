"""Compile every GPU autotune config of the fused-linear kernels for sm_90 (run without TRITON_INTERPRET; used by
tests/kernels/test_fused_linear.py). Each config is compiled the way the JIT specializes a real call: unit strides are
constants, and pointers, leading strides and sizes are 16-divisible, so loads are vectorized and pipelined.
The backward's GEMM is compiled in both of its layouts: d hidden += dlogits @ W (A row-major, C the fp32
accumulator, or hidden's own rows when fp32) and d weight (+)= dlogits^T @ H (A column-major, C in the weight's
dtype, rows of H masked by k_valid). bf16: every config, checked to use wgmma and async copies; fp32 (slow to
compile): the first config whose stages fit shared memory; and the fp32 dlogits x fp16 d-weight GEMM of fp16 inputs.
Prints one 'compiled ...' line per kernel and config, with its registers per thread and spill bytes (ptxas)."""
import triton
from triton.compiler import ASTSource

from compile_check import HOPPER, SHARED_MEMORY_LIMIT, register_usage
from erpo_kernels import triton_fused_linear as kernels

LINEAR = dict(hidden_ptr="*DT", stride_hn="i32", stride_hd="i32", weight_ptr="*DT", stride_wv="i32",
              stride_wd="i32", bias_ptr="*DT", targets_ptr="*i64", hidden_dim="i32", logit_scale="fp32",
              logit_softcap="fp32", inv_temperature="fp32")
FORWARD = dict(LINEAR, max_ptr="*fp32", sum_exp_ptr="*fp32", sum_exp_shifted_ptr="*fp32",
               target_logit_ptr="*fp32", num_rows="i32", vocab_size="i32", split_size="i32")
GRAD = dict(LINEAR, lse_ptr="*fp32", entropy_ptr="*fp32", grad_logp_ptr="*fp32", grad_entropy_ptr="*fp32",
            out_ptr="*DT", stride_on="i32", stride_ov="i32", row_start="i32", row_end="i32", col_start="i32",
            col_end="i32", block_cols="i32")
MATMUL = dict(a_ptr="*DT", stride_am="i32", stride_ak="i32", b_ptr="*DT", stride_bk="i32", stride_bn="i32",
              c_ptr="*DT", stride_cm="i32", stride_cn="i32", k_valid_ptr="*i8", M="i32", N="i32", K="i32",
              m_bucket="i32", k_bucket="i32")
UNIT = dict(stride_hd=1, stride_wd=1, HAS_BIAS=True, SOFTCAP=False)
CASES = [("forward", kernels._forward_partials_kernel, FORWARD, UNIT, kernels.GPU_FORWARD_CONFIGS),
         ("grad_logits", kernels._grad_logits_kernel, GRAD, dict(UNIT, stride_ov=1),
          kernels.GPU_GRAD_LOGITS_CONFIGS),
         ("matmul", kernels._matmul_kernel, dict(MATMUL, c_ptr="*fp32"),
          dict(stride_ak=1, stride_bn=1, stride_cn=1, ACCUMULATE=True, HAS_K_VALID=False), kernels.GPU_MATMUL_CONFIGS)]
D_WEIGHT_LAYOUT = dict(stride_am=1, stride_bn=1, stride_cn=1, ACCUMULATE=True, HAS_K_VALID=True)
D_WEIGHT = ("matmul-dweight", kernels._matmul_kernel, MATMUL, D_WEIGHT_LAYOUT, kernels.GPU_MATMUL_CONFIGS)


def stage_bytes(config, dtype_bytes: int) -> int:
    block = config.kwargs
    return (block["BLOCK_M"] + block["BLOCK_N"]) * block["BLOCK_K"] * dtype_bytes


def compile_config(kernel, signature, constexprs, config, dtype: str, upcast: bool = False):
    fn = kernel.fn
    constexprs = dict(constexprs, **config.kwargs, UPCAST=upcast, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    signature = {name: "constexpr" if name in constexprs else kind.replace("DT", dtype)
                 for name, kind in signature.items()}
    divisible = [name for name, kind in signature.items() if kind.startswith("*") or kind == "i32"]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=HOPPER, options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    assert compiled.asm["cubin"], "no cubin"
    assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT, f"shared memory {compiled.metadata.shared} B"
    ttgir = compiled.asm["ttgir"]
    assert "async_copy_global_to_local" in ttgir, "global loads are not pipelined"
    if dtype == "bf16":
        assert "warp_group_dot" in ttgir, "no wgmma"
    return compiled


def main():
    for dtype, dtype_bytes in (("bf16", 2), ("fp32", 4)):
        for name, kernel, signature, constexprs, configs in CASES + ([D_WEIGHT] if dtype == "bf16" else []):
            fitting = [c for c in configs if stage_bytes(c, dtype_bytes) * c.num_stages <= SHARED_MEMORY_LIMIT]
            for config in fitting if dtype == "bf16" else fitting[:1]:
                compiled = compile_config(kernel, signature, constexprs, config, dtype)
                registers, spills = register_usage(compiled)
                print(f"compiled {name} {dtype} {config.kwargs} warps={config.num_warps} stages={config.num_stages} "
                      f"shared={compiled.metadata.shared} registers={registers} spill_bytes={spills}", flush=True)
    # The soft-cap variant (a constexpr branch in the epilogue) of the forward and dlogits kernels: first bf16 config.
    for name, kernel, signature, constexprs, configs in CASES[:2]:
        compiled = compile_config(kernel, signature, dict(constexprs, SOFTCAP=True), configs[0], "bf16")
        registers, spills = register_usage(compiled)
        print(f"compiled {name}-softcap bf16 {configs[0].kwargs} registers={registers} spill_bytes={spills}",
              flush=True)
    # fp16 inputs: fp32 dlogits^T (a) against fp16 hidden (b) into the fp16 d weight, cast to fp32 for a TF32 dot.
    config = next(c for c in kernels.GPU_MATMUL_CONFIGS if stage_bytes(c, 4) * c.num_stages <= SHARED_MEMORY_LIMIT)
    compiled = compile_config(kernels._matmul_kernel, dict(MATMUL, a_ptr="*fp32"), D_WEIGHT_LAYOUT, config, "fp16",
                              upcast=True)
    print(f"compiled mixed-matmul fp32 x fp16 {config.kwargs} shared={compiled.metadata.shared}", flush=True)


if __name__ == "__main__":
    main()
