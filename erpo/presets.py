"""The algorithms `erpo train --algorithm` (config key `algorithm.name`) names, each a preset of the loss's
coefficients and query weight. A module of its own without imports, so that the `erpo` parser lists the choices
without loading torch and the kernels (erpo.config fills the preset into a run's config)."""
from __future__ import annotations

from typing import Any

# alpha = beta = 0.01 as in the paper (section 4.1, "default KL divergence coefficient of 0.01").
PRESETS: dict[str, dict[str, Any]] = {
    "erpo": {"qkl_coef": 0.01, "policy_kl_coef": 0.0, "query_weight": "static"},
    "grpo": {"qkl_coef": 0.0, "policy_kl_coef": 0.01, "query_weight": "none"},
    "grpo+qw": {"qkl_coef": 0.0, "policy_kl_coef": 0.01, "query_weight": "static"},
    "grpo+qkl": {"qkl_coef": 0.01, "policy_kl_coef": 0.0, "query_weight": "none"},
}
