"""The transform a Hugging Face causal LM applies to its logits after the lm_head, read from its config as the loss
options `logit_scale` and `logit_softcap` (`validation.LogitTransform`), so a caller that scores hidden @ lm_head
(the fused-linear path) or the raw lm_head output gets the model's own log-probabilities.

Each attribute below was read off the model's forward in transformers' modeling files; an attribute whose name looks
like a final-logit transform and that this module does not know is refused (one ValueError), never ignored.
"""
from __future__ import annotations

import math
import re

# Final-logit soft-caps c: logits -> c * tanh(logits / c), None = off.
SOFTCAP_ATTRIBUTES = (
    "final_logit_softcapping",  # Gemma 2 / 3 / 3n / 4, VaultGemma, PaliGemma, T5Gemma's decoder, nanochat, ...
    "logits_soft_cap",  # RecurrentGemma
    "output_logit_soft_cap",  # xLSTM
)
# Logit multipliers, by model family: the same name means opposite things in different families (Granite divides by
# logits_scaling, HyperCLOVAX multiplies by it), so each is read only for the model_type prefixes listed, as
# +1 (logits * value) or -1 (logits / value, or hidden / value before a bias-free lm_head). They act before the cap.
MULTIPLIER_ATTRIBUTES = {
    "logit_scale": {"cohere": +1},  # Cohere, Cohere 2 (and MoE), Command A Vision / Aya Vision's text model
    "logits_scaling": {"granite": -1, "minicpm": -1, "hyperclovax": +1},
    "lm_head_multiplier": {"falcon_h1": +1},
    "output_multiplier": {"muse": +1},  # before its final_logit_softcapping, as our order has it
    "logits_mup_width_multiplier": {"inkling": -1},
}
# Names that look like a logit transform but act elsewhere (attention scores, MoE routers, contrastive heads).
NOT_FINAL_LOGIT_ATTRIBUTES = frozenset({
    "attn_logit_softcapping", "attention_logit_cap", "conf_attention_logit_cap", "moe_router_logit_softcapping",
    "router_logit_softcapping", "logit_scale_init_value", "max_logit_scale", "contrastive_logits_temperature",
})
LOOKS_LIKE_A_LOGIT_TRANSFORM = re.compile(r"(logit|lm_head|output).*(cap|scal|mult|temp)", re.IGNORECASE)


def _number(config, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{type(config).__name__}.{name} = {value!r}: expected None or a finite number > 0")
    return float(value)


def _text_config(config):
    """The decoder's config of a composite (vision-language, encoder-decoder) config, else the config itself."""
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True)
    except TypeError:  # older signatures without `decoder`
        return getter()


def _attribute_names(config) -> set[str]:
    to_dict = getattr(config, "to_dict", None)
    return set(to_dict() if to_dict is not None else vars(config))


def logit_transforms_from_config(config) -> dict:
    """`{"logit_scale": float, "logit_softcap": float | None}` for a Hugging Face model config (a PretrainedConfig,
    or any object with those attributes): the options of `erpo_loss`, `token_logprobs`, `fused_linear_*` and
    `ERPOLoss` that reproduce the model's own final logits from its lm_head output. Identity for models without a
    transform (`{"logit_scale": 1.0, "logit_softcap": None}`).

    Raises ValueError naming the attribute when the config holds a logit transform this function does not know (a
    name that looks like one, or a known name in a model family where its meaning was not checked), two soft-caps,
    or a value that is not None or a finite number > 0.
    """
    text = _text_config(config)
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    known = set(SOFTCAP_ATTRIBUTES) | set(MULTIPLIER_ATTRIBUTES) | NOT_FINAL_LOGIT_ATTRIBUTES
    for holder in (config, text):
        for name in sorted(_attribute_names(holder)):
            if (LOOKS_LIKE_A_LOGIT_TRANSFORM.search(name) and name not in known
                    and getattr(holder, name, None) not in (None, False)):
                raise ValueError(f"{type(holder).__name__}.{name} = {getattr(holder, name)!r} looks like a transform "
                                 f"of the final logits that erpo does not know, so it cannot reproduce this model's "
                                 f"log-probabilities; pass logit_scale / logit_softcap to the loss yourself")

    caps = {name: getattr(text, name) for name in SOFTCAP_ATTRIBUTES if getattr(text, name, None) is not None}
    if len(caps) > 1:
        raise ValueError(f"{type(text).__name__} sets two final-logit soft-caps {sorted(caps)}; expected at most one")
    softcap = None
    for name, value in caps.items():
        softcap = _number(text, name, value)

    scale = 1.0
    for name, families in MULTIPLIER_ATTRIBUTES.items():
        value = getattr(text, name, None)
        if value is None:
            continue
        value = _number(text, name, value)
        direction = next((sign for prefix, sign in families.items() if model_type.startswith(prefix)), None)
        if direction is None:
            if value == 1.0:  # neutral whether it multiplies or divides
                continue
            raise ValueError(f"{type(text).__name__}.{name} = {value!r} on model_type {model_type!r}: erpo reads "
                             f"{name} only for {sorted(families)} models (it multiplies the logits in some families "
                             f"and divides them in others); pass logit_scale yourself")
        scale = scale * value if direction > 0 else scale / value
    return {"logit_scale": scale, "logit_softcap": softcap}
