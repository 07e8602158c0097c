"""The verl trainer mode `erpo`: verl 0.9's synchronous PPO trainer with the ERPO actor loss.

verl imports this module on `import verl` (the `verl.plugins` entry point of the erpo distribution; or
`VERL_USE_EXTERNAL_MODULES=erpo.integrations.verl_trainer`), which registers it with `register_trainer`. A verl
launch then selects it with one setting, ERPO's options going under `erpo`:

    python -m verl.trainer.main_ppo ... trainer.v1.trainer_mode=erpo +erpo.qkl_coef=0.01

At start it checks the run's settings, has the actor's own engine score ell_theta0(q) of every training prompt
with the initial weights, on the actor's devices (`verl_reference`; or reads the cache of an earlier start), and
sets `erpo_ppo_loss` as the actor's loss; everything else (rollout, rewards, advantages, old and reference
log-probs, checkpoints, logging) is verl's.
"""
from __future__ import annotations

import copy
import logging
import os
from functools import partial

import torch
from omegaconf import OmegaConf, open_dict

from erpo.process_state import variables_as_found

# verl's engine package, which its trainer imports, sets TORCH_CUDA_ARCH_LIST=8.0 on a machine without CUDA for its
# Megatron engine's import and removes it only when that import succeeds: without Megatron it stayed set for the rest
# of the process (this module is imported at `import verl`), and for every build or process started afterwards
with variables_as_found(["TORCH_CUDA_ARCH_LIST"]):
    from verl.trainer.ppo.v1 import register_trainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils.config import omega_conf_to_dataclass

from erpo.integrations.query_reference import load_or_build_reference
from erpo.integrations.template_date import DatedTemplate, DateSettings, date_dependence
from erpo.integrations.verl import (
    POINT_AT,
    REBUILD,
    STEP_MISS,
    ERPOSettings,
    check_actor_config,
    check_fused_kernels,
    erpo_loss_fn,
    fused_kernels_backend,
)
from erpo.integrations.verl_reference import engine_precision, engine_query_logp
from erpo.models.loading import dropouts_besides_adapters
from erpo.reference.cache import CACHE_FILE

ENGINE_STRATEGIES = ("fsdp", "fsdp2")   # the engines whose full-sequence log-probs the tests check
# a chat template that writes today's date (`template_date`): the fix, in verl's setting names
DATE_SETTINGS = DateSettings(kwargs="+data.apply_chat_template_kwargs.date_string={date_string}",
                             template="the tokenizer (actor_rollout_ref.model.path)", resume_rebuilds=False)
logger = logging.getLogger(__name__)


def check_run_config(config, settings: ERPOSettings) -> None:
    """Refuse, in one line naming the setting, what verl can run but ERPO's loss cannot reproduce."""
    actor = config.actor_rollout_ref.actor
    check_actor_config(actor)
    check_fused_kernels(fused_kernels_backend(config.actor_rollout_ref.model), settings)
    if actor.strategy not in ENGINE_STRATEGIES:
        raise ValueError(f"actor_rollout_ref.actor.strategy={actor.strategy!r} is not supported with ERPO; use fsdp "
                         "or fsdp2")
    if config.algorithm.adv_estimator == "gae":
        raise ValueError("algorithm.adv_estimator=gae gives per-token advantages; ERPO weights each sample's "
                         "policy gradient by w(q): use an outcome estimator (grpo, rloo, ...)")
    if config.get("distillation") and config.distillation.get("enabled", False):
        raise ValueError("distillation.enabled=true replaces the actor loss; it cannot be combined with ERPO")
    if settings.needs_reference and config.actor_rollout_ref.rollout.multi_turn.enable:
        raise ValueError("actor_rollout_ref.rollout.multi_turn.enable=true: prompts built with tools cannot be "
                         "tokenized ahead for ell_theta0(q); set +erpo.qkl_coef=0 +erpo.query_weight=none")


def training_prompt_ids(dataset, tokenizer, *, hf_model_type: str | None, chat_template_kwargs: dict,
                        prompt_length: int) -> list[list[int]]:
    """Token ids of every prompt of `dataset` (verl's RLHFDataset: items with `raw_prompt` messages) as verl's
    single-turn agent loop builds them: its Continuous Token builder with the generation prompt, left-truncated to
    `prompt_length`."""
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
    builder = create_continuous_token_builder(tokenizer, hf_model_type=hf_model_type,
                                              chat_template_kwargs=chat_template_kwargs)
    prompts = []
    for index in range(len(dataset)):
        ids = list(builder.build_initial_tokens(list(dataset[index]["raw_prompt"])))
        prompts.append(ids[-prompt_length:])
    return prompts


def template_date(dataset, tokenizer, prompt_ids: list[list[int]], **rendering) -> DatedTemplate | None:
    """Whether the chat template writes today's date into the prompts the actor trains on (`date_dependence`): the
    first item of `dataset` built again as `training_prompt_ids` built it (`prompt_ids[0]`, with `rendering`: its
    hf_model_type, chat_template_kwargs and prompt_length), as on another date. A date the left truncation cuts off
    is none."""
    if not prompt_ids:
        return None
    kwargs = rendering.pop("chat_template_kwargs")
    return date_dependence(lambda extra: training_prompt_ids([dataset[0]], tokenizer, **rendering,
                                                             chat_template_kwargs={**kwargs, **extra})[0],
                           prompt_ids[0])


def actor_param_dtype(actor) -> torch.dtype:
    """The dtype verl's FSDP engine runs the actor's forward in (`actor`: actor_rollout_ref.actor):
    `fsdp_config.mixed_precision.param_dtype`, bf16 when unset (the engine's default)."""
    from verl.utils.torch_dtypes import PrecisionType
    mixed = actor.fsdp_config.get("mixed_precision") or {}
    return PrecisionType.to_dtype(mixed.get("param_dtype", "bf16"))


def log_prob_calls(config, world_size: int) -> dict:
    """How the cache's prompts go to the actor's `compute_log_prob` (`engine_query_logp`'s `multiple` and
    `tokens_per_call`) under verl's run `config`, the actor worker group being of `world_size` ranks: each call a
    multiple of world_size x `rollout.log_prob_micro_batch_size_per_gpu` sequences (verl splits a batch into equal
    parts per dp rank, each into micro-batches of that size; 1 with `use_dynamic_bsz`), of at most a training
    batch of prompts' tokens (`data.train_batch_size` x `rollout.prompt_length`)."""
    rollout = config.actor_rollout_ref.rollout
    per_rank = 1 if config.actor_rollout_ref.actor.use_dynamic_bsz else rollout.log_prob_micro_batch_size_per_gpu
    return dict(multiple=world_size * per_rank, tokens_per_call=config.data.train_batch_size * rollout.prompt_length)


def check_actor_dropout(hf_config) -> None:
    """ValueError naming the dropout when the actor's model (`hf_config`, built on the meta device: no weights) has
    some: verl trains the actor in train mode with its config's dropout, so ell_theta(q) would be noisy against
    the cached ell_theta0(q), scored without it, a Query-KL above 0 at theta0 (`erpo.models.loading.dropouts`)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        # a copy: from_config sets the attention kernel on the config it is given (verl's asks for flash-attn)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), attn_implementation="eager")
        active = dropouts_besides_adapters(model)
    if active:
        raise ValueError(f"the actor's {type(hf_config).__name__} trains with dropout ({', '.join(active)}), so "
                         "ell_theta(q) is noisy against the cached ell_theta0(q), scored without it: a Query-KL above "
                         "0 at theta0; set those rates to 0 in actor_rollout_ref.model.override_config, or set "
                         "+erpo.qkl_coef=0")


@register_trainer("erpo")
class ERPOTrainer(PPOTrainerSync):
    """verl's synchronous trainer (`trainer.v1.trainer_mode=sync`) with the ERPO actor loss; options under `erpo`."""

    def __init__(self, config):
        settings = ERPOSettings.from_block(OmegaConf.to_container(config.get("erpo") or OmegaConf.create({}),
                                                                       resolve=True))
        check_run_config(config, settings)
        with open_dict(config):   # verl's own code branches on the mode name: run as "sync"
            config.trainer.v1.trainer_mode = "sync"
        super().__init__(config)
        self.erpo_settings = settings

    def _setup(self):
        super()._setup()
        if self.processor is not None:
            raise ValueError("ERPO in verl supports text-only models (this model has a multimodal processor)")
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        reference = self._reference() if self.erpo_settings.needs_reference else None
        self.actor_rollout_wg.set_loss_fn(erpo_loss_fn(actor_config, self.erpo_settings, reference))

    def _reference(self):
        """ell_theta0(q), w(q) of every training prompt: the cache at +erpo.ref_cache (default
        <trainer.default_local_dir>/erpo_reference_cache.json), or scored now by the actor's engine with the initial
        weights (`engine_query_logp`), in the actor's mixed precision (`actor_param_dtype`) at the rollout
        temperature. A resumed run (its actor holds a checkpoint's weights) without its cache is refused; a cache
        built on an earlier day by a chat template that writes the date is refused naming that day and the fix."""
        model = omega_conf_to_dataclass(self.config.actor_rollout_ref.model)
        if self.erpo_settings.qkl_coef != 0:
            check_actor_dropout(model.hf_config)
        rollout = self.config.actor_rollout_ref.rollout
        rendering = dict(hf_model_type=getattr(model.hf_config, "model_type", None),
                         chat_template_kwargs=dict(self.config.data.get("apply_chat_template_kwargs") or {}),
                         prompt_length=rollout.prompt_length)
        prompt_ids = training_prompt_ids(self.train_dataset, self.tokenizer, **rendering)
        step_miss = STEP_MISS
        dated = template_date(self.train_dataset, self.tokenizer, prompt_ids, **rendering)
        if dated is not None:   # verl's agent loop renders each prompt at each step
            logger.warning("ERPO: %s", dated.start_warning("verl's agent loop", DATE_SETTINGS))
            step_miss = f"{STEP_MISS} {dated.miss_cause(DATE_SETTINGS)}"
        path = self.erpo_settings.ref_cache or os.path.join(self.config.trainer.default_local_dir, CACHE_FILE)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        erpo_log = logging.getLogger("erpo")
        if erpo_log.level == logging.NOTSET:   # `import verl` sets the root logger to WARNING: erpo's INFO lines
            erpo_log.setLevel(logging.INFO)    # (the scoring's progress) would not show in the driver's log
        score = partial(engine_query_logp, self.actor_rollout_wg, temperature=rollout.temperature,
                        **log_prob_calls(self.config, self.actor_rollout_wg.world_size))
        precision = engine_precision(model, actor_param_dtype(self.config.actor_rollout_ref.actor),
                                     self.config.trainer.device)
        changed = None if dated is None else partial(dated.load_miss, settings=DATE_SETTINGS)
        return load_or_build_reference(model.local_path, self.tokenizer, prompt_ids, path=path,
                                       temperature=rollout.temperature, precision=precision, score=score,
                                       trainer="verl", remedy=REBUILD, step_miss=step_miss,
                                       resumed_step=self.global_steps,   # verl's: 0 at a fresh start
                                       point_at=POINT_AT, changed=changed)
