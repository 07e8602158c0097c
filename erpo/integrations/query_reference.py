"""ell_theta0(q) and w(q) of an integration's training prompts, by prompt token ids: the reference cache read, or
scored once by the trainer's own actor and saved, then looked up per micro-batch. Shared by the verl and OpenRLHF
integrations, which differ only in how they score a prompt (`score`), what they record of that scoring
(`precision`) and what their errors tell the user to do (`remedy`)."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from erpo.models.fingerprint import model_fingerprint, tokenizer_fingerprint
from erpo.reference.cache import (
    ReferenceCache,
    check_scored_tokens,
    lookup_entries,
    prompt_hash,
    reference_cache_of,
    reweight_for_training_set,
    with_temperature,
)

# A cache looked up outside `load_or_build_reference` (built by hand) ends a missing prompt's error with this.
DEFAULT_REMEDY = "Delete it to rebuild it, or point the run at another cache."
# Why a cache read at start lacks a training prompt
CHANGED = "(the data, chat template, prompt truncation or tokenizer changed since it was built)."
# Why a training step's prompt is missing once the start found every training prompt there, when the trainer gives
# no reason of its own (`load_or_build_reference`'s `step_miss`): rebuilding the cache would not add it
BUILT_OTHERWISE = ("(it held every training prompt at start: the trainer built this one otherwise than they were "
                   "tokenized for the cache, and rebuilding the cache would not add it). Score the prompts as the "
                   "trainer builds them, or set qkl_coef=0 and query_weight='none'.")
# A resumed run's remedy instead (`load_or_build_reference(resumed_step=...)`): deleting the cache would have it
# refused as missing (MISSING_AT_RESUME)
RESUMED = ("The run resumes at step {step}, whose actor no longer holds the initial weights: rebuilding the cache "
           "would score them otherwise; resume with the cache and the settings of the run's start, or start afresh.")
# A resumed run without a cache: scoring now would take the checkpoint's weights for theta0. {point_at}: how the
# trainer's user points a run at a cache (`load_or_build_reference`'s `point_at`)
MISSING_AT_RESUME = ("no reference cache at {path}, and the run resumes at step {step}: ell_theta0(q) is scored with "
                     "the initial weights, which the actor no longer holds; put the cache of the run's start there "
                     "(or {point_at}), or start afresh")


@dataclass
class QueryReference:
    """ell_theta0(q) and w(q) by prompt hash (a `ReferenceCache`'s entries), sent with the loss to every worker.

    `tokenizer` (optional) only decodes a missing prompt for the error message; `why` ends that message: the likely
    cause and what to do (`load_or_build_reference` sets the trainer's own: at start CHANGED and its remedy, then,
    for the training steps, its `step_miss`)."""

    entries: dict[str, tuple[float, float]]
    path: str
    tokenizer: object = field(default=None, repr=False)
    why: str = f"{CHANGED} {DEFAULT_REMEDY}"

    def lookup(self, prompt_ids: list[list[int]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ell_theta0 [B] fp32, w [B] fp32) of these prompts, on the host or on `device`
        (`erpo.reference.cache.lookup_entries`); a prompt the cache lacks is a ValueError naming it, then `why`."""
        return lookup_entries(self.entries, prompt_ids, self.path, tokenizer=self.tokenizer, why=self.why,
                              device=device)


def load_or_build_reference(model_path: str, tokenizer, prompt_ids: list[list[int]], *, path: str,
                            temperature: float, precision: str, score: Callable[[list[list[int]]], list[float]],
                            trainer: str, remedy: str, step_miss: str = BUILT_OTHERWISE,
                            resumed_step: int | None = None, point_at: str = "point the run at it",
                            changed: Callable[[Callable[[list[int]], bool]], str | None] | None = None
                            ) -> QueryReference:
    """ell_theta0(q) and w(q) of every training prompt (token ids as the trainer's rollout builds them).

    The cache at `path` is read when it was built with this model directory's weights, this tokenizer,
    `temperature` and `precision` (the actor's: `verl_reference.engine_precision`,
    `openrlhf_reference.actor_precision`), and holds every prompt; otherwise a ValueError names what differs and
    ends with `remedy` (the trainer's way to rebuild it). `resumed_step`: the step a run resumes at from a checkpoint
    (None or 0: a fresh start), whose actor no longer holds the initial weights: its cache must be there (else a
    ValueError, MISSING_AT_RESUME, which says how to point the run at a cache in the trainer's words: `point_at`, e.g.
    "set +erpo.ref_cache=... to its path") and a refusal ends with `RESUMED` instead of `remedy`. A cache read here
    that lacks a training prompt gives CHANGED as the cause, then the remedy, or what `changed(cached)` says when it
    knows better, the cause and its own remedy (`cached(token_ids)`: whether the cache holds that prompt; verl's and
    OpenRLHF's: the chat template's date, `template_date.DatedTemplate.load_miss`). A prompt a training step
    misses later was built otherwise than the ones scored here, which no rebuild adds: its error ends with
    `step_miss` (how the trainer's prompts are tokenized here, and what to do). `trainer` ("verl", "openrlhf")
    names the trainer in the cache's template record. Without a cache, `score(prompts)` gives ell_theta0 (nats) of
    the distinct prompts with the initial weights (the actor's own forward), and the cache is saved at `path`. A prompt
    of fewer than 2 tokens has no ell_theta0(q): refused (`check_scored_tokens`)."""
    check_scored_tokens(prompt_ids, tokenizer)
    if resumed_step:
        remedy = RESUMED.format(step=resumed_step)
        if not os.path.exists(path):
            raise ValueError(MISSING_AT_RESUME.format(path=path, step=resumed_step, point_at=point_at))
    identity = dict(model_id=str(model_path), tokenizer_id=str(getattr(tokenizer, "name_or_path", "")),
                    tokenizer_fp=tokenizer_fingerprint(tokenizer))
    model_fp = model_fingerprint(str(model_path))
    template = with_temperature(trainer, temperature)
    if os.path.exists(path):
        cache = ReferenceCache.load(path)
        cache.check_compatible(**identity, model_fp=model_fp, template=None, temperature=temperature,
                               precision=precision, path=path, remedy=remedy)
    else:
        unique = {prompt_hash(ids): ids for ids in prompt_ids}
        cache = reference_cache_of(dict(zip(unique, score(list(unique.values())))), model_id=identity["model_id"],
                                   model_fp=model_fp, tokenizer=tokenizer, tokenizer_fp=identity["tokenizer_fp"],
                                   template=template, precision=precision)
        cache.save(path)
    cause = changed(cache.holds) if changed is not None else None
    reference = QueryReference(dict(cache.entries), str(path), tokenizer, cause or f"{CHANGED} {remedy}")
    reference.lookup(prompt_ids)   # every training prompt is there, or an error naming the first one
    reweight_for_training_set(reference.entries, prompt_ids)   # a cache built with other prompts too
    reference.why = step_miss      # from now on a missing prompt is one the trainer built otherwise
    return reference
