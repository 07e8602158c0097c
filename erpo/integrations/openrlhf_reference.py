"""ell_theta0(q) and w(q) of OpenRLHF's training prompts: a reference cache scored once at theta0 by the actor's own
forward (`actor_row_logprobs`), looked up per micro-batch by the prompt's token ids.

The prompts are OpenRLHF's `PromptDataset` prompts (its chat template or input_template already applied by its own
`preprocess_data`), tokenized as its agent executors tokenize them (`tokenizer(text=prompt,
add_special_tokens=False)`, kept to the last max_prompt_length tokens when longer), so that a prompt's key is the
token ids that reach the loss. Each prompt is scored alone through `actor_row_logprobs`, the forward and kernels of
the `actor_logprobs` the training step calls on prompt + response (its path too: Actor.forward's logits, or with
`fused_linear` hidden states x lm_head): tokens 2..P summed, the same Actor (dtype, attention kernel, temperature),
the same kernels; so the Query-KL at theta0 is 0 up to how the forward's rounding
depends on the batch around the prompt. The cache records the model's weights, the tokenizer, the temperature and
this precision; a cache built otherwise, or lacking a training prompt (another tokenizer, chat template or
truncation), is refused in one line naming what differs (`erpo.integrations.query_reference`:
`load_or_build_reference`, `QueryReference.lookup`), never read as a wrong value. A chat template that writes
today's date (`erpo.integrations.template_date`) is said at start, and a cache built on another day is refused
naming that day.
"""
from __future__ import annotations

import logging
import os
from functools import partial

import torch

from erpo.integrations.openrlhf import actor_row_logprobs
from erpo.integrations.query_reference import QueryReference, load_or_build_reference
from erpo.integrations.template_date import DatedTemplate, DateSettings, date_dependence
from erpo.reference.cache import compute_query_logp
from erpo.sequences import scoring_precision

# the scoring path a cache scored here records (`actor_precision`): Actor.forward's logits, or the fused-linear path
ACTOR_PATH, FUSED_LINEAR_PATH = "openrlhf-actor", "openrlhf-fused-linear"
REBUILD = "Delete it to rebuild it, or pass another path to load_or_build_query_reference."
POINT_AT = "pass its path to load_or_build_query_reference"   # how a resumed run is pointed at its start's cache
# what a prompt missing at a training step ends with: the cache held every prompt it was given, so the step's prompt
# is not one of them as tokenized there, and no rebuild adds it
STEP_MISS = ("(it held every prompt given to load_or_build_query_reference, tokenized as OpenRLHF's agent executors "
             "tokenize them, left-truncated to its max_prompt_length; this one reached the loss otherwise, and "
             "rebuilding the cache would not add it). Pass it the PromptDataset's prompts (dataset.prompts) and "
             "max_prompt_length=data.max_len - (rollout.max_new_tokens or 1), as OpenRLHF truncates a long prompt.")
# a chat template that writes today's date (`template_date`): where the fix goes (OpenRLHF 0.11's preprocess_data passes
# the template no keyword arguments, so no date_string; a resumed run needs its start's cache), and the chat whose two
# renders find the date in a prompt
DATE_SETTINGS = DateSettings(kwargs=None, template="the tokenizer of --actor.model_name_or_path",
                             resume_rebuilds=False)
DATE_PROBE = [{"role": "user", "content": "1+1="}]
DATE_CONTEXT = 24   # characters of the template's text before the date that place it in a prompt
logger = logging.getLogger(__name__)


def prompt_token_ids(tokenizer, prompts: list[str], *, max_prompt_length: int | None = None) -> list[list[int]]:
    """Token ids of each prompt text as OpenRLHF 0.11's agent executors tokenize a PromptDataset prompt:
    `tokenizer(text=prompt, add_special_tokens=False)`, kept to its last `max_prompt_length` tokens when longer
    (OpenRLHF's truncation, max_len minus the generation budget; None: never truncated)."""
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be None or an integer >= 1, got {max_prompt_length!r}")
    ids = [list(tokenizer(text=prompt, add_special_tokens=False)["input_ids"]) for prompt in prompts]
    return ids if max_prompt_length is None else [p[-max_prompt_length:] for p in ids]


def on_date(prompt: str, today: str, other: str) -> str:
    """`prompt`, a text a chat template rendered today, as it renders on another date: `today` and `other` are one
    chat rendered today and on that date, so they differ in the date alone; that span of `today`, found once in
    `prompt` after the DATE_CONTEXT characters of the template before it, becomes `other`'s. `prompt` itself when
    the renders agree, or when the span is not found once (a prompt the template did not render, or whose date
    follows its own messages)."""
    start = len(os.path.commonprefix([today, other]))
    end = len(os.path.commonprefix([today[start:][::-1], other[start:][::-1]]))   # the common tail after `start`
    if start == len(today) == len(other):
        return prompt
    before = today[max(0, start - DATE_CONTEXT):start]
    was, becomes = before + today[start:len(today) - end], before + other[start:len(other) - end]
    return prompt.replace(was, becomes) if prompt.count(was) == 1 else prompt


def template_date(tokenizer, prompt: str, prompt_ids: list[int], max_prompt_length: int | None
                  ) -> DatedTemplate | None:
    """Whether the chat template wrote today's date into the PromptDataset's prompts (`date_dependence`), by the
    first one: its text `prompt` (rendered today by OpenRLHF's `preprocess_data`) and token ids `prompt_ids` as
    `prompt_token_ids` took them (`max_prompt_length`), rendered again as on another date by `on_date` (the prompts
    are texts: the date is found in them by rendering DATE_PROBE today and on that date). None without a chat
    template, for prompts it did not render (OpenRLHF's input_template) and for a date the truncation cuts off."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None

    def chat(extra: dict) -> str:
        return tokenizer.apply_chat_template(DATE_PROBE, tokenize=False, add_generation_prompt=True, **extra)

    today = chat({})
    return date_dependence(lambda extra: prompt_token_ids(tokenizer, [on_date(prompt, today, chat(extra))],
                                                          max_prompt_length=max_prompt_length)[0], prompt_ids)


def actor_precision(actor, *, fused_linear: bool = False) -> str:
    """What a cache scored by `actor` records besides the weights, tokenizer and temperature
    (`erpo.sequences.scoring_precision`): the model's parameter dtype and device, the autocast in effect, the path
    ("openrlhf-actor": Actor.forward's fp32 logits into erpo_kernels; "openrlhf-fused-linear": `fused_linear`'s
    hidden states x lm_head in the kernels, whose log-probs differ from the logits' by the lm_head's rounding), the
    logit transform, and the attention kernel
    (`config._attn_implementation`). `actor`: an OpenRLHF Actor, its `model` the Hugging Face model or, in
    OpenRLHF's trainer, the DeepSpeed engine around it (`strategy.prepare` sets `actor.model = engine`)."""
    model = actor.model
    model = getattr(model, "module", model)   # the engine's own `config` is DeepSpeed's config dict
    param = next(model.parameters())
    device = param.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    scoring = scoring_precision(model.config, param.dtype, param.device,
                                path=FUSED_LINEAR_PATH if fused_linear else ACTOR_PATH, autocast=autocast)
    return f"{scoring},attention={model.config._attn_implementation}"


@torch.no_grad()
def score_prompts(actor, prompt_ids: list[list[int]], *, pad_id: int, batch_size: int,
                  fused_linear: bool = False) -> list[float]:
    """ell(q) (nats) of each prompt under `actor`, in eval mode, `batch_size` prompts a forward
    (`erpo.reference.cache.compute_query_logp`), each right-padded as OpenRLHF 0.11 lays out a sequence, with no
    action: `actor_row_logprobs`' prompt rows (on the path `fused_linear` picks), summed by `sample_sums` as
    `actor_logprobs` sums them."""
    def score(batch):   # the log-probs of the batch's scored rows: the prompts' tokens 2..P
        no_action = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1, dtype=torch.bool,
                                device=batch.input_ids.device)
        return actor_row_logprobs(actor, batch.input_ids, no_action, batch.attention_mask,
                                  fused_linear=fused_linear).logp[batch.rows]

    return compute_query_logp(actor, prompt_ids, pad_id=pad_id, batch_size=batch_size, score=score).tolist()


def load_or_build_query_reference(actor, tokenizer, prompts: list[str], *, path: str, model_path: str,
                                  max_prompt_length: int | None = None, batch_size: int = 8,
                                  resumed_step: int | None = None, fused_linear: bool = False) -> QueryReference:
    """ell_theta0(q) and w(q) of every training prompt, for `ERPOPolicyLoss`: `QueryReference.lookup(prompt_ids,
    device)` -> (ell_theta0 [B], w [B]) for `actor_logprobs`' prompt_ids. `actor`: OpenRLHF's Actor at theta0 as the
    run loads it (the same dtype and attention kernel: they are recorded); `prompts`: the PromptDataset's prompt
    texts; `model_path`: the actor's pretrain directory or hub name (its weights' fingerprint is recorded);
    `max_prompt_length`: OpenRLHF's prompt truncation (`prompt_token_ids`). The cache at `path` is read when it
    matches (weights, tokenizer, the actor's temperature, `actor_precision`) and holds every prompt, else refused in
    one line; without one, the prompts are scored (`score_prompts`) and the cache saved there. `resumed_step`: the
    step a run resumes at from a checkpoint (None: a fresh start), whose actor no longer holds theta0: its cache must
    exist, and a mismatch's remedy is to resume with the cache and settings of the run's start, not to rebuild.
    `fused_linear`: the path the training step's `actor_logprobs` takes (the cache records it; a cache scored on the
    other path is refused in one line). A chat template that writes today's date into the prompts (`template_date`)
    is said in one warning; a cache that lacks them because it was built on another day is refused naming that day
    (`DatedTemplate.load_miss`)."""
    if not prompts:
        raise ValueError("prompts is empty: pass the PromptDataset's prompt texts (dataset.prompts)")
    prompt_ids = prompt_token_ids(tokenizer, prompts, max_prompt_length=max_prompt_length)
    dated = template_date(tokenizer, prompts[0], prompt_ids[0], max_prompt_length)
    if dated is not None:   # OpenRLHF renders the prompts at each start
        logger.warning("ERPO: %s", dated.start_warning("OpenRLHF", DATE_SETTINGS, at_each_step=False))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return load_or_build_reference(
        model_path, tokenizer, prompt_ids, path=path, temperature=getattr(actor, "temperature", 1.0),
        precision=actor_precision(actor, fused_linear=fused_linear), remedy=REBUILD, trainer="openrlhf",
        step_miss=STEP_MISS, resumed_step=resumed_step, point_at=POINT_AT,
        changed=None if dated is None else partial(dated.load_miss, settings=DATE_SETTINGS),
        score=lambda ids: score_prompts(actor, ids, pad_id=pad_id, batch_size=batch_size, fused_linear=fused_linear))
