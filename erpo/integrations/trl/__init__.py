"""ERPO inside TRL: `ERPOConfig` and `ERPOTrainer`, drop-in replacements for TRL's `GRPOConfig` and `GRPOTrainer`.

ERPOTrainer keeps everything of GRPOTrainer (generation, vLLM, tools, rewards, advantages, old and reference
log-probs, logging) and overrides its loss only, `_compute_loss(model, inputs)`: one forward over prompt +
completion, then erpo_kernels' loss over the prompt rows (the Query-KL against the cached ell_theta0(q)) and the
completion rows (TRL's clipped policy gradient with TRL's normalizers, KL and importance-sampling weights). With
`qkl_coef=0` and `query_weight="none"` it equals `GRPOTrainer._compute_loss` on the same inputs.

ell_theta0(q) is computed at start for every prompt of `train_dataset` and `eval_dataset`, with the model as passed
(theta0) and the prompts tokenized by TRL's own `_tokenize_prompts`, and cached under `output_dir` (or at
`ref_cache`, which may also be a cache of `erpo precompute-ref`); entries are keyed by the prompt's token ids, which
is what reaches the loss. Until the first optimizer step a micro-batch's ell_theta0(q) is its own forward's (so the
Query-KL and its gradient are exactly 0 at theta0), and prompts the cache lacks are added then.
"""
from erpo.integrations.trl.config import ERPOConfig
from erpo.integrations.trl.trainer import ERPOTrainer

__all__ = ["ERPOConfig", "ERPOTrainer"]
