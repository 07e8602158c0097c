"""ell_theta0(q) for ERPOTrainer: the reference cache of every train and eval prompt, loaded (and checked against
theta0, the tokenizer and the temperature) or built at start with the model as passed, and looked up per
micro-batch. Until the first optimizer step (`at_theta0`) the micro-batch's ell_theta0(q) is its own forward's
ell_theta(q), detached, so the Query-KL and its gradient are exactly 0 at theta0 whatever the attention kernel and
precision; prompts the cache lacks are added then. The prompts of a `rollout_func` or `environment_factory`, known
only once generated, are scored after each generation with theta0 kept for them (`_keep_theta0`). A mixin of
ERPOTrainer (it reads the trainer's model, tokenizer, datasets and accelerator)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import types
from collections.abc import Callable

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.utils import logging

from erpo.atomic import publish
from erpo.integrations.template_date import DatedTemplate, DateSettings, date_dependence
from erpo.models.fingerprint import model_fingerprint, tokenizer_fingerprint
from erpo.models.lora import reference_model
from erpo.reference.cache import (
    ReferenceCache,
    build_reference_cache,
    check_scored_tokens,
    prompt_hash,
    reweight_for_training_set,
    with_temperature,
)
from erpo.sequences import PackedBatch, model_precision, scored_token_logp
from erpo_kernels import query_weights, token_logprobs
from erpo_kernels.zero3 import is_zero3_partitioned

REBUILD = "Delete it to rebuild it, or set ERPOConfig(ref_cache=...) to another path."
logger = logging.get_logger(__name__)
PROMPT_CHUNK = 256  # prompts tokenized at a time when the cache is built
EMPTY_PROMPT = [{"role": "user", "content": ""}]  # TRL's prompt of a row without one, when an environment owns the data
PROMPT_TOKEN_IDS = "erpo_prompt_token_ids"  # the inputs' key of each sample's prompt token ids, a host list [B]
PADDING_PROBE = (16, 4)  # `check_left_padding`: a prompt's first 16 tokens, 4 pad tokens before them
# in each checkpoint, the weights fingerprint of theta0, the model the run's trainer was given: a resume is checked
# against it (`_check_theta0_record`)
THETA0_RECORD = "erpo_theta0.json"
# a chat template that writes today's date (`template_date`): the fix, in TRL's setting names; the trainer builds a
# deleted cache from the model as passed, at a resume too
DATE_SETTINGS = DateSettings(kwargs="ERPOConfig(chat_template_kwargs={{..., 'date_string': {date_string}}})",
                             template="the tokenizer (processing_class)", resume_rebuilds=True)


def device_prompt_ids(inputs: dict) -> list:
    """Each sample's prompt token ids [B] as host lists, read from the padded prompt_ids / prompt_mask [B, P] (one
    host read per sample)."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(inputs["prompt_ids"], inputs["prompt_mask"])]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the model's state dict (names and raw bytes): the identity of theta0 as passed."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + b"\0")
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return "weights-sha256:" + digest.hexdigest()[:32]


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` in eval mode without gradients that computes as `model` does, on its own weights: a
    function patched onto a module (TRL's fused LM head on the model's `forward`, `cast_lm_head_to_fp32` on the
    lm_head's) closes over the original's modules, which `copy.deepcopy` keeps; it is rebuilt over the copy's."""
    memo = {}
    frozen = copy.deepcopy(model, memo)
    for module in frozen.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, (types.FunctionType, types.MethodType)):
                vars(module)[name] = with_copied_closure(value, memo)
    return frozen.eval().requires_grad_(False)


def with_copied_closure(value, memo: dict):
    """`value` deep-copied with `memo` (the copy's map from the originals), a function's or bound method's closure
    included (deepcopy keeps functions as they are, and so their references to the original model)."""
    if isinstance(value, types.MethodType):
        return types.MethodType(with_copied_closure(value.__func__, memo), copy.deepcopy(value.__self__, memo))
    if not isinstance(value, types.FunctionType) or not value.__closure__:
        return copy.deepcopy(value, memo)
    if id(value) in memo:
        return memo[id(value)]
    cells = tuple(types.CellType() for _ in value.__closure__)
    function = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
    function.__kwdefaults__, function.__dict__ = value.__kwdefaults__, dict(value.__dict__)
    memo[id(value)] = function
    for cell, original in zip(cells, value.__closure__):
        with contextlib.suppress(ValueError):   # an empty cell stays empty
            cell.cell_contents = with_copied_closure(original.cell_contents, memo)
    return function


def check_left_padding(model: torch.nn.Module, prompt_ids: list[int], pad_id: int) -> None:
    """ValueError unless the embedding output (hidden_states[0]) of a prompt's first tokens is the same left-padded
    as unpadded (relative 1e-3). TRL's forward gives a left-padded prompt no position_ids, so its positions count from
    the padding: a model that adds absolute position embeddings there (GPT-2, GPT-Neo, StarCoder 1, XGLM, BioGPT)
    then scores a prompt by how much the batch pads it, and ell_theta(q) does not match the cached ell_theta0(q) (an
    unchanged GPT-2 got a Query-KL of 0.016 from one pad token). Rotary and ALiBi models (Qwen, Llama, Gemma, BLOOM)
    and OPT (positions from the mask) put nothing position-dependent there: equal bit for bit."""
    tokens, pads = PADDING_PROBE
    ids = list(prompt_ids[:tokens])
    n, device = len(ids), next(model.parameters()).device
    input_ids = torch.tensor([ids + [pad_id] * pads, [pad_id] * pads + ids], device=device)
    mask = torch.tensor([[1] * n + [0] * pads, [0] * pads + [1] * n], device=device)
    was_training = model.training
    model.eval()   # GPT-2's hidden_states[0] comes after its embedding dropout
    try:
        with torch.no_grad():
            embedded = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True,
                             use_cache=False).hidden_states[0].float()
    finally:
        model.train(was_training)
    plain, shifted = embedded[0, :n], embedded[1, pads:]
    if not torch.allclose(shifted, plain, rtol=1e-3, atol=1e-3 * plain.abs().max().item()):
        raise ValueError(f"{type(model).__name__} adds absolute position embeddings, which TRL's forward counts from "
                         "a left-padded prompt's padding, so ell_theta(q) would depend on the batch and not match the "
                         "cached ell_theta0(q); use a model with rotary or ALiBi positions, or set qkl_coef=0 and "
                         "query_weight='none' or 'current'")


class ReferenceMixin:
    """ERPOTrainer's cached reference: `_load_or_build_reference()` at start, `_reference_of(inputs)` per step."""

    # The state it shares with ERPOTrainer, which sets it at construction (trainer.py)
    reference_cache: ReferenceCache | None   # None when the loss reads no ell_theta0(q) (`needs_reference`)
    reference_cache_path: str
    at_theta0: bool                 # no optimizer step yet: ell_theta0(q) is the forward's own
    _theta0_entries: dict[str, tuple[float, float]]   # added at theta0, not yet shared with the other processes
    _theta0: Callable[[], contextlib.AbstractContextManager] | None   # theta0 for a rollout's prompts
    _adapter_added: bool            # a LoRA adapter added by the trainer (peft_config): theta0 = adapters off
    _train_surprisal: float  # the training prompts' mean -ell_theta0(q) (nats), set by the cache's load
    _generated_prompt_ids: list[list[int]]  # the last `_generate`'s prompt token ids, one list per sample
    _theta0_weights: str     # `weights_fingerprint` of the model as passed (theta0), set by the cache's load
    _dated_template: DatedTemplate | None   # the chat template writes today's date (set by the cache's load)

    def _prompt_ids(self, dataset) -> list[list[int]]:
        """Token ids of every prompt of `dataset`, tokenized by TRL's `_tokenize_prompts`; of an IterableDataset,
        of its first `args.iterable_prompts` rows (read once, here). With an `environment_factory`, as TRL renders
        them before `reset()`: a row without a prompt is TRL's empty user turn, and each row has its environment's
        tools (a row naming no environment of the factory is left out: TRL refuses it when it is drawn)."""
        if hasattr(dataset, "__len__"):
            columns = {name: dataset[name] for name in ("prompt", "environment") if name in dataset.column_names}
            rows = [dict(zip(columns, values)) for values in zip(*columns.values())] if columns else \
                [{} for _ in range(len(dataset))]
        else:
            rows = list(itertools.islice(dataset, self.args.iterable_prompts))
        environments = self.environment_factories
        if environments is not None:
            rows = [row for row in rows if not self._multi_environment or row.get("environment") in environments]
        prompt_ids = []
        for start in range(0, len(rows), PROMPT_CHUNK):
            chunk = rows[start:start + PROMPT_CHUNK]
            if environments is not None:   # what `_tokenize_prompts` reads for each prompt's tools
                self._batch_environments = [row.get("environment") if self._multi_environment else None
                                            for row in chunk]
            ids = self._tokenize_prompts([row.get("prompt", EMPTY_PROMPT) if environments is not None
                                          else row["prompt"] for row in chunk])[0]
            prompt_ids.extend(list(map(int, p)) for p in ids)
        return prompt_ids

    def _eval_prompt_ids(self) -> list[list[int]]:
        """Token ids of every prompt of eval_dataset (a Dataset, or TRL's dict of named Datasets; none if absent)."""
        datasets = self.eval_dataset if isinstance(self.eval_dataset, dict) else {None: self.eval_dataset}
        return [ids for dataset in datasets.values() if dataset is not None for ids in self._prompt_ids(dataset)]

    @functools.cached_property
    def _theta0_fingerprints(self) -> tuple[str, ...]:
        """Every fingerprint naming theta0 as passed: the hash of its state dict, and, when it was loaded from a
        local directory or a hub name, erpo's `model_fingerprint` of that (what `erpo precompute-ref` records; a
        LoRA adapter the trainer adds, randomly initialized A, B = 0, changes the first, not this)."""
        name = str(self.model.config._name_or_path or "")
        return (self._theta0_weights,) + ((model_fingerprint(name),) if name else ())

    def _autocast_dtype(self) -> torch.dtype | None:
        """The dtype `accelerator.autocast()` computes in on this device (bf16 / fp16 mixed precision), None: off."""
        device = self.accelerator.device.type
        with self.accelerator.autocast():
            return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

    def _reference_precision(self) -> str:
        """The precision of the training forward (`erpo.sequences.scoring_precision`), which the cache must have."""
        return model_precision(self.model, path="fused-linear" if self.args.fused_linear else "logits",
                               autocast=self._autocast_dtype())

    @torch.no_grad()
    def _score_reference(self, batch: PackedBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-probs [R] of a batch's scored rows under `model` (default the trainer's; or `_keep_theta0`'s theta0)
        computed as `_compute_loss` computes them: the forward under `accelerator.autocast()`, then hidden @ lm_head
        with the model's logit transform (fused_linear) or the model's own logits (already transformed), at the
        sampling temperature, outside autocast. One masked column is appended: sdpa runs another kernel for an
        all-ones mask (is_causal) than for a mask with padding, and the two differ in the last bits, while TRL's
        training batches nearly always mask some padding."""
        num = batch.input_ids.shape[0]

        def padded(values):  # [B, L] or [B * L] -> [B, L + 1], a zero column appended
            values = values.reshape(num, -1)
            return torch.cat([values, torch.zeros_like(values[:, :1])], dim=1)

        batch = dataclasses.replace(batch, input_ids=padded(batch.input_ids),
                                    attention_mask=padded(batch.attention_mask), rows=padded(batch.rows).reshape(-1),
                                    row_index=None)  # rows' positions moved: the boolean selection (a cache build)
        model = self.model if model is None else model
        if self.args.fused_linear:
            return scored_token_logp(model, batch, self.temperature, autocast=self.accelerator.autocast)
        with self.accelerator.autocast():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        return token_logprobs(logits.reshape(-1, logits.shape[-1])[batch.rows], batch.targets,
                              temperature=self.temperature)

    def _load_or_build_reference(self) -> ReferenceCache:
        """Load the cache at `reference_cache_path` (checked against this model, tokenizer and temperature, and
        against every training prompt's token ids), or compute ell_theta0(q) of the training prompts with the
        model as passed; then add the eval prompts it lacks, and save it there when it changed. A cache that lacks
        the training prompts because the chat template writes the date and it was built on another day says so."""
        path = self.reference_cache_path
        if any(is_zero3_partitioned(param) for param in self.model.parameters()):   # read outside DeepSpeed's engine
            raise ValueError("ERPOTrainer reads theta0 when it is built, before DeepSpeed wraps the model, and this "
                             "model was created partitioned by DeepSpeed ZeRO-3 (a model name, which TRL loads under "
                             "zero.Init): pass the model loaded whole, created before ERPOConfig(deepspeed=...), or "
                             "set qkl_coef=0 and query_weight='none' or 'current'")
        self._theta0_weights = weights_fingerprint(self.model)
        train_ids, eval_ids = self._prompt_ids(self.train_dataset), self._eval_prompt_ids()
        check_scored_tokens(train_ids, self._tokenizer)   # the eval prompts the cache lacks: `_held_out_entries`
        self._dated_template = self._template_date(train_ids)
        if self._dated_template is not None:
            logger.warning("ERPOTrainer: %s", self._dated_template.start_warning("TRL", DATE_SETTINGS))
        if train_ids:
            pad_id = self._tokenizer.pad_token_id
            check_left_padding(self.model, train_ids[0], self._tokenizer.eos_token_id if pad_id is None else pad_id)
        identity = dict(model_id=str(self.model.config._name_or_path), tokenizer_id=str(self._tokenizer.name_or_path),
                        tokenizer_fp=tokenizer_fingerprint(self._tokenizer))
        if os.path.exists(path):
            cache = ReferenceCache.load(path)
            cache.check_compatible(**identity, model_fp=self._theta0_fingerprints, template=None,
                                   temperature=self.temperature, precision=self._reference_precision(), path=path,
                                   remedy=REBUILD)
            date_cause = self._dated_template and self._dated_template.load_miss(
                cache.holds, DATE_SETTINGS)   # built on another day: the date's fix is the remedy
            self._check_cached(cache, train_ids, date_cause or "(the dataset, tokenization or chat template changed "
                                                               f"since it was built). {REBUILD}")
            changed = reweight_for_training_set(cache.entries, train_ids) > 0   # built with other prompts too
        elif not train_ids:   # every row names an environment the factory lacks: TRL refuses the first one drawn
            cache = ReferenceCache(model_id=identity["model_id"], model_fingerprint=self._theta0_weights,
                                   tokenizer_id=identity["tokenizer_id"],
                                   tokenizer_fingerprint=identity["tokenizer_fp"],
                                   template=with_temperature("trl", self.temperature),
                                   precision=self._reference_precision())
            changed = False
        else:
            cache = build_reference_cache(
                self.model, self._tokenizer, train_ids, model_id=identity["model_id"],
                template=with_temperature("trl", self.temperature), batch_size=self.args.per_device_train_batch_size,
                temperature=self.temperature, model_fp=self._theta0_weights,
                tokenizer_fp=identity["tokenizer_fp"], progress=True, score=self._score_reference,
                precision=self._reference_precision())
            changed = True
        self._train_surprisal = -float(torch.tensor(
            [cache.entries[key][0] for key in {prompt_hash(ids) for ids in train_ids}], dtype=torch.float64).mean())
        changed |= self._add_held_out(cache, eval_ids)
        if changed and self.accelerator.is_main_process:
            cache.save(path)
        self.accelerator.wait_for_everyone()
        return cache

    def _template_date(self, train_ids: list[list[int]]) -> DatedTemplate | None:
        """Whether the chat template writes today's date (`date_dependence`), by the first training prompt (token
        ids `train_ids[0]`) rendered again as `_prompt_ids` renders it (TRL's `_tokenize_prompts` with its
        chat_template_kwargs), as on another date. A first row `_prompt_ids` leaves out (it names an environment the
        factory lacks: TRL refuses it when drawn) is not checked; nor the prompts of a `rollout_func` or
        `environment_factory`: those the cache lacks are scored at theta0 when generated (`_keep_theta0`)."""
        if not train_ids or self.rollout_func is not None or self.environment_factories is not None:
            return None
        dataset, kwargs = self.train_dataset, self.chat_template_kwargs
        head = dataset.select(range(1)) if hasattr(dataset, "__len__") else dataset.take(1)

        def render(extra: dict) -> list[int]:
            self.chat_template_kwargs = {**kwargs, **extra}
            try:
                return next(iter(self._prompt_ids(head)), train_ids[0])
            finally:
                self.chat_template_kwargs = kwargs

        return date_dependence(render, train_ids[0])

    def _date_cause(self) -> str:
        """What a cache miss's message ends with when the chat template writes today's date (else nothing)."""
        return "" if self._dated_template is None else " " + self._dated_template.miss_cause(DATE_SETTINGS)

    def _save_theta0_record(self, checkpoint: str) -> None:
        """Write THETA0_RECORD into `checkpoint` (a folder just saved; the main process only): theta0's fingerprints
        and the cache's path. Nothing when the loss reads no ell_theta0(q) (no cache)."""
        if self.reference_cache is None or not self.args.should_save:
            return
        record = json.dumps({"theta0": list(self._theta0_fingerprints), "reference_cache": self.reference_cache_path})
        publish(os.path.join(checkpoint, THETA0_RECORD), lambda tmp: tmp.write_text(record))

    def _check_theta0_record(self, checkpoint: str) -> None:
        """ValueError, one line, when the run saved at `checkpoint` started from other weights than the model this
        trainer was given (no fingerprint in common): its cache, checked against or built from that model, would hold
        another model's ell_theta0(q) (a checkpoint's own weights passed as the model, its cache then built from
        them). A checkpoint without the record (an older ERPOTrainer's) is resumed with a warning."""
        if self.reference_cache is None:
            return
        path = os.path.join(checkpoint, THETA0_RECORD)
        if not os.path.exists(path):
            logger.warning("ERPOTrainer: %s records no theta0 (saved by an older erpo): resuming without checking "
                           "that the model passed is the one the run started from", checkpoint)
            return
        with open(path) as record:
            recorded = json.load(record)["theta0"]
        if not set(recorded) & set(self._theta0_fingerprints):
            raise ValueError(
                f"resume_from_checkpoint={checkpoint}: the run started from other weights ({' or '.join(recorded)}) "
                f"than the model passed to this ERPOTrainer ({' or '.join(self._theta0_fingerprints)}), against which "
                "its reference cache "
                f"{self.reference_cache_path} was checked or built, so ell_theta0(q) would be another model's; pass "
                "the model the run started from (not a checkpoint's weights), or start afresh in another output_dir")

    def _held_out_weights(self, ell: torch.Tensor) -> torch.Tensor:
        """Static w(q) [Q] of prompts outside the training set from their ell_theta0(q) [Q] (float64): appendix C's
        weight scaled by the training prompts' mean surprisal, so the training prompts' weights stay as they are."""
        return query_weights(ell, mean_surprisal=self._train_surprisal)

    def _add_held_out(self, cache: ReferenceCache, prompt_ids: list[list[int]]) -> bool:
        """Add ell_theta0(q) of the prompts the cache lacks (eval prompts), scored at start, with their held-out
        w(q); whether any."""
        missing = [ids for ids in prompt_ids if not cache.holds(ids)]
        if missing:
            cache.entries.update(self._held_out_entries(cache, missing, self.model, progress=True))
        return bool(missing)

    def _held_out_entries(self, cache: ReferenceCache, prompt_ids: list[list[int]], model, progress: bool = False
                          ) -> dict:
        """{prompt hash: (ell_theta0, held-out w)} of `prompt_ids` scored with `model` at theta0 by
        `_score_reference` (a collective: every process passes the same prompts, scored in shards and gathered). A
        prompt of fewer than 2 tokens is refused (`check_scored_tokens`)."""
        check_scored_tokens(prompt_ids, self._tokenizer)
        held_out = build_reference_cache(
            model, self._tokenizer, prompt_ids, model_id=cache.model_id, template=cache.template,
            batch_size=self.args.per_device_eval_batch_size, temperature=self.temperature,
            model_fp=cache.model_fingerprint, tokenizer_fp=cache.tokenizer_fingerprint, progress=progress,
            score=functools.partial(self._score_reference, model=model), precision=cache.precision)
        ell = torch.tensor([value[0] for value in held_out.entries.values()], dtype=torch.float64)
        return {key: (float(e), float(w)) for key, e, w in zip(held_out.entries, ell, self._held_out_weights(ell))}

    def _keep_theta0(self):
        """theta0 for the prompts of a `rollout_func` or `environment_factory` (known only once generated), as a
        context manager factory yielding the model to score them with, or None when not needed (no such rollout,
        or a loss that reads no ell_theta0). A LoRA adapter the trainer added (`peft_config`) starts at theta0:
        the same model with adapters disabled, no copy (TRL's reference under PEFT). Otherwise a frozen copy of
        the model as passed (eval mode, no gradient): one more model in memory, as TRL's ref_model for beta != 0."""
        if not (self.args.needs_reference and
                (self.rollout_func is not None or self.environment_factories is not None)):
            return None
        if self._adapter_added:
            logger.info("ERPOTrainer: the prompts of the rollout are scored at theta0 with the adapters disabled")
            return lambda: reference_model(self.model)
        if is_deepspeed_zero3_enabled() or self.is_fsdp_enabled:
            raise ValueError("ERPOTrainer keeps a frozen copy of theta0 for the prompts of a rollout_func or "
                             "environment_factory, which it cannot copy under DeepSpeed ZeRO-3 or FSDP; train a "
                             "LoRA adapter (peft_config), or set qkl_coef=0 and query_weight='none' or 'current'")
        frozen = frozen_copy(self.model)
        logger.info("ERPOTrainer: a frozen copy of theta0 (%.1fM parameters) scores the prompts of the rollout "
                    "the reference cache lacks", sum(p.numel() for p in frozen.parameters()) / 1e6)
        return lambda: contextlib.nullcontext(frozen)

    def _generate(self, prompts: list):
        """GRPOTrainer's; the prompts' token ids it returns (host lists, one per sample, as they are padded into
        `prompt_ids`) are kept for `_generate_and_score_completions`."""
        generated = super()._generate(prompts)
        self._generated_prompt_ids = [list(map(int, ids)) for ids in generated[0]]
        return generated

    def _generate_and_score_completions(self, inputs):
        """GRPOTrainer's, with each sample's prompt token ids as host lists under PROMPT_TOKEN_IDS (TRL shuffles and
        splits a list with the tensors), from which `_reference_of` looks the micro-batch up without reading the
        device; then, with a `rollout_func` or `environment_factory`, the generated prompts no process's cache has
        are scored at theta0 (`_keep_theta0`) and added to every process's cache, saved by the main one (a
        collective, as generation is). Without a cache, under query_weight='current', a prompt of fewer than 2 tokens
        is refused (`check_scored_tokens`): its ell_theta(q) is a sum over no rows, its w(q) 0, and it lowers the
        other prompts' weights."""
        output = super()._generate_and_score_completions(inputs)
        if self.reference_cache is None:
            if self.args.query_weight == "current":   # w(q) from ell_theta(q), which such a prompt lacks
                check_scored_tokens(self._generated_prompt_ids, self._tokenizer)
            return output
        prompt_ids = output[PROMPT_TOKEN_IDS] = self._generated_prompt_ids
        if self._theta0 is None:
            return output
        cache = self.reference_cache
        missing = [ids for ids in prompt_ids if not cache.holds(ids)]
        union = list({prompt_hash(ids): ids for part in gather_object([missing]) for ids in part}.values())
        if union:
            with self._theta0() as model:
                cache.entries.update(self._held_out_entries(cache, union, model))
            if self.accelerator.is_main_process:
                cache.save(self.reference_cache_path)
        return output

    def _check_cached(self, cache: ReferenceCache, prompt_ids: list[list[int]], why: str) -> None:
        """ValueError naming the first prompt whose ell_theta0 the cache lacks, then `why` and what to do."""
        cache.lookup(prompt_ids, self.reference_cache_path, tokenizer=self._tokenizer, why=why)

    def _reference_of(self, inputs: dict, source: str, forward_query_logp) -> tuple[torch.Tensor, torch.Tensor]:
        """(ell_theta0 [B], static w [B]) of the micro-batch's prompts, by their token ids (the host lists under
        PROMPT_TOKEN_IDS: no read of the device prompt_ids), uploaded from pinned memory without a wait, from
        `source` (the data set, for errors). At theta0 ell_theta0 is `forward_query_logp()` [B] (float64: this
        forward's ell_theta(q), detached), and the prompts the cache lacks are added with it."""
        prompt_ids = inputs.get(PROMPT_TOKEN_IDS)  # host lists: the lookup reads nothing from the device
        if prompt_ids is None:  # a subclass's own _generate_and_score_completions: read the device rows instead
            prompt_ids = device_prompt_ids(inputs)
        device = inputs["prompt_ids"].device
        if self.at_theta0:
            ell = forward_query_logp()
            self._add_at_theta0(prompt_ids, ell)
            return ell.float(), self.reference_cache.lookup(prompt_ids, device=device)[1]   # no wait
        self._check_cached(self.reference_cache, prompt_ids, (
            f"and theta0 is gone (an optimizer step was taken): it comes from the {source}, which ERPOTrainer did not "
            "read at construction (an IterableDataset is read up to ERPOConfig.iterable_prompts rows); pass it as "
            "train_dataset / eval_dataset, raise iterable_prompts, or evaluate it before training."
            + self._date_cause()))
        return self.reference_cache.lookup(prompt_ids, path=self.reference_cache_path, device=device)  # one upload

    def _add_at_theta0(self, prompt_ids: list[list[int]], ell: torch.Tensor) -> None:
        """Add the prompts the cache lacks with their ell_theta0 [B] (float64, on the device) taken from the forward at
        theta0, and keep them to be shared with the other processes and saved (`_share_theta0_entries`). `ell` is
        read on the host only when a prompt is missing; one of fewer than 2 tokens is refused
        (`check_scored_tokens`)."""
        new = {prompt_hash(ids): i for i, ids in enumerate(prompt_ids) if not self.reference_cache.holds(ids)}
        if not new:
            return
        check_scored_tokens([prompt_ids[i] for i in new.values()], self._tokenizer)
        ell = ell.cpu()
        weights = self._held_out_weights(ell[list(new.values())])
        added = {key: (float(ell[i]), float(w)) for (key, i), w in zip(new.items(), weights)}
        self.reference_cache.entries.update(added)
        self._theta0_entries.update(added)

    def _share_theta0_entries(self) -> None:
        """Every process's entries added at theta0 into every process's cache, saved by the main process (a
        collective: all processes call it, at the first optimizer step and after an evaluation at theta0). Nothing
        to share when the loss reads no ell_theta0(q) (no cache)."""
        if self.reference_cache is None:
            return
        gathered = gather_object([self._theta0_entries])
        self._theta0_entries = {}
        added = {key: value for entries in gathered for key, value in entries.items()}
        self.reference_cache.entries.update(added)
        if added and self.accelerator.is_main_process:
            self.reference_cache.save(self.reference_cache_path)
        self.accelerator.wait_for_everyone()

    def _leave_theta0(self) -> None:
        """theta moved (the first optimizer step, or a resume from a checkpoint after one): ell_theta0(q) comes
        from the cache only from now on."""
        if self.at_theta0:
            self._share_theta0_entries()
        self.at_theta0 = False


class Theta0Callback(TrainerCallback):
    """Clears `trainer.at_theta0` at the first optimizer step, and at the start of a train() that resumes from a
    checkpoint past step 0."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0:
            self.trainer._leave_theta0()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._leave_theta0()
