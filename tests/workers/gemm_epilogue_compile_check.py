"""Compile bench.gemm_epilogue_probe's Triton kernels for sm_90 as its GPU run launches them (run without
TRITON_INTERPRET; used by tests/kernels/test_gemm_epilogue_probe.py): each of its CONFIGS with and without the row
statistics, its operands through pointers and through TMA descriptors, at both lm_heads' D, and the combine at each
config's tile count for V = 152064. Prints one 'compiled ...' line per kernel with its registers per thread, spill
bytes (ptxas), whether its PTX multiplies on the tensor cores (wgmma) and whether it copies through TMA."""
from bench import gemm_epilogue_probe as probe
from compile_check import compile_for_hopper, register_usage

VOCAB = 152064  # Qwen2.5's
GEMM_SIGNATURE = {"hidden": "*bf16", "weight": "*bf16", "logits_ptr": "*fp32", "stats_ptr": "*fp32",
                  "rows": "i32", "vocab": "i32", "logits_stride": "i32", "num_programs": "i32"}
ALIGNED = ("hidden", "weight", "logits_ptr", "stats_ptr", "vocab", "logits_stride")  # V: a multiple of 16
COMBINE_SIGNATURE = {"stats_ptr": "*fp32", "logits_ptr": "*fp32", "logits_stride": "i32", "targets_ptr": "*i64",
                     "logp_ptr": "*fp32", "entropy_ptr": "*fp32", "lse_ptr": "*fp32", "tiles": "i32"}


def report(name: str, compiled) -> None:
    ptx = compiled.asm["ptx"]
    print(f"compiled {name} registers=%d spill_bytes=%d" % register_usage(compiled)
          + f" wgmma={'wgmma.mma_async' in ptx} tma_copies={'cp.async.bulk.tensor' in ptx}", flush=True)


def main():
    for dim in (3584, 5120):
        for config in probe.CONFIGS:
            for row_stats in (False, True):
                for tma in (False, True):
                    # descriptors: their element type and box, as TensorDescriptor.from_tensor makes them
                    operands = {"hidden": f"tensordesc<bf16[{config.block_m},{config.block_k}]>",
                                "weight": f"tensordesc<bf16[{config.block_n},{config.block_k}]>"} if tma else {}
                    report(f"gemm D={dim} {config} row_stats={row_stats} tma={tma}", compile_for_hopper(
                        probe._logits_gemm_kernel, {**GEMM_SIGNATURE, **operands},
                        dict(DIM=dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                             GROUP_M=probe.GROUP_M, ROW_STATS=row_stats, TMA=tma, DOT_IN_FP32=False),
                        divisible_by_16=ALIGNED[2:] if tma else ALIGNED, num_warps=config.num_warps,
                        num_stages=config.num_stages))
    for tiles in sorted({probe.tile_count(VOCAB, config) for config in probe.CONFIGS}):
        report(f"combine tiles={tiles}", compile_for_hopper(
            probe._combine_kernel, COMBINE_SIGNATURE, {"TILES_BLOCK": 1 << (tiles - 1).bit_length()}, num_warps=4))


if __name__ == "__main__":
    main()
