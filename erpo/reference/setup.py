"""The reference cache of a run: ell_theta0(q) and w(q) of every training prompt under theta0, loaded and checked
against the run (model, tokenizer, prompt template, temperature) or computed once (`erpo precompute-ref`)."""
from __future__ import annotations

import logging
import os

import torch

from erpo import distributed as D
from erpo.config import Config
from erpo.errors import UserError, stopped_at_once_is
from erpo.models.fingerprint import model_fingerprint, tokenizer_fingerprint
from erpo.models.loading import device_for_rank, load_model, model_path_for, tokenizer_for, torch_dtype
from erpo.reference.cache import (
    ReferenceCache,
    build_reference_cache,
    reweight_for_training_set,
    template_id,
    with_temperature,
)
from erpo.reference.cache_path import checked_cache_path
from erpo.sequences import model_precision, scoring_precision
from erpo.tasks.data import PromptSet, dataset_rows_digest, load_prompt_set

log = logging.getLogger("erpo")


def run_precision(cfg: Config, model_path: str, model=None) -> str:
    """How `erpo train` scores (`erpo.sequences.scoring_precision`): model.dtype, no autocast, the fused-linear
    path on this rank's device, the model's logit transform; from `model` when loaded, else from its config."""
    if model is not None:
        return model_precision(model)
    from transformers import AutoConfig
    return scoring_precision(AutoConfig.from_pretrained(model_path), torch_dtype(cfg), device_for_rank())


def reference_identity(cfg: Config, model_path: str, tokenizer, model=None) -> dict:
    """What a reference cache must have been built with for this run: `ReferenceCache.check_compatible`'s
    keyword arguments (model and tokenizer ids and fingerprints, prompt template and sampling temperature, the
    precision of `run_precision`). Collective: rank 0 alone reads the weights for the model fingerprint and hands
    it to every rank."""
    model_fp = D.all_gather_object(model_fingerprint(model_path) if D.is_main() else None)[0]
    return {"model_id": model_path, "model_fp": model_fp,
            "tokenizer_id": str(tokenizer.name_or_path), "tokenizer_fp": tokenizer_fingerprint(tokenizer),
            "template": with_temperature(template_id(cfg.data.template, cfg.data.use_chat_template),
                                         cfg.rollout.temperature),
            "precision": run_precision(cfg, model_path, model)}


def precompute_reference(cfg: Config, *, overwrite: bool = False, model=None, model_path: str | None = None,
                         tokenizer=None, prompt_set: PromptSet | None = None, cache_path: str | None = None
                         ) -> tuple[ReferenceCache, str, tuple[torch.Tensor, torch.Tensor]]:
    """Load the reference cache at `cache_path` (`checked_cache_path(cfg)`'s, checked here when not given) and check
    it against this run, or build it with theta0 when it does not exist (or `overwrite`). Returns (cache, path,
    (ell_theta0 [Q], w [Q])): the cache's fp32 values for the prompt set's Q prompts (`cache.lookup`); w(q) relative
    to this prompt set (`reweight_for_training_set`) when the cache was built with other prompts too."""
    path = cache_path or checked_cache_path(cfg)   # before the SFT warm start, the tokenizer and the data
    D.init_distributed()
    model_path = model_path or model_path_for(cfg)
    tokenizer = tokenizer or tokenizer_for(cfg, model_path)
    prompt_set = prompt_set or load_prompt_set(cfg, tokenizer)
    if os.path.exists(path) and not overwrite:
        try:
            cache = ReferenceCache.load(path)
            cache.check_compatible(**reference_identity(cfg, model_path, tokenizer, model), path=path)
            values = cache.lookup(prompt_set.prompt_ids, path=path, tokenizer=tokenizer,
                                  why=lambda: cache.missing_prompts_why(dataset_rows_digest(prompt_set)))
        except ValueError as exc:   # another model, tokenizer, template, temperature, precision or prompts: one line
            raise UserError(str(exc)) from exc
        log.info("reference cache: %s (%d distinct prompts; the training set's %d read from it)", path,
                 len(cache.entries), len(prompt_set.prompt_ids))
        changed = reweight_for_training_set(cache.entries, prompt_set.prompt_ids)   # built with other prompts too
        if changed:
            log.info("reference cache: w(q) of %d training prompts recomputed over the training set (the stored "
                     "ones are relative to all %d prompts the cache was built with)", changed, len(cache.entries))
            values = cache.lookup(prompt_set.prompt_ids, path=path)
        return cache, path, values
    log.info("reference cache: computing ell_theta0(q) for the training set's %d prompts (%d distinct) with %s",
             len(prompt_set.prompt_ids), len(set(map(tuple, prompt_set.prompt_ids))), model_path)
    # stopped at once (Ctrl-C, SIGTERM) before the save, it leaves no cache file: the command's one line says so
    with stopped_at_once_is(f"the reference cache's ell_theta0(q); nothing was written to {path} (the same command "
                            "computes it again)"):
        theta0 = model if model is not None else load_model(cfg, model_path, device_for_rank(), trainable=False)
        identity = reference_identity(cfg, model_path, tokenizer, theta0)   # after the load: a hub revision cached
        cache = build_reference_cache(theta0, tokenizer, prompt_set.prompt_ids, model_id=model_path,
                                      template=identity["template"], batch_size=cfg.reference.batch_size,
                                      temperature=cfg.rollout.temperature, model_fp=identity["model_fp"],
                                      tokenizer_fp=identity["tokenizer_fp"], precision=identity["precision"],
                                      progress=cfg.logging.progress_bar)
    cache.dataset = dataset_rows_digest(prompt_set)
    if D.is_main():
        cache.save(path)
    D.barrier()
    log.info("reference cache: wrote %s", path)
    return cache, path, cache.lookup(prompt_set.prompt_ids, path=path)
