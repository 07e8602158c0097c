"""Compile the logits-path kernels for sm_90 (run without TRITON_INTERPRET; used by
tests/kernels/test_compile_hopper.py). Prints one 'compiled ...' line per kernel and dtype,
with its registers per thread and spill bytes (ptxas)."""
from compile_check import compile_for_hopper, register_usage
from erpo_kernels import triton_logits, triton_segment

BLOCK_V = triton_logits.block_size_for(152064)


def main():
    for dtype in ("bf16", "fp16", "fp32"):
        common = {"logits_ptr": f"*{dtype}", "stride_row": "i64", "stride_col": "i32", "targets_ptr": "*i64",
                  "vocab_size": "i32", "logit_scale": "fp32", "logit_softcap": "fp32", "inv_temperature": "fp32"}
        for softcap in (False, True):  # the soft-cap is a constexpr branch: both variants compile
            variant = "-softcap" if softcap else ""
            compiled = compile_for_hopper(triton_logits._logp_entropy_forward_kernel,
                                          dict(common, logp_ptr="*fp32", entropy_ptr="*fp32", lse_ptr="*fp32"),
                                          {"SOFTCAP": softcap, "BLOCK_V": BLOCK_V}, num_warps=8)
            print(f"compiled forward{variant} {dtype} registers=%d spill_bytes=%d" % register_usage(compiled),
                  flush=True)
            compiled = compile_for_hopper(triton_logits._logp_entropy_backward_kernel,
                                          dict(common, grad_ptr=f"*{dtype}", grad_stride_row="i64",
                                               grad_stride_col="i32", lse_ptr="*fp32", entropy_ptr="*fp32",
                                               grad_logp_ptr="*fp32", grad_entropy_ptr="*fp32"),
                                          {"SOFTCAP": softcap, "BLOCK_V": BLOCK_V}, num_warps=8)
            print(f"compiled backward{variant} {dtype} registers=%d spill_bytes=%d" % register_usage(compiled),
                  flush=True)
    compile_for_hopper(triton_segment._segment_sum_kernel,
                       {"values_ptr": "*fp32", "order_ptr": "*i64", "starts_ptr": "*i64", "out_ptr": "*fp32"},
                       {"BLOCK": 256})
    print("compiled segment_sum fp32", flush=True)


if __name__ == "__main__":
    main()
