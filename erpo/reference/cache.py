"""The cached reference: ell_theta0(q) and w(q) for every training prompt (paper appendix "Query Likelihood and
the Cached Reference", appendix C), with the identity of the model, tokenizer and prompt template it was built with.

ell_theta0(q) = sum of log p_theta0(x_t | x_<t) over the prompt tokens as fed to the model (chat template
included), the first token excluded. Entries are keyed by a hash of the prompt's token ids.

The cache also records its precision (`erpo.sequences.scoring_precision`: dtype, autocast, scoring path, device,
logit transform): ell_theta0(q) must be computed exactly as the loss computes ell_theta(q), or the Query-KL is not 0
at theta0 and its gradient moves the model for nothing. A run that scores otherwise refuses the cache. Caches of
format 1 record no precision and are refused with a rebuild message (their precision cannot be known).
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from erpo import distributed as D
from erpo.atomic import publish
from erpo.models.fingerprint import model_fingerprint, tokenizer_fingerprint
from erpo.progress import progress as progress_display
from erpo.sequences import PackedBatch, model_precision, pack, per_sample_sum, scored_token_logp
from erpo_kernels import query_weights
from erpo_kernels.layout import host_to_device

FORMAT_VERSION = 2   # 2: the precision is recorded
REBUILD = "Rebuild it with `erpo precompute-ref --overwrite` (same config), or point reference.cache_path elsewhere."
CACHE_FILE = "erpo_reference_cache.json"   # ERPOTrainer's and verl's cache in their output folder, unless set
DATASET_CHANGED = "(the dataset changed since it was built). Rebuild it with `erpo precompute-ref --overwrite`."
# where the cache records the digest of the dataset rows it was built from (`ReferenceCache.dataset`) and they match
PROMPTS_CHANGED = ("(the dataset's rows are the ones it was built from, but these prompts' text and token ids are "
                   "not: the column read as the problem, data.problem_field, or how erpo builds a prompt from a row, "
                   "e.g. its instruction stripping, has changed since). Rebuild it with `erpo precompute-ref "
                   "--overwrite`.")
# a cache built before it recorded that digest
DATASET_OR_PROMPTS_CHANGED = ("(the dataset, or how erpo builds a prompt from a row, changed since it was built). "
                              "Rebuild it with `erpo precompute-ref --overwrite`.")
log = logging.getLogger("erpo")


def prompt_hash(ids: list[int]) -> str:
    """sha256 (hex, 32 chars) of a prompt's token ids."""
    return hashlib.sha256(json.dumps(list(map(int, ids))).encode()).hexdigest()[:32]


def template_id(template: str, use_chat_template: bool) -> str:
    return f"{template}|chat={use_chat_template}"


TEMPERATURE_TAG = "|temperature="


def with_temperature(template: str, temperature: float) -> str:
    """The template a cache records: the prompt template's id and the temperature ell_theta0 was computed at."""
    return f"{template}{TEMPERATURE_TAG}{temperature}"


def recorded_temperature(template: str) -> float | None:
    """The temperature a cache's template records (`with_temperature`), None when it records none."""
    _, tag, value = template.rpartition(TEMPERATURE_TAG)
    try:
        return float(value) if tag else None
    except ValueError:
        return None


@dataclass
class ReferenceCache:
    """ell_theta0 and w per prompt hash, plus what the cache was built with."""
    model_id: str
    model_fingerprint: str
    tokenizer_id: str
    tokenizer_fingerprint: str
    template: str
    precision: str
    entries: dict[str, tuple[float, float]] = field(default_factory=dict)   # hash -> (ell_theta0, w)
    # the digest of the dataset rows the prompts were built from (`erpo.tasks.data.dataset_rows_digest`), where
    # `erpo precompute-ref` built it: what tells a changed dataset from a changed prompt format (`missing_prompts_why`)
    dataset: str | None = None

    def holds(self, ids: list[int]) -> bool:
        """Whether the cache has ell_theta0 of the prompt of token ids `ids` (keyed by `prompt_hash`)."""
        return prompt_hash(ids) in self.entries

    def missing_prompts_why(self, dataset: str) -> str:
        """Why prompts of a run on the rows of digest `dataset` are not in this cache, and what to do."""
        if self.dataset is None:
            return DATASET_OR_PROMPTS_CHANGED
        return PROMPTS_CHANGED if self.dataset == dataset else DATASET_CHANGED

    @property
    def cache_id(self) -> str:
        """Short hash of the cache's identity and contents (stored in checkpoints)."""
        text = json.dumps([self.model_fingerprint, self.tokenizer_fingerprint, self.template, sorted(self.entries)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def save(self, path: str) -> str:
        """Write as JSON with `erpo.atomic.publish`: a reader never sees half a file, and runs saving to one path
        at once (each under its own temporary name) leave one whole cache, the last one saved."""
        payload = {"format_version": FORMAT_VERSION, "model_id": self.model_id,
                   "model_fingerprint": self.model_fingerprint, "tokenizer_id": self.tokenizer_id,
                   "tokenizer_fingerprint": self.tokenizer_fingerprint, "template": self.template,
                   "precision": self.precision, "entries": {k: list(v) for k, v in self.entries.items()},
                   **({"dataset": self.dataset} if self.dataset else {})}
        publish(path, lambda tmp: tmp.write_text(json.dumps(payload)))
        return str(path)

    @classmethod
    def load(cls, path: str) -> ReferenceCache:
        """The cache saved at `path`; a ValueError naming the file when it is not one (not a JSON object: another
        file given as the cache path) or of another format version."""
        try:
            data = json.loads(Path(path).read_text())
        except ValueError as exc:   # not JSON, or not text: one line naming the file, not the parser's position alone
            raise ValueError(f"{path} is not a reference cache ({exc}); delete or move it, or point the run at "
                             "another cache path") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a reference cache (a JSON {type(data).__name__}, not an object); delete "
                             "or move it, or point the run at another cache path")
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"reference cache {path}: format version {data.get('format_version')}, expected "
                             f"{FORMAT_VERSION} (format 1 records no precision, so whether its ell_theta0(q) match "
                             "this run's scoring is unknown); delete it to rebuild it, or rebuild it with "
                             "`erpo precompute-ref --overwrite`")
        return cls(data["model_id"], data["model_fingerprint"], data["tokenizer_id"], data["tokenizer_fingerprint"],
                   data["template"], data["precision"],
                   {k: (float(v[0]), float(v[1])) for k, v in data["entries"].items()}, data.get("dataset"))

    def check_compatible(self, *, model_id: str, model_fp: str | tuple[str, ...], tokenizer_id: str,
                         tokenizer_fp: str, template: str | None, temperature: float | None = None,
                         precision: str | None = None, path: str = "the reference cache",
                         remedy: str = REBUILD) -> None:
        """ValueError naming what differs when the cache was built with another model, tokenizer or template.
        `model_fp`: the fingerprint, or every fingerprint that identifies the run's model. `template` None: the
        template is not compared (the caller checks the prompts' token ids), only the recorded `temperature`.
        `precision`: the run's `scoring_precision` (None: not compared). `remedy`: the error's last sentence, what
        to do."""
        accepted = (model_fp,) if isinstance(model_fp, str) else model_fp
        problems = []
        if self.model_fingerprint not in accepted:
            problems.append(f"model: cache built with {self.model_id} ({self.model_fingerprint}), training uses "
                            f"{model_id} ({' or '.join(accepted)})")
        if self.tokenizer_fingerprint != tokenizer_fp:
            problems.append(f"tokenizer: cache built with {self.tokenizer_id} ({self.tokenizer_fingerprint}), "
                            f"training uses {tokenizer_id} ({tokenizer_fp})")
        if template is not None and self.template != template:
            problems.append(f"prompt template: cache built with {self.template!r}, training uses {template!r}")
        if temperature is not None and recorded_temperature(self.template) != float(temperature):
            problems.append(f"temperature: cache built with template {self.template!r}, training uses "
                            f"temperature={temperature}")
        if precision is not None and self.precision != precision:
            problems.append(f"precision: cache built with {self.precision}, training scores with {precision}")
        if problems:
            raise ValueError(f"{path} does not match this run: " + "; ".join(problems) + ". " + remedy)

    def lookup(self, prompt_ids: list[list[int]], path: str | None = None, *, tokenizer=None,
               why: str | Callable[[], str] = DATASET_CHANGED, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`lookup_entries` on this cache's entries."""
        return lookup_entries(self.entries, prompt_ids, path, tokenizer=tokenizer, why=why, device=device)


def shown_prompt(ids: list[int], tokenizer=None) -> str:
    """A prompt as an error message names it: its text decoded by `tokenizer` (300 characters at most, quoted), or
    without one its first 40 token ids."""
    ids = list(ids)
    return repr(tokenizer.decode(ids)[:300]) if tokenizer is not None else f"with token ids {ids[:40]}"


def check_scored_tokens(prompt_ids: list[list[int]], tokenizer=None) -> None:
    """ValueError naming the first of `prompt_ids` with fewer than 2 tokens, and how many there are. ell(q) sums the
    log-probs of a prompt's tokens 2..P, so such a prompt has none: its ell_theta0(q) would be 0, its static w(q)
    clip(mean(s) / 0, 0, 2) 0 or 2 by the sign of that zero (0 for a sum of no rows: its policy gradient silently
    dropped), and its s = 0 would lower mean(s), every other prompt's weight with it. `tokenizer` decodes it."""
    short = [ids for ids in prompt_ids if len(ids) < 2]
    if short:
        raise ValueError(f"prompt {shown_prompt(short[0], tokenizer)} has {len(short[0])} token(s) ({len(short)} of "
                         f"{len(prompt_ids)} prompts have fewer than 2): ell_theta0(q) sums the log-probs of a "
                         "prompt's tokens 2..P, so it has none, nor a static w(q); give every prompt at least 2 tokens "
                         "(a chat template adds some), or train without the Query-KL and the static w(q) (qkl_coef=0, "
                         "query_weight none)")


def lookup_entries(entries: dict[str, tuple[float, float]], prompt_ids: list[list[int]], path: str | None = None, *,
                   tokenizer=None, why: str | Callable[[], str] = DATASET_CHANGED, device=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ell_theta0 [Q] fp32, w [Q] fp32) of these prompts from a cache's `entries` (the cache at `path`), on the
    host, or on `device` when given: both in one upload without a wait (`host_to_device`). A prompt not there is a
    ValueError naming the first one (decoded by `tokenizer` when given, else its token ids), how many are missing,
    and `why`: the likely cause and what to do (a callable: called only then, for a cause that costs work to
    find)."""
    keys = [prompt_hash(p) for p in prompt_ids]
    missing = [i for i, k in enumerate(keys) if k not in entries]
    if missing:
        shown = shown_prompt(prompt_ids[missing[0]], tokenizer)
        raise ValueError(f"prompt {shown} has no ell_theta0(q) in the reference cache{f' {path}' if path else ''} "
                         f"({len(missing)} of {len(keys)} prompts missing) {why() if callable(why) else why}")
    values = torch.tensor([entries[k] for k in keys], dtype=torch.float64).reshape(-1, 2).T.float().contiguous()
    if device is not None:
        values = host_to_device(values, device)
    return values[0], values[1]


def training_set_weights(entries: dict[str, tuple[float, float]], prompt_ids: list[list[int]]) -> torch.Tensor:
    """w(q) [Q] fp32 of the training set `prompt_ids` from their ell_theta0(q) in a cache's `entries` (all there):
    appendix C's clip(mean(s) / s_q, 0, 2) with mean(s) over the set's distinct prompts, whatever else the cache
    holds (the stored w are relative to the prompts it was built with)."""
    keys = [prompt_hash(p) for p in prompt_ids]
    ell = torch.tensor([entries[k][0] for k in keys], dtype=torch.float64)
    distinct = torch.tensor([entries[k][0] for k in dict.fromkeys(keys)], dtype=torch.float64)
    return query_weights(ell, mean_surprisal=float(-distinct.mean())).float()


def reweight_for_training_set(entries: dict[str, tuple[float, float]], prompt_ids: list[list[int]]) -> int:
    """Store `training_set_weights` as the w(q) of the training set's prompts in `entries` (in place) where the
    stored ones differ (by more than 1e-6: summation order aside), as they do when the cache was built with other
    prompts too (a larger data set; a previous run's). Returns how many prompts changed."""
    weights = training_set_weights(entries, prompt_ids)
    changed = {key: (entries[key][0], float(w)) for key, w in zip(map(prompt_hash, prompt_ids), weights.tolist())
               if abs(entries[key][1] - w) > 1e-6}
    entries.update(changed)
    return len(changed)


def compute_query_logp(model, prompt_ids: list[list[int]], *, pad_id: int, batch_size: int,
                       temperature: float = 1.0, progress: bool = False,
                       score: Callable[[PackedBatch], torch.Tensor] | None = None) -> torch.Tensor:
    """ell(q) [Q] float64 (nats) of each prompt under `model` (logits / temperature, as the loss sees them),
    batched; `score(batch)` -> log-probs [R] of the batch's scored rows, by default `scored_token_logp` (the
    fused-linear path, no autocast); `progress` shows a progress bar over the batches."""
    score = score or (lambda batch: scored_token_logp(model, batch, temperature))
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        starts = range(0, len(prompt_ids), batch_size)
        with progress_display(len(starts), "reference cache ell_theta0(q)", "batch", enabled=progress) as shown:
            for start in starts:
                chunk = prompt_ids[start:start + batch_size]
                batch = pack(chunk, [[] for _ in chunk], pad_id, device)
                out.append(per_sample_sum(score(batch), batch, kind=1).cpu())
                shown.update(1)
    finally:
        model.train(was_training)
    return torch.cat(out)


def build_reference_cache(model, tokenizer, prompt_ids: list[list[int]], *, model_id: str, template: str,
                          batch_size: int, temperature: float = 1.0, model_fp: str | None = None,
                          tokenizer_fp: str | None = None, progress: bool = False,
                          score: Callable[[PackedBatch], torch.Tensor] | None = None,
                          precision: str | None = None) -> ReferenceCache:
    """ell_theta0 over all (unique) prompts, sharded over ranks and gathered, and w = query_weights(ell_theta0).
    `model_fp` / `tokenizer_fp`: the fingerprints when already computed (else computed here); `progress`: a
    progress bar; `score` and `precision`: how the log-probs are scored and its record (`compute_query_logp`;
    default the fused-linear path without autocast, `model_precision(model)`)."""
    unique = list({prompt_hash(p): p for p in prompt_ids}.items())
    local = D.shard(unique, D.rank(), D.world_size()) if len(unique) >= D.world_size() else unique
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ell_local = compute_query_logp(model, [p for _, p in local], pad_id=pad_id, batch_size=batch_size,
                                   temperature=temperature, progress=progress and D.is_main(),
                                   score=score) \
        if local else torch.zeros(0, dtype=torch.float64)
    pairs = [pair for part in D.all_gather_object([(k, float(v)) for (k, _), v in zip(local, ell_local)])
             for pair in part]
    if len(unique) < D.world_size():
        pairs = pairs[:len(unique)]
    return reference_cache_of(dict(pairs), model_id=model_id, model_fp=model_fp or model_fingerprint(model_id),
                              tokenizer=tokenizer, tokenizer_fp=tokenizer_fp or tokenizer_fingerprint(tokenizer),
                              template=template, precision=precision or model_precision(model))


def reference_cache_of(ell: dict[str, float], *, model_id: str, model_fp: str, tokenizer, tokenizer_fp: str,
                       template: str, precision: str) -> ReferenceCache:
    """The cache of ell_theta0(q) by prompt hash (`ell`, nats, distinct prompts) and w = query_weights(ell_theta0)
    over them (appendix C), with what it was built with."""
    values = torch.tensor(list(ell.values()), dtype=torch.float64)
    weights = query_weights(values)
    return ReferenceCache(model_id=model_id, model_fingerprint=model_fp,
                          tokenizer_id=str(getattr(tokenizer, "name_or_path", "")), tokenizer_fingerprint=tokenizer_fp,
                          template=template, precision=precision,
                          entries={k: (float(e), float(w)) for k, e, w in zip(ell, values, weights)})
