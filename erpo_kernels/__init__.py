"""erpo_kernels: the fused ERPO loss (Triton kernels and their torch reference). Contract: docs/API.md.

Modules. Public entry points: api.py (logits path; log-probs path, per-sample sums and the backend rule for trainers
that compute log-probs themselves), fused_linear.py (hidden x lm_head), padded.py ([B, T] batches in TRL's layout),
modules.py, layout.py, lm_head.py, zero3.py, model_config.py (a Hugging Face config's final-logit transform as loss
options). Shared by every path: validation.py (checks, `LossOptions`, `OPTION_CHOICES`, `LossInputs`, `LogitTransform`,
`with_option_parameters`), objective.py (the loss on per-token vectors), common.py (torch helpers, the online log-sum-
exp, the logit transform in torch). The torch reference: reference.py, segment.py, torch_fused_linear.py. The Triton
path (imported only when Triton is installed; its passes are torch.library ops, compile-ready): triton_common.py
(@triton.jit helpers), triton_logits.py, triton_objective.py (the objective on [N] vectors in three kernels, for the
options it fuses), triton_quantile.py (the entropy filter's threshold on the device), triton_row_checks.py (the value
checks, one host read; none with validate=False), triton_segment.py; direct_ops.py calls those ops' implementations
outside torch.compile (no torch.library layers on the host). fused_linear_loss.py runs the fused-linear row
chunks (GEMMs in torch, cuBLAS on CUDA) on either side's per-row kernels. Nothing on the reference side imports the
Triton path (the import contract in setup.cfg, checked by tests/repo/test_lint.py).
"""
from . import layout, lm_head, zero3
from .api import (
    MAX_QUERY_WEIGHT,
    erpo_loss,
    logprob_erpo_loss,
    query_weights,
    resolve_backend,
    sample_sums,
    token_logprobs,
)
from .fused_linear import fused_linear_erpo_loss, fused_linear_token_logprobs
from .layout import CompletionLayout, ScoredRows, completion_layout, from_padded
from .model_config import logit_transforms_from_config
from .modules import ERPOLoss, FusedLinearERPOLoss
from .objective import LossMetrics, LossOutput
from .padded import PaddedLossOutput, padded_erpo_loss
from .validation import OPTION_CHOICES, VESPO_LAMBDA_MIN, LossInputs, LossOptions, did_you_mean

__all__ = ["CompletionLayout", "ERPOLoss", "FusedLinearERPOLoss", "LossInputs", "LossMetrics", "LossOptions",
           "LossOutput", "MAX_QUERY_WEIGHT", "OPTION_CHOICES", "PaddedLossOutput", "ScoredRows", "VESPO_LAMBDA_MIN",
           "completion_layout", "did_you_mean", "erpo_loss", "from_padded", "fused_linear_erpo_loss",
           "fused_linear_token_logprobs", "layout", "lm_head", "logit_transforms_from_config", "logprob_erpo_loss",
           "padded_erpo_loss", "query_weights", "resolve_backend", "sample_sums", "token_logprobs", "zero3"]
__version__ = "0.1.0"
