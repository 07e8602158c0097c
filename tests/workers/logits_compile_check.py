"""Compile the logits-path kernels for sm_90 (run without TRITON_INTERPRET; used by
tests/kernels/test_compile_hopper.py). Prints one 'compiled ...' line per kernel and dtype,
with its registers per thread and spill bytes (ptxas)."""
from compile_check import (
    OBJECTIVE_SAMPLE_FLAGS,
    OBJECTIVE_SAMPLE_SIGNATURE,
    compile_for_hopper,
    disassembler,
    loop_instructions,
    register_usage,
)
from erpo_kernels import triton_logits, triton_objective, triton_quantile, triton_row_checks, triton_segment

BLOCK_V = triton_logits.block_size_for(152064)
# the backward kernels' two forms: the gradients given (`backward`: lse, entropy and the gradients, four pointers),
# or formed from the objective's coefficients (`node_backward`: the one node's workspace holding lse, entropy and the
# coefficients, with kind, the global factors and grad_loss)
GRADIENTS_GIVEN = {"lse_ptr": "*fp32", "entropy_ptr": "*fp32", "grad_logp_ptr": "*fp32", "grad_entropy_ptr": "*fp32"}
FROM_COEFFICIENTS = {"workspace_ptr": "*fp32", "row_stride": "i32", "kind_ptr": "*i64", "scales_ptr": "*fp32",
                     "grad_loss_ptr": "*fp32"}


def main():
    nvdisasm = disassembler()
    print(f"nvdisasm {nvdisasm}", flush=True)  # None: the loops' instructions are not counted
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
                                               grad_stride_col="i32", **GRADIENTS_GIVEN),
                                          {"SOFTCAP": softcap, "BLOCK_V": BLOCK_V}, num_warps=8)
            print(f"compiled backward{variant} {dtype} registers=%d spill_bytes=%d" % register_usage(compiled),
                  flush=True)
    compile_for_hopper(triton_segment._segment_sum_kernel,
                       {"values_ptr": "*fp32", "sample_ptr": "*i64", "spans_ptr": "*i64", "out_ptr": "*fp32"},
                       {"BLOCK": triton_segment.SUM_BLOCK})
    print("compiled segment_sum fp32", flush=True)
    for has_kind, with_scored_targets in ((False, False), (True, False), (True, True)):  # as sample_spans launches
        compile_for_hopper(triton_segment._sample_spans_kernel,
                           {"sample_ptr": "*i64", "kind_ptr": "*i64", "targets_ptr": "*i64", "spans_ptr": "*i64",
                            "num_rows": "i32", "num_samples": "i32"},
                           dict(HAS_KIND=has_kind, WITH_SCORED_TARGETS=with_scored_targets,
                                BLOCK=triton_segment.SPAN_BLOCK,
                                **({} if with_scored_targets else {"targets_ptr": None}),
                                **({} if has_kind else {"kind_ptr": None})))
    print("compiled sample-spans", flush=True)
    for name, variant in triton_logits.FORWARD_VARIANTS.items():  # the forward's variants (bench's erpo-*)
        signature = {"logits_ptr": "*bf16", "stride_row": "i64", "stride_col": "i32", "targets_ptr": "*i64",
                     "logp_ptr": "*fp32", "entropy_ptr": "*fp32", "lse_ptr": "*fp32", "vocab_size": "i32",
                     "logit_scale": "fp32", "logit_softcap": "fp32", "inv_temperature": "fp32"}
        block_v = triton_logits.block_size_for(152064, variant.widest)
        for softcap in (False, True):
            compiled = compile_for_hopper(variant.kernel, signature, {"SOFTCAP": softcap, "BLOCK_V": block_v},
                                          **variant.launch_options(block_v, softcap))
            print(f"compiled forward-variant {name}{'-softcap' if softcap else ''} bf16 registers=%d "
                  "spill_bytes=%d" % register_usage(compiled), flush=True)
        # as launched on contiguous 152064-wide bf16 rows (stride 1, aligned rows: vectorized loads): the loop's
        # SASS instructions per logit, what the forward costs beyond its bytes
        aligned = dict(signature)
        del aligned["stride_col"]
        compiled = compile_for_hopper(variant.kernel, aligned, {"stride_col": 1, "SOFTCAP": False, "BLOCK_V": block_v},
                                      divisible_by_16=("logits_ptr", "stride_row", "targets_ptr", "logp_ptr",
                                                       "entropy_ptr", "lse_ptr", "vocab_size"),
                                      **variant.launch_options(block_v, False))
        print(f"loop forward-variant {name} bf16 registers=%d" % register_usage(compiled)[0], flush=True)
        if nvdisasm:
            per_thread = block_v // (32 * (variant.num_warps or 8))
            print(f"loop forward-variant {name} bf16 instructions_per_logit=%.1f" % (
                loop_instructions(compiled, nvdisasm) / per_thread), flush=True)
    backward_signature = {"logits_ptr": "*bf16", "stride_row": "i64", "grad_ptr": "*bf16", "grad_stride_row": "i64",
                          "targets_ptr": "*i64", "vocab_size": "i32", "logit_scale": "fp32", "logit_softcap": "fp32",
                          "inv_temperature": "fp32"}
    for name, shifted, log2 in (("backward", triton_logits._logp_entropy_backward_kernel,
                                 triton_logits._logp_entropy_backward_log2_kernel),
                                ("node_backward", triton_logits._node_backward_kernel,
                                 triton_logits._node_backward_log2_kernel)):
        # the gradients given (the two ops, the fused path), or formed from the objective's coefficients (the
        # logits path's loss as one node, triton_logits_loss)
        rows, suffix = (GRADIENTS_GIVEN, "") if name == "backward" else (FROM_COEFFICIENTS, "-coefficients")
        for variant, kernel in (("shifted", shifted), ("log2", log2)):
            for softcap in (False, True):
                compiled = compile_for_hopper(
                    kernel, dict(backward_signature, stride_col="i32", grad_stride_col="i32", **rows),
                    {"SOFTCAP": softcap, "BLOCK_V": BLOCK_V}, num_warps=8)
                print(f"compiled backward-variant {variant}{'-softcap' if softcap else ''}{suffix} bf16 registers=%d "
                      "spill_bytes=%d" % register_usage(compiled), flush=True)
    for name, kernel in (("shifted", triton_logits._node_backward_kernel),
                         ("log2", triton_logits._node_backward_log2_kernel)):
        # as the logits path's loss launches it (one node: the gradients formed from the coefficients)
        compiled = compile_for_hopper(kernel, dict(backward_signature, **FROM_COEFFICIENTS),
                                      {"stride_col": 1, "grad_stride_col": 1, "SOFTCAP": False, "BLOCK_V": BLOCK_V},
                                      divisible_by_16=("logits_ptr", "stride_row", "grad_ptr", "grad_stride_row",
                                                       "targets_ptr", "workspace_ptr", "row_stride", "vocab_size"),
                                      num_warps=8)
        print(f"loop backward-variant {name} bf16 registers=%d" % register_usage(compiled)[0], flush=True)
        if nvdisasm:
            print(f"loop backward-variant {name} bf16 instructions_per_logit=%.1f" % (
                loop_instructions(compiled, nvdisasm) / (BLOCK_V // (32 * 8))), flush=True)
    compile_objective_kernels()


def compile_objective_kernels():
    """The objective's kernels with every option flag off and on (each flag is a constexpr branch)."""
    sample_flags, signature = OBJECTIVE_SAMPLE_FLAGS, OBJECTIVE_SAMPLE_SIGNATURE
    # what launch_sample_kernel passes as None (a constexpr None) where its flag is off, or its rows' form unused
    optional = ("entropy_ptr", "ref_query_logp_ptr", "query_weight_ptr", "old_logp_ptr", "ref_logp_ptr",
                "token_weight_ptr", "rollout_logp_ptr", "entropy_threshold_ptr")
    # every Query-KL estimator with PPO's surrogate, every other surrogate with k3 (the two choices are independent)
    variants = [(estimator, "ppo-clip") for estimator in triton_objective.QKL_ESTIMATOR_CODES]
    variants += [("k3", objective) for objective in triton_objective.PG_OBJECTIVE_CODES if objective != "ppo-clip"]
    for sequence in (False, True):
        for estimator, objective in variants:
            # SPANS: the logits path's rows (each sample's span), else the fused path's (an order of the rows)
            for on, spans in ((False, True), (True, True), (True, False)):
                constexprs = dict({name: on for name in sample_flags}, SEQUENCE_RATIO=sequence,
                                  QKL_ESTIMATOR=triton_objective.QKL_ESTIMATOR_CODES[estimator],
                                  PG_OBJECTIVE=triton_objective.PG_OBJECTIVE_CODES[objective],
                                  NUM_PARTIALS_=triton_objective.NUM_PARTIALS, BLOCK=triton_objective.ROW_BLOCK,
                                  SPANS=spans, HAS_SAMPLE_IDS=False, sample_ids_ptr=None,
                                  **{"sample_ptr" if not spans else "order_ptr": None},
                                  **{name: None for name in optional if not on})
                constexprs["HAS_DUAL"] = on and objective == "ppo-clip"  # dual_clip is PPO's only
                compiled = compile_for_hopper(triton_objective._objective_sample_kernel, signature, constexprs,
                                              num_warps=4)
                print(f"compiled objective-sample sequence={sequence} {estimator} {objective} flags={on} "
                      f"spans={spans} registers=%d spill_bytes=%d" % register_usage(compiled), flush=True)
    # the one-node loss's sample kernel, whose last program finishes (spans; its fp32 tensors in one workspace, its
    # float settings in one vector; every flag off and on, each loss_agg and denominator mode, a sequence-level ratio
    # with VESPO)
    node_signature = dict({name: signature[name] for name in (
        "advantages_ptr", "ref_query_logp_ptr", "query_weight_ptr", "old_logp_ptr", "ref_logp_ptr",
        "token_weight_ptr", "rollout_logp_ptr", "entropy_threshold_ptr", "kind_ptr", "sample_ptr")},
        workspace_ptr="*fp32", row_stride="i32", spans_ptr="*i64", scalars_ptr="*fp32", num_items_ptr="*fp32",
        num_seqs_ptr="*fp32", counts_ptr="*i64")
    for on, loss_agg, mode, sequence, objective in ((False, 0, 0, False, "ppo-clip"), (True, 1, 2, False, "ppo-clip"),
                                                    (True, 2, 1, True, "vespo"), (True, 0, 0, True, "cispo")):
        flags = dict({name: on for name in sample_flags}, SEQUENCE_RATIO=sequence,
                     HAS_DUAL=on and objective == "ppo-clip", ENTROPY_TOKEN_MEAN=on)
        constexprs = dict(FLAGS=triton_objective.node_flags(flags), QKL_ESTIMATOR=3,
                          PG_OBJECTIVE=triton_objective.PG_OBJECTIVE_CODES[objective], NUM_ITEMS_MODE=mode,
                          NUM_SEQS_MODE=mode, LOSS_AGG=loss_agg,
                          **{name: None for name in optional if not on and name != "entropy_ptr"},
                          **({} if mode == 2 else {"num_items_ptr": None, "num_seqs_ptr": None}))
        # the constexprs a launch passes (`kernel_arguments`), and no others
        assert constexprs.keys() >= triton_objective.kernel_arguments(
            [0.0] * len(triton_objective.SETTING_NAMES)).sample_finish_constexprs.keys()
        compiled = compile_for_hopper(triton_objective._objective_sample_finish_kernel, node_signature, constexprs,
                                      num_warps=4)
        print(f"compiled objective-sample-finish flags={on} loss_agg={loss_agg} mode={mode} sequence={sequence} "
              f"{objective} registers=%d spill_bytes=%d" % register_usage(compiled), flush=True)
    finish_flags = ("HAS_ENTROPY", "HAS_QKL_REFERENCE", "HAS_REF_LOGP", "HAS_ROLLOUT", "HAS_IS_CAP", "USE_QKL",
                    "ENTROPY_IN_TERM", "ENTROPY_TOKEN_MEAN", "HAS_OFF_POLICY", "VESPO")
    for loss_agg in (0, 1, 2):
        for mode in (0, 1, 2):
            constexprs = dict({name: mode == 1 for name in finish_flags}, NUM_ITEMS_MODE=mode, NUM_SEQS_MODE=mode,
                              LOSS_AGG=loss_agg, NUM_PARTIALS_=triton_objective.NUM_PARTIALS,
                              BLOCK=triton_objective.SAMPLE_BLOCK,
                              **({} if mode == 2 else {"num_items_ptr": None, "num_seqs_ptr": None}))
            compile_for_hopper(triton_objective._objective_finish_kernel, dict(
                partials_ptr="*fp32", query_logp_ptr="*fp32", num_items_ptr="*fp32", num_seqs_ptr="*fp32",
                loss_ptr="*fp32", metrics_ptr="*fp32", counts_ptr="*i64", scales_ptr="*fp32", num_samples="i32",
                num_items="fp32", num_seqs="fp32", qkl_coef="fp32", entropy_coef="fp32"), constexprs, num_warps=4)
    print("compiled objective-finish", flush=True)
    compile_for_hopper(triton_objective._objective_grad_kernel, dict(
        grad_loss_ptr="*fp32", kind_ptr="*i64", coef_logp_ptr="*fp32", coef_entropy_ptr="*fp32", scales_ptr="*fp32",
        grad_logp_ptr="*fp32", grad_entropy_ptr="*fp32", num_rows="i32"), {"BLOCK": triton_objective.ROW_BLOCK})
    print("compiled objective-grad", flush=True)
    for on in (False, True):
        compile_for_hopper(triton_row_checks._first_bad_row_kernel, dict(
            kind_ptr="*i64", sample_ptr="*i64", targets_ptr="*i64", token_weight_ptr="*fp32",
            rollout_logp_ptr="*fp32", code_ptr="*i64", num_rows="i32", num_samples="i32", vocab_size="i32"),
            dict(HAS_TARGETS=on, HAS_TOKEN_WEIGHT=on, HAS_ROLLOUT=on, WITH_SPANS=on, WITH_SCORED_TARGETS=on,
                 **({} if on else {"targets_ptr": None, "token_weight_ptr": None, "rollout_logp_ptr": None})))
    print("compiled first-bad-row", flush=True)
    compile_for_hopper(triton_quantile._masked_quantile_kernel, dict(
        sorted_ptr="*fp32", kind_ptr="*i64", values_ptr="*fp32", out_ptr="*fp32", num_rows="i32", q="fp32"),
        dict(POOL_KIND=2, BLOCK=triton_quantile.BLOCK_ROWS))
    print("compiled masked-quantile", flush=True)


if __name__ == "__main__":
    main()
