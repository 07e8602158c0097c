"""ERPO inside verl 0.9 (the model-engine workers): the actor loss, the cached ell_theta0(q), the trainer mode.

verl's actor engine (`FSDPEngineWithLMHead.prepare_model_outputs`) already scores every token of prompt + response:
`model_output["log_probs"]` is a jagged [B, prompt + response] tensor whose row j scores token j + 1, and verl's
`ppo_loss` keeps only the response rows. `erpo_ppo_loss` keeps the prompt rows too: their sum is ell_theta(q), of the
same forward. It then forms, through erpo_kernels' `logprob_erpo_loss` (the loss on per-token log-probs),

    loss = dp_size * [ aggregate(w(q) * pg_t * is_t + beta * k3_t - c_H * H_t) + alpha * sum_s k3(r_s) / G ]

with verl's vanilla clipped policy gradient pg_t (clip_ratio_low / high, dual clip clip_ratio_c on negative
advantages, log-ratio clamped to +-20), its rollout importance-sampling weights is_t, its `use_kl_loss` term
(low_var_kl: k3 clamped to +-10) and entropy bonus, all aggregated by `loss_agg_mode` exactly as verl's `agg_loss`
does over the global mini-batch (token counts and sequence counts over every dp rank and micro-batch), plus the
Query-KL r_s = ell_theta0(q_s) - ell_theta(q_s) averaged over the mini-batch's G sequences. With qkl_coef = 0 and
w(q) = 1 it is verl's `ppo_loss` (tests/integrations/test_verl_integration.py, on verl's real FSDP engine).

ell_theta0(q) and w(q) come from erpo's reference cache (scored at start by the actor's own engine,
`erpo.integrations.verl_reference`), read or built and looked up by the prompt's token ids (what reaches the loss)
in `erpo.integrations.query_reference`; a prompt the cache lacks is an error naming it.

Host reads per micro-batch: 3 (tests/integrations/test_verl_integration.py counts them): one copy of the rows'
lengths and prompt tokens (with the advantages' check), the kernels' value checks, and one copy of the metrics, which
verl's `Metric` holds as host numbers; the looked-up ell_theta0(q) and w(q) go up from pinned memory without a wait.

Wiring. `erpo_loss_fn(actor_config, settings, reference)` is the `loss_fn` of `ActorRolloutRefWorker.set_loss_fn`
(verl's default is `partial(ppo_loss, config=actor_config)`). The trainer mode `erpo` (registered when verl loads
its `verl.plugins` entry points) is verl's synchronous trainer that builds or reads the cache at start and sets
that loss on the actor: `trainer.v1.trainer_mode=erpo +erpo.qkl_coef=0.01`.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, fields
from functools import partial

import torch

from erpo.integrations.advantages import sample_advantages
from erpo.integrations.query_reference import QueryReference
from erpo.terms import QUERY_WEIGHTS_VERL, SEQUENCE_QKL_ESTIMATORS, check_choice, check_qkl_coef, needs_reference
from erpo_kernels import did_you_mean, logit_transforms_from_config, logprob_erpo_loss

VERL_VERSION = "0.9.1"            # the verl release the parity tests run against (extra erpo[verl])
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_LOSS_TYPES = ("low_var_kl", "k3")     # verl's k3 (log-ratio clamped to +-20, value to +-10) = ours with kl_clamp
VERL_LOG_RATIO_CLAMP = 20.0     # verl clamps log(ratio) and the KL log-ratio to +-20
VERL_KL_CLAMP = 10.0            # and low_var_kl's value to +-10
# what a verl run's cache errors end with (`verl_trainer`; `query_reference.RESUMED` when the run resumes), and how
# its resumed run is pointed at the cache of its start (`query_reference.MISSING_AT_RESUME`)
REF_CACHE = "+erpo.ref_cache=..."
REBUILD = f"Delete it to rebuild it, or set {REF_CACHE} to another path."
POINT_AT = f"set {REF_CACHE} to its path"
# what a prompt missing at a training step ends with: the cache held every training prompt at start, as `verl_trainer`
# tokenizes them, so the step's prompt was built otherwise, and no rebuild adds it
STEP_MISS = ("(it held every training prompt at start, as verl's single-turn agent loop builds them: the chat template "
             "with data.apply_chat_template_kwargs, left-truncated to actor_rollout_ref.rollout.prompt_length; this "
             "one reached the loss built otherwise, by another agent loop, dataset class or tools, and rebuilding the "
             "cache would not add it). Train with the single-turn agent loop on RLHFDataset's prompts, or set "
             "+erpo.qkl_coef=0 +erpo.query_weight=none.")



@dataclass(frozen=True)
class ERPOSettings:
    """ERPO's options, the `erpo:` block of a verl launch (`+erpo.qkl_coef=0.01`); the loss's defaults (API.md)."""

    qkl_coef: float = 0.01          # alpha, weight of the Query-KL
    qkl_estimator: str = "k3"       # on r = ell_theta0(q) - ell_theta(q)
    query_weight: str = "static"    # w(q) on each sample's policy-gradient term: static (cached) or none
    ref_cache: str | None = None    # cache to read (or write when absent); default <default_local_dir>/CACHE_FILE

    def __post_init__(self):
        check_qkl_coef(self.qkl_coef, "erpo.qkl_coef")
        check_choice("erpo.qkl_estimator", self.qkl_estimator, SEQUENCE_QKL_ESTIMATORS)
        check_choice("erpo.query_weight", self.query_weight, QUERY_WEIGHTS_VERL)

    @classmethod
    def from_block(cls, block: dict) -> ERPOSettings:
        """The settings of a launch's `erpo:` block ({name: value}); a name that is none of them (`+erpo.qkl_cof`) is
        refused in one line naming it and the closest setting, where the dataclass would raise a TypeError that
        names neither the launch's key nor what to set."""
        known = [field.name for field in fields(cls)]
        for name in block:
            if name not in known:
                hint = did_you_mean(name, known, spelled="+erpo.{}".format) or "ERPO's settings are " + ", ".join(
                    f"erpo.{setting}" for setting in known)
                raise ValueError(f"+erpo.{name} is not an ERPO setting: {hint}")
        return cls(**block)

    @property
    def needs_reference(self) -> bool:
        """`erpo.terms.needs_reference` of these settings."""
        return needs_reference(self.qkl_coef, self.query_weight)


def check_actor_config(config) -> None:
    """Refuse, in one line naming the setting, what this loss does not reproduce of verl's actor (an ActorConfig)."""
    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    if loss_mode != "vanilla":
        raise ValueError(f"actor.policy_loss.loss_mode={loss_mode!r} is not supported with ERPO; use 'vanilla'")
    if config.loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"actor.loss_agg_mode={config.loss_agg_mode!r} is not supported with ERPO; use one of "
                         f"{list(LOSS_AGG_MODES)}")
    if config.use_kl_loss and config.kl_loss_type not in KL_LOSS_TYPES:
        raise ValueError(f"actor.kl_loss_type={config.kl_loss_type!r} is not supported with ERPO; use low_var_kl "
                         "(or set actor.use_kl_loss=false: the Query-KL replaces the Policy-KL)")


FUSED_BACKENDS = ("torch", "liger")   # verl's fused-kernel backends whose ell_theta(q) the tests check


def fused_kernels_backend(model_config) -> str:
    """What turns the actor's hidden states into log-probs, of verl's `actor_rollout_ref.model` (an omegaconf node
    or verl's HFModelConfig): "off" (the model's own logits) without `use_fused_kernels`, else its
    `fused_kernel_options.impl_backend` ("torch", verl's default; "liger"; "triton"; "None" where unset)."""
    if not model_config.get("use_fused_kernels", False):
        return "off"
    return str((model_config.get("fused_kernel_options") or {}).get("impl_backend"))


def check_fused_backend(backend: str, *, tested: str, choices: str) -> None:
    """Refuse verl's fused log-prob kernels of a `backend` (`fused_kernels_backend`) the tests do not run: verl
    0.9.1's Triton kernels (`impl_backend=triton`) take CUDA tensors only (they assert it), so no test here checks
    that their ell_theta(q) at theta0 is the cached ell_theta0(q); "None" (no backend) makes verl skip its fused
    forward while its engine still reads the fused outputs. The torch and liger backends are checked against the
    logits path and against a cache they scored (tests/integrations/test_verl_fused_kernels.py). The error names
    what ERPO would read through them (`tested`) and the settings that avoid it (`choices`)."""
    if backend != "off" and backend not in FUSED_BACKENDS:
        raise ValueError(f"actor_rollout_ref.model.fused_kernel_options.impl_backend={backend} with "
                         f"use_fused_kernels=true: ERPO's {tested} is tested with verl's torch (its default) and liger "
                         f"fused backends only (verl 0.9.1's triton one runs on CUDA alone); set {choices}")


def check_fused_kernels(backend: str, settings: ERPOSettings) -> None:
    """At the `erpo` mode's start: with the Query-KL, `check_fused_backend` (the cache's own check,
    `verl_reference.engine_precision`, comes later, where every way to the cache passes)."""
    if settings.qkl_coef != 0:
        check_fused_backend(backend, tested="Query-KL",
                            choices="impl_backend=torch, use_fused_kernels=false, or +erpo.qkl_coef=0")


def check_fused_logits(backend: str, hf_config) -> None:
    """Refuse verl's fused log-prob kernels (`backend` != "off") on a model whose final logits have a transform
    (`hf_config`: Gemma-2's soft-cap, Granite's scaling; `logit_transforms_from_config`): verl 0.9.1's fused forward
    (`forward_with_torch_backend`) scores hidden @ lm_head.weight and drops it, so ell_theta0(q) and w(q) would not
    be the model's (tests/integrations/test_verl_fused_kernels.py shows it)."""
    transforms = logit_transforms_from_config(hf_config)
    if backend != "off" and (transforms["logit_scale"] != 1.0 or transforms["logit_softcap"] is not None):
        raise ValueError(f"actor_rollout_ref.model.use_fused_kernels=true: verl's fused forward drops "
                         f"{type(hf_config).__name__}'s final-logit transform ({transforms}), so ell_theta0(q) and "
                         "w(q) would not be the model's log-likelihood; set use_fused_kernels=false, or "
                         "+erpo.qkl_coef=0 +erpo.query_weight=none")


@dataclass
class ActorRows:
    """One micro-batch of verl's actor as erpo_kernels' rows: row i of the engine's full-sequence log-probs (the
    jagged tensor's values, sample after sample) scores token i + 1 of its sample. Query rows score prompt tokens
    2..P, response rows the response tokens that response_mask keeps (not tool outputs); the last row of each
    sample scores nothing. The prompts come from `actor_rows`' one read of the device."""

    token_kind: torch.Tensor      # [N] int64: 0 not scored, 1 query, 2 response
    sample_index: torch.Tensor    # [N] int64
    response_slot: torch.Tensor   # [N] int64: the response position k a row scores (0 where none)
    in_response: torch.Tensor     # [N] bool: the row scores a response token (a tool output's too)
    prompt_ids: list[list[int]]   # B prompts, unpadded (host)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[B, R] response-aligned values (verl's padded layout) -> [N] fp32 on response rows, 0 elsewhere."""
        picked = values.float()[self.sample_index, self.response_slot]
        return torch.where(self.token_kind == 2, picked, torch.zeros((), device=picked.device))

    def gather(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """[N] row values -> [B, width] response-aligned, 0 past each response: verl's `no_padding_2_padding` (its
        row P - 1 + k at position k, tool outputs included) without its host reads (three per sample)."""
        out = values.new_zeros(len(self.prompt_ids), width + 1)
        column = torch.where(self.in_response, self.response_slot, width)   # the other rows go to a spare column
        return out.index_put_((self.sample_index, column), values)[:, :width]


ADVANTAGES_VARY = ("ERPO needs one advantage per sample (an outcome estimator such as grpo or rloo); these "
                   "advantages vary along the response (algorithm.adv_estimator=gae?)")


def actor_rows(data, response_mask: torch.Tensor, num_rows: int,
               advantages_vary: torch.Tensor | None = None) -> ActorRows:
    """The rows of a micro-batch `data` (verl's TensorDict: `prompts` and `responses` jagged or padded with
    `attention_mask`, as `no_padding_2_padding` reads them), response_mask [B, R] padded. One device -> host copy:
    the lengths and the prompt tokens together, with `advantages_vary` (`sample_advantages`' 0-dim check) when
    given; the checks are made on that copy (a ValueError naming what is wrong)."""
    prompts, responses = data["prompts"], data["responses"]
    device = response_mask.device
    if prompts.is_nested:
        prompt_lens, response_lens = prompts.offsets().diff(), responses.offsets().diff()
        tokens, token_mask = prompts.values(), None
    else:
        real = data["attention_mask"]
        width = prompts.shape[1]
        prompt_mask = real[:, :width]
        prompt_lens, response_lens = prompt_mask.sum(1), real[:, width:].sum(1)
        tokens, token_mask = prompts.reshape(-1), prompt_mask.reshape(-1)   # left padding: selected on the host
    prompt_lens, response_lens = prompt_lens.to(device), response_lens.to(device)
    vary = torch.zeros(1, dtype=torch.long, device=device) if advantages_vary is None else advantages_vary.reshape(1)
    parts = [prompt_lens, response_lens, vary, tokens] + ([] if token_mask is None else [token_mask])
    host = torch.cat([part.to(device=device, dtype=torch.long) for part in parts]).tolist()   # the one read
    part_ends = list(itertools.accumulate(part.numel() for part in parts))
    host_prompt_lens, host_response_lens, (varies,), flat, *real_tokens = (
        host[start:end] for start, end in zip([0] + part_ends, part_ends))
    if real_tokens:
        flat = [token for token, kept in zip(flat, real_tokens[0]) if kept]
    total = sum(host_prompt_lens) + sum(host_response_lens)
    if total != num_rows:
        raise ValueError(f"the engine's log-probs hold {num_rows} rows, the micro-batch's prompts + responses "
                         f"{total} tokens")
    if 0 in host_prompt_lens:
        raise ValueError("a sample has an empty prompt; ERPO needs at least one prompt token per sample")
    if varies:
        raise ValueError(ADVANTAGES_VARY)
    bounds = [0] + list(itertools.accumulate(host_prompt_lens))
    prompt_ids = [flat[start:end] for start, end in zip(bounds, bounds[1:])]
    lengths = prompt_lens + response_lens
    ends = lengths.cumsum(0)
    rows = torch.arange(num_rows, device=device)
    sample = torch.searchsorted(ends, rows, right=True)     # the sample whose [start, end) holds the row
    position = rows - (ends - lengths)[sample]
    slot = position - (prompt_lens[sample] - 1)          # row P - 1 + k scores response token k
    in_response = (slot >= 0) & (slot < response_lens[sample])
    slot = torch.where(in_response, slot, 0).clamp(max=max(response_mask.shape[1] - 1, 0))
    scored_response = in_response & response_mask.bool()[sample, slot]
    kind = torch.where(scored_response, 2, torch.where(position < prompt_lens[sample] - 1, 1, 0))
    return ActorRows(kind.long(), sample.long(), slot.long(), in_response, prompt_ids)


def vanilla_pg_metrics(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor, config) -> dict[str, torch.Tensor]:
    """The metrics of verl's `compute_policy_loss_vanilla` (0.9.1) on [B, R] response-aligned values, as 0-dim device
    tensors: its formulas, without its three `.item()` reads. pg_clipfrac: the clipped branch's fraction; ppo_kl:
    the mean of -log ratio (clamped to +-20); pg_clipfrac_lower: the dual clip's fraction on negative advantages."""
    from verl.utils.torch_functional import masked_mean
    clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-VERL_LOG_RATIO_CLAMP, max=VERL_LOG_RATIO_CLAMP)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * config.get("clip_ratio_c", 3.0)
    return {"actor/pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask),
            "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask),
            "actor/pg_clipfrac_lower": masked_mean(
                torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)}


def erpo_ppo_loss(config, model_output, data, dp_group=None, *, settings: ERPOSettings,
                  reference: QueryReference | None):
    """The ERPO actor loss of one micro-batch, verl's `ppo_loss` contract: (loss, metrics).

    `config`: verl's ActorConfig; `model_output["log_probs"]` (and `["entropy"]` when computed): jagged
    [B, prompt + response] from the engine's forward; `data`: the micro-batch TensorDict (prompts, responses,
    response_mask, old_log_probs, advantages, optional rollout_is_weights and ref_log_prob, and the global batch
    info dp_size / batch_num_tokens / global_batch_size verl's engine sets)."""
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
    from verl.utils.metric import AggregationType, Metric

    check_actor_config(config)
    log_probs, entropy = model_output["log_probs"], model_output.get("entropy", None)
    token_logp = (log_probs.values() if log_probs.is_nested else log_probs).float()
    dp_size, batch_num_tokens, global_batch_size = data["dp_size"], data["batch_num_tokens"], data["global_batch_size"]
    info = dict(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
                loss_scale_factor=config.loss_scale_factor)
    config.global_batch_info.update(info)   # as ppo_loss: verl's policy-loss functions read it
    if dp_size > 1 and (batch_num_tokens is None or global_batch_size is None):
        raise ValueError("with dp_size > 1 verl's batch_num_tokens and global_batch_size are required")
    global_batch = dp_size > 1 or batch_num_tokens is not None or global_batch_size is not None \
        or config.loss_scale_factor is not None
    aggregation = AggregationType.SUM if global_batch else AggregationType.MEAN

    fields = ["response_mask", "old_log_probs", "advantages"] + [
        name for name in ("rollout_is_weights", "ref_log_prob") if name in data]
    padded = data.select(*fields).to_padded_tensor()
    response_mask = padded["response_mask"].bool()
    advantages, advantages_vary = sample_advantages(padded["advantages"], response_mask)
    rows = actor_rows(data, response_mask, token_logp.shape[0], advantages_vary)
    rollout_is_weights = padded.get("rollout_is_weights", None)
    if config.entropy_coeff != 0 and entropy is None:
        raise ValueError("actor.entropy_coeff != 0 but the engine computed no entropy (calculate_entropy)")
    row_entropy = None if entropy is None else (entropy.values() if entropy.is_nested else entropy).float()

    ref_query_logp = query_weight = None
    if reference is not None and settings.needs_reference:
        ell, weight = reference.lookup(rows.prompt_ids, device=token_logp.device)  # one upload, no wait
        ref_query_logp = ell if settings.qkl_coef != 0 else None
        query_weight = weight if settings.query_weight == "static" else None
    elif settings.needs_reference:
        raise ValueError("erpo_ppo_loss needs the reference cache (ell_theta0, w) for qkl_coef != 0 or "
                         "query_weight='static'")

    # verl's agg_loss: x / count * dp_size over the global mini-batch; seq-mean-token-sum-norm divides the
    # response terms by a horizon L as well, so the Query-KL's coefficient is multiplied by L to stay alpha.
    mode = config.loss_agg_mode
    horizon = 1.0
    if mode == "seq-mean-token-sum-norm":
        horizon = float(config.loss_scale_factor or response_mask.shape[-1])
    options = dict(
        qkl_coef=settings.qkl_coef * horizon, qkl_estimator=settings.qkl_estimator,
        clip_low=config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio,
        clip_high=config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio,
        dual_clip=config.clip_ratio_c, pg_log_ratio_clamp=VERL_LOG_RATIO_CLAMP, log_ratio_clamp=VERL_LOG_RATIO_CLAMP,
        policy_kl_coef=config.kl_loss_coef if config.use_kl_loss else 0.0, kl_clamp=VERL_KL_CLAMP,
        entropy_coef=config.entropy_coeff, entropy_agg="loss-agg",
        loss_agg={"token-sum": "token-mean", "seq-mean-token-sum-norm": "seq-mean-token-sum"}.get(mode, mode),
        num_items=1 if mode == "token-sum" else batch_num_tokens, num_seqs=global_batch_size)
    out = logprob_erpo_loss(
        token_logp, rows.token_kind, rows.sample_index, entropy=row_entropy,
        advantages=advantages, ref_query_logp=ref_query_logp,
        query_weight=query_weight, old_logp=rows.scatter(padded["old_log_probs"]),
        ref_logp=rows.scatter(padded["ref_log_prob"]) if config.use_kl_loss else None,
        token_weight=None if rollout_is_weights is None else rows.scatter(rollout_is_weights), **options)
    scale = dp_size / horizon
    loss = out.loss * scale

    # verl's metrics, under verl's names and by verl's formulas (detached), then ERPO's: device values read in one copy
    with torch.no_grad():
        width = response_mask.shape[1]
        log_prob = rows.gather(token_logp.detach(), width)     # verl's no_padding_2_padding, without its reads
        values = {name: (value, AggregationType.MEAN) for name, value in vanilla_pg_metrics(
            padded["old_log_probs"], log_prob, padded["advantages"], response_mask, config).items()}
        values["actor/pg_loss"] = (out.metrics["pg_loss"] * scale, aggregation)
        if entropy is not None:
            values["actor/entropy_loss"] = (agg_loss(
                loss_mat=rows.gather(row_entropy.detach(), width), loss_mask=response_mask, loss_agg_mode=mode,
                **config.global_batch_info), aggregation)
        if config.use_kl_loss:
            kld = kl_penalty(logprob=log_prob, ref_logprob=padded["ref_log_prob"], kl_penalty=config.kl_loss_type)
            values["kl_loss"] = (agg_loss(loss_mat=kld, loss_mask=response_mask, loss_agg_mode=mode,
                                          **config.global_batch_info), aggregation)
        queries = sum(len(ids) > 1 for ids in rows.prompt_ids)   # samples with query rows
        if "qkl" in out.metrics and queries:  # a metric that does not apply to the loss is left out
            # the loss's qkl is sum_s qkl_s / num_seqs; logged as the mean over this micro-batch's queries
            qkl_mean = out.metrics["qkl"] * (global_batch_size if global_batch_size is not None else queries) / queries
            values["actor/qkl"] = (qkl_mean, AggregationType.MEAN)
        values["actor/query_logp"] = (out.metrics["query_logp_mean"], AggregationType.MEAN)
        if query_weight is not None:
            values["actor/query_weight_mean"] = (query_weight.mean(), AggregationType.MEAN)
        read = torch.stack([value.double() for value, _ in values.values()]).tolist()   # the metrics' one read
    metrics = {name: Metric(value=number, aggregation=kind) for (name, (_, kind)), number in zip(values.items(), read)}
    if config.use_kl_loss:
        metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics


def erpo_loss_fn(actor_config, settings: ERPOSettings, reference: QueryReference | None):
    """The `loss_fn` for `ActorRolloutRefWorker.set_loss_fn` / `TrainingWorker.set_loss_fn` (picklable): verl's
    `partial(ppo_loss, config=actor_config)` with ERPO's terms. Warns on a verl release other than the tested one."""
    import verl
    if verl.__version__ != VERL_VERSION:
        warnings.warn(f"erpo.integrations.verl is tested against verl {VERL_VERSION}, this is verl {verl.__version__}: "
                      "run tests/integrations/test_verl_integration.py with it before trusting the parity",
                      stacklevel=2)
    check_actor_config(actor_config)
    if settings.needs_reference and reference is None:
        raise ValueError("ERPO needs ell_theta0(q) for qkl_coef != 0 or query_weight='static': pass a QueryReference")
    return partial(erpo_ppo_loss, config=actor_config, settings=settings, reference=reference)

