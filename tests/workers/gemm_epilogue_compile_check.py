"""Compile the Triton logits GEMM and its combine (erpo_kernels/triton_logits_gemm.py) for sm_90 as their GPU runs
launch them (run without TRITON_INTERPRET; used by tests/kernels/test_gemm_epilogue_probe.py):
bench.gemm_epilogue_probe's CONFIGS with and without the row statistics, their operands through pointers and through
TMA descriptors, at both lm_heads' D; the fused loss's LOSS_CONFIGS (`EpilogueRowPass`: pointers, the row statistics)
for bf16 and fp32 operands, with a bias and the soft-cap for the soft-cap's, else neither; and the combine at each
config's tile count for V = 152064, with and without the soft-cap. Prints one 'compiled ...' line per kernel with its
registers per thread, spill bytes (ptxas), whether its PTX multiplies on the tensor cores (wgmma) and whether it
copies through TMA."""
from bench import gemm_epilogue_probe as probe
from compile_check import compile_for_hopper, register_usage
from erpo_kernels import triton_logits_gemm as gemm

VOCAB = 152064  # Qwen2.5's
SCALARS = {"rows": "i32", "vocab": "i32", "logits_stride": "i32", "num_programs": "i32", "logit_scale": "fp32",
           "logit_softcap": "fp32", "inv_temperature": "fp32"}
ALIGNED = ("hidden", "weight", "bias_ptr", "logits_ptr", "stats_ptr", "vocab", "logits_stride")  # V: a multiple of 16
COMBINE_SIGNATURE = {"stats_ptr": "*fp32", "logits_ptr": "*fp32", "logits_stride": "i32", "targets_ptr": "*i64",
                     "logp_ptr": "*fp32", "entropy_ptr": "*fp32", "lse_ptr": "*fp32", "tiles": "i32", "vocab": "i32",
                     "logit_scale": "fp32", "logit_softcap": "fp32", "inv_temperature": "fp32"}


def report(name: str, compiled) -> None:
    ptx = compiled.asm["ptx"]
    print(f"compiled {name} registers=%d spill_bytes=%d" % register_usage(compiled)
          + f" wgmma={'wgmma.mma_async' in ptx} tma_copies={'cp.async.bulk.tensor' in ptx}", flush=True)


def compile_gemm(config, dim: int, dtype: str, row_stats: bool, tma: bool, bias: bool, softcap: bool):
    # descriptors: their element type and box, as TensorDescriptor.from_tensor makes them
    operands = ({"hidden": f"tensordesc<{dtype}[{config.block_m},{config.block_k}]>",
                 "weight": f"tensordesc<{dtype}[{config.block_n},{config.block_k}]>"} if tma
                else {"hidden": f"*{dtype}", "weight": f"*{dtype}"})
    signature = {**operands, "bias_ptr": f"*{dtype}", "logits_ptr": "*fp32", "stats_ptr": "*fp32", **SCALARS}
    return compile_for_hopper(
        gemm._logits_gemm_kernel, signature,
        dict(DIM=dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=gemm.GROUP_M,
             HAS_BIAS=bias, ROW_STATS=row_stats, SOFTCAP=softcap, TMA=tma, DOT_IN_FP32=False, IEEE=dtype == "fp32"),
        divisible_by_16=ALIGNED[2:] if tma else ALIGNED, num_warps=config.num_warps, num_stages=config.num_stages)


def main():
    for dim in (3584, 5120):
        for config in probe.CONFIGS:
            for row_stats in (False, True):
                for tma in (False, True):
                    report(f"gemm D={dim} {config} row_stats={row_stats} tma={tma}",
                           compile_gemm(config, dim, "bf16", row_stats, tma, False, False))
    for (size, softcap), config in gemm.LOSS_CONFIGS.items():
        dtype = {2: "bf16", 4: "fp32"}[size]
        report(f"loss gemm {dtype} {config} bias={softcap} softcap={softcap}",
               compile_gemm(config, 3584, dtype, True, False, softcap, softcap))
    configs = (*probe.CONFIGS, *gemm.LOSS_CONFIGS.values())
    for tiles in sorted({gemm.tile_count(VOCAB, config) for config in configs}):
        for softcap in (False, True):
            report(f"combine tiles={tiles} softcap={softcap}", compile_for_hopper(
                gemm._combine_kernel, COMBINE_SIGNATURE,
                {"TILES_BLOCK": 1 << (tiles - 1).bit_length(), "SOFTCAP": softcap}, num_warps=4))


if __name__ == "__main__":
    main()
