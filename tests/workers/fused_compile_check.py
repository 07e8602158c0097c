"""Compile the fused-linear path's Triton kernels for sm_90, as `fused_linear_loss` launches them (run without
TRITON_INTERPRET; used by tests/kernels/test_compile_hopper_fused.py). Prints one 'compiled ...' line per kernel and
form, with its registers per thread and spill bytes (ptxas)."""
from compile_check import OBJECTIVE_SAMPLE_FLAGS, OBJECTIVE_SAMPLE_SIGNATURE, compile_for_hopper, register_usage
from erpo_kernels import triton_fill, triton_gradient_rows, triton_logits, triton_objective, triton_scale
from erpo_kernels.fused_linear_loss import CHUNK_FORWARD_VARIANT

VOCAB = 152064  # Qwen2.5's
VARIANT = triton_logits.FORWARD_VARIANTS[CHUNK_FORWARD_VARIANT]
TRANSFORM = {"logit_scale": "fp32", "logit_softcap": "fp32", "inv_temperature": "fp32"}


def report(name: str, compiled) -> None:
    print(f"compiled {name} registers=%d spill_bytes=%d" % register_usage(compiled), flush=True)


def main():
    # the chunks' row kernels on the fp32 logits buffer: the forward, and the backward writing dlogits in hidden's
    # dtype (over the first half of each fp32 row, or into the group's store), the gradients given
    block_v = triton_logits.block_size_for(VOCAB, VARIANT.widest)
    rows = {"logits_ptr": "*fp32", "stride_row": "i64", "stride_col": "i32", "targets_ptr": "*i64",
            "vocab_size": "i32", **TRANSFORM}
    for softcap in (False, True):
        suffix = "-softcap" if softcap else ""
        report(f"chunk-forward{suffix}", compile_for_hopper(
            VARIANT.kernel, dict(rows, logp_ptr="*fp32", entropy_ptr="*fp32", lse_ptr="*fp32"),
            {"SOFTCAP": softcap, "BLOCK_V": block_v}, **VARIANT.launch_options(block_v, softcap)))
        for dtype in ("bf16", "fp16", "fp32"):
            report(f"chunk-backward{suffix} {dtype}", compile_for_hopper(
                VARIANT.backward, dict(rows, grad_ptr=f"*{dtype}", grad_stride_row="i64", grad_stride_col="i32",
                                       lse_ptr="*fp32", entropy_ptr="*fp32", grad_logp_ptr="*fp32",
                                       grad_entropy_ptr="*fp32"),
                {"SOFTCAP": softcap, "BLOCK_V": triton_logits.block_size_for(VOCAB)}, num_warps=8))
    for dtype in ("bf16", "fp16", "fp32"):
        report(f"gradient-rows {dtype}", compile_for_hopper(
            triton_gradient_rows._gradient_rows_kernel,
            dict(hidden_ptr=f"*{dtype}", hidden_stride="i64", targets_ptr="*i64", grad_logp_ptr="*fp32",
                 grad_entropy_ptr="*fp32", out_ptr=f"*{dtype}", out_stride="i64", hidden_dim="i32"),
            {"BLOCK_D": triton_gradient_rows.MAX_BLOCK_D}))
        # the backward's scale passes: d weight and d bias from their fp32 accumulators, d hidden in its dtype
        for source in sorted({"fp32", dtype}):
            report(f"scale {source}->{dtype}", compile_for_hopper(
                triton_scale._scale_kernel, dict(x_ptr=f"*{source}", out_ptr=f"*{dtype}", scale_ptr="*fp32",
                                                 numel="i32"), {"BLOCK": triton_scale.BLOCK}))
    report("zero-fill", compile_for_hopper(
        triton_fill._zero_kernel, dict(first_ptr="*fp32", second_ptr="*fp32", third_ptr="*fp32", first_numel="i32",
                                       second_numel="i32", third_numel="i32"), {"BLOCK": triton_fill.BLOCK}))
    compile_chunk_objective()


def compile_chunk_objective():
    """The objective's kernels as the chunks launch them: the sample kernel over every sample's span (the global
    factors) and over a chunk's samples (sample_ids, the rows in the samples' order), every option flag off and on;
    the gradient kernel with d loss / d loss = 1."""
    sample_flags, signature = OBJECTIVE_SAMPLE_FLAGS, OBJECTIVE_SAMPLE_SIGNATURE
    optional = ("ref_query_logp_ptr", "query_weight_ptr", "old_logp_ptr", "ref_logp_ptr", "token_weight_ptr",
                "rollout_logp_ptr", "entropy_threshold_ptr")  # the chunks always pass the entropies
    for sequence in (False, True):
        for estimator, objective in (("k3", "ppo-clip"), ("k3-token", "ppo-clip"), ("k1", "vespo")):
            for on in (False, True):
                # once over every sample's span (the global factors), then per chunk over its samples (sample_ids,
                # their rows in the samples' order)
                for chunk in (False, True):
                    absent_rows = {"sample_ptr": None} if chunk else {"sample_ids_ptr": None, "order_ptr": None}
                    constexprs = dict({name: on for name in sample_flags}, HAS_ENTROPY=True, SEQUENCE_RATIO=sequence,
                                      QKL_ESTIMATOR=triton_objective.QKL_ESTIMATOR_CODES[estimator],
                                      PG_OBJECTIVE=triton_objective.PG_OBJECTIVE_CODES[objective],
                                      NUM_PARTIALS_=triton_objective.NUM_PARTIALS, BLOCK=triton_objective.ROW_BLOCK,
                                      SPANS=not chunk, HAS_SAMPLE_IDS=chunk, **absent_rows,
                                      **{name: None for name in optional if not on})
                    constexprs["HAS_DUAL"] = on and objective == "ppo-clip"
                    report(f"chunk-objective-sample sequence={sequence} {estimator} {objective} flags={on} "
                           f"sample_ids={chunk}", compile_for_hopper(triton_objective._objective_sample_kernel,
                                                                     signature, constexprs, num_warps=4))
    report("chunk-objective-grad", compile_for_hopper(
        triton_objective._objective_grad_kernel, dict(
            kind_ptr="*i64", coef_logp_ptr="*fp32", coef_entropy_ptr="*fp32", scales_ptr="*fp32",
            grad_logp_ptr="*fp32", grad_entropy_ptr="*fp32", num_rows="i32"),
        {"BLOCK": triton_objective.ROW_BLOCK, "grad_loss_ptr": None}))


if __name__ == "__main__":
    main()
