"""erpo.integrations.verl on verl's real FSDP engine (FSDP2, gloo, world size 1, fp32, a CPU platform; see
bench/verl_engine.py): with ERPO's terms off the loss is verl's `ppo_loss` (loss, every gradient, verl's metrics),
ell_theta(q) is the prompt's log-likelihood of the engine's own forward, the Query-KL and w(q) match `erpo_loss`
(torch backend) on an independent HF forward, and a real `train_batch` step trains with a Query-KL."""
import math
import os
import sys
from functools import partial

import pytest
import torch

# verl (and tensordict) through bench.verl_engine: it sets verl's CPU platform before verl is imported
verl_engine = pytest.importorskip("bench.verl_engine", exc_type=ModuleNotFoundError)

import tensordict  # noqa: E402
import verl  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from erpo.integrations.query_reference import CHANGED, QueryReference, load_or_build_reference  # noqa: E402
from erpo.integrations.verl import (  # noqa: E402
    REBUILD,
    STEP_MISS,
    ERPOSettings,
    actor_rows,
    check_actor_config,
    erpo_loss_fn,
)
from erpo.integrations.verl_reference import engine_precision, engine_query_logp, prompt_calls  # noqa: E402
from erpo.models.tiny import build_tokenizer  # noqa: E402
from erpo.reference.cache import ReferenceCache, prompt_hash  # noqa: E402
from erpo_kernels import erpo_loss, from_padded, query_weights  # noqa: E402
from launch_counts import LaunchCounter  # noqa: E402
from tiny_models import save_tiny_model, tiny_test_model  # noqa: E402

PROMPTS = ["1+1=", "22+3=", "7*8=", "3*33="]
RESPONSE_LENGTHS = (6, 4, 5, 3)
OFF = ERPOSettings(qkl_coef=0.0, query_weight="none")
FP32 = torch.float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory of a tiny Qwen2 + its tokenizer, tokenizer, the HF model theta0)."""
    tokenizer = build_tokenizer()
    path = save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer)
    return path, tokenizer, AutoModelForCausalLM.from_pretrained(path)


ENGINES = {}


def engine_for(tiny, **settings):
    """One engine per model directory (`tiny[0]`) and setting for the whole file (building one costs seconds); tests
    never step them, except the train_batch test, which builds its own."""
    key = (str(tiny[0]), tuple(sorted(settings.items())))
    if key not in ENGINES:
        ENGINES[key] = verl_engine.build_engine(tiny[0], **settings)
    return ENGINES[key]


def test_engines_are_kept_per_model_and_setting(monkeypatch):
    """`engine_for` gives another model's test its own engine (it gave the first model's, keyed by settings only),
    and the same model and settings the same one."""
    monkeypatch.setattr(verl_engine, "build_engine", lambda path, **settings: (path, settings))
    monkeypatch.setattr(sys.modules[__name__], "ENGINES", {})   # the file's engines stay as they are
    assert engine_for(("a",), use_remove_padding=True) == ("a", {"use_remove_padding": True})
    assert engine_for(("b",), use_remove_padding=True) == ("b", {"use_remove_padding": True})
    assert engine_for(("a",), use_remove_padding=True) is engine_for(("a",), use_remove_padding=True)


def batch(tiny, engine, *, seed=0, nested=True, entropy=True, **kwargs):
    _, tokenizer, model = tiny
    g = torch.Generator().manual_seed(seed)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    responses = [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in RESPONSE_LENGTHS]
    data = verl_engine.actor_batch(model, prompts, responses, pad_id=tokenizer.pad_token_id, seed=seed,
                                   nested=nested, **kwargs)
    return verl_engine.set_engine_keys(engine, data, calculate_entropy=entropy)


def engine_param_dtype(engine) -> torch.dtype:
    """The dtype of the engine's mixed precision (its forward's autocast; fp32: none)."""
    from verl.utils.torch_dtypes import PrecisionType
    return PrecisionType.to_dtype(engine.engine_config.mixed_precision["param_dtype"])


def engine_reference(tiny, engine, prompts, path, *, temperature=1.0, world_size=1, tokens_per_call=4096,
                     model_dir=None):
    """`load_or_build_reference` as the `erpo` trainer mode calls it, ell_theta0(q) scored by `engine` through verl's
    `compute_log_prob` (a worker group of `world_size` ranks around it, `EngineWorkerGroup`), in the engine's
    precision; `model_dir`: the model directory the run names (default the tiny model's). (QueryReference, the
    worker group: its `calls`)."""
    group = verl_engine.EngineWorkerGroup(engine, world_size)
    config = engine.engine_config
    multiple = world_size * (1 if config.use_dynamic_bsz else config.infer_micro_batch_size_per_gpu)
    score = partial(engine_query_logp, group, temperature=temperature, multiple=multiple,
                    tokens_per_call=tokens_per_call)
    precision = engine_precision(engine.model_config, engine_param_dtype(engine), "cpu")
    reference = load_or_build_reference(model_dir or tiny[0], tiny[1], prompts, path=str(path),
                                        temperature=temperature, precision=precision, score=score, trainer="verl",
                                        remedy=REBUILD)
    return reference, group


def actor_config(**overrides):
    settings = dict(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                    use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.05, clip_ratio_c=1.3)
    return ActorConfig(**{**settings, **overrides})


def metric_values(outputs) -> dict:
    """{name: [value per micro-batch]} of the engine's outputs."""
    def values(metric):   # a verl Metric (its values), a plain list or a number
        metric = metric.values if hasattr(metric, "values") else metric
        return [float(v) for v in metric] if isinstance(metric, list) else [float(metric)]
    return {name: values(metric) for name, metric in outputs["metrics"].items()}


def assert_same(ours, theirs, rel=1e-6, grad_rel=None):
    (our_out, our_grads), (their_out, their_grads) = ours, theirs
    assert our_grads.keys() == their_grads.keys() and len(their_grads) > 5
    torch.testing.assert_close(torch.tensor(our_out["loss"]), torch.tensor(their_out["loss"]), rtol=rel, atol=0)
    for name, grad in their_grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        tolerance = rel if grad_rel is None else grad_rel
        torch.testing.assert_close(our_grads[name], grad, rtol=tolerance, atol=tolerance * scale, msg=name)


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_equals_verl_ppo_loss(tiny, mode, use_remove_padding):
    """qkl_coef=0, w=1: loss, every gradient and verl's metrics equal ppo_loss on the same engine, with a tool
    output masked inside a response, rollout IS weights, the KL loss, the entropy bonus and the dual clip active."""
    engine = engine_for(tiny, use_remove_padding=use_remove_padding)
    config = actor_config(loss_agg_mode=mode)
    data = batch(tiny, engine)
    theirs = verl_engine.loss_and_grads(engine, data, partial(ppo_loss, config=config))
    ours = verl_engine.loss_and_grads(engine, data, erpo_loss_fn(config, OFF, None))
    assert_same(ours, theirs)
    their_metrics, our_metrics = metric_values(theirs[0]), metric_values(ours[0])
    assert set(their_metrics) <= set(our_metrics)
    for name, values in their_metrics.items():
        assert our_metrics[name] == pytest.approx(values, rel=1e-5, abs=1e-7), name
    assert max(their_metrics["actor/pg_clipfrac_lower"]) > 0      # the dual clip bites
    # qkl_coef 0: the loss's qkl does not apply (no ref_query_logp) and is left out, as is any NaN
    assert "actor/qkl" not in our_metrics and not [name for name, values in our_metrics.items()
                                                   if any(math.isnan(v) for v in values)]


def test_bf16_mixed_precision_equals_verl(tiny):
    """verl's bf16 mixed precision (the forward and the loss under bf16 autocast): still verl's loss and gradients.
    (No entropy bonus: verl sums bf16 entropies in bf16, ours in fp32, a difference of bf16 rounding.)"""
    engine = engine_for(tiny, param_dtype="bf16")
    config = actor_config(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.0)
    data = batch(tiny, engine)
    theirs = verl_engine.loss_and_grads(engine, data, partial(ppo_loss, config=config))
    # the loss to fp32 rounding; the gradients to bf16's: each token's d loss / d logp, equal up to fp32 rounding,
    # is rounded to bf16 on its way into the bf16 graph, where one ulp flips now and then (measured: <= 1.1%)
    assert_same(verl_engine.loss_and_grads(engine, data, erpo_loss_fn(config, OFF, None)), theirs, rel=1e-5,
                grad_rel=2e-2)


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "padded-fields"])
def test_dynamic_batch_size_equals_verl(tiny, nested):
    """use_dynamic_bsz: micro-batches by token budget (3 here, reordered); v1's jagged fields or padded ones."""
    engine = engine_for(tiny, use_dynamic_bsz=True, max_token_len=24)
    config = actor_config(loss_agg_mode="seq-mean-token-mean", use_dynamic_bsz=True)
    data = batch(tiny, engine, seed=1, nested=nested, with_is=False)
    theirs = verl_engine.loss_and_grads(engine, data, partial(ppo_loss, config=config))
    assert len(metric_values(theirs[0])["actor/pg_loss"]) >= 2
    assert_same(verl_engine.loss_and_grads(engine, data, erpo_loss_fn(config, OFF, None)), theirs)


def padded_reference(tiny, data):
    """From `data`'s padded fields: (input_ids, attention_mask, response mask [B, P + R], query mask, prompt width)."""
    prompts, responses = data["prompts"], data["responses"]
    attention = data["attention_mask"]
    width = prompts.shape[1]
    response = torch.cat([torch.zeros_like(prompts), data["response_mask"]], 1)
    query = torch.cat([attention[:, :width], torch.zeros_like(responses)], 1)
    return torch.cat([prompts, responses], 1), attention, response, query, width


def prompt_ids_of(data):
    width = data["prompts"].shape[1]
    return [p[m.bool()].tolist() for p, m in zip(data["prompts"], data["attention_mask"][:, :width])]


def test_query_logp_equals_an_independent_hf_forward(tiny):
    """ell_theta(q) summed from the engine's prompt rows (remove-padding, packed) = the HF model's own."""
    engine = engine_for(tiny, use_remove_padding=True)
    data = batch(tiny, engine, nested=False)
    seen = {}

    def probe(config, model_output, data, dp_group=None):
        loss, metrics = erpo_loss_fn(config, OFF, None)(model_output=model_output, data=data, dp_group=dp_group)
        seen.setdefault("query_logp", []).extend(metrics["actor/query_logp"].values)
        return loss, metrics

    verl_engine.loss_and_grads(engine, data, partial(probe, actor_config()))
    input_ids, attention, _, query, _ = padded_reference(tiny, data)
    logp = verl_engine.hf_token_logp(tiny[2], input_ids, attention)
    rows = from_padded(input_ids, attention, torch.zeros_like(input_ids), query_mask=query)
    ell = torch.zeros(len(PROMPTS)).index_add_(0, rows.sample_index, torch.where(rows.token_kind == 1,
                                                                                 logp.reshape(-1), 0.0))
    expected = [ell[:2].mean().item(), ell[2:].mean().item()]    # two micro-batches of two samples
    assert seen["query_logp"] == pytest.approx(expected, rel=1e-5)
    assert all(value < -1.0 for value in expected)


def erpo_reference_loss(tiny, data, config, reference, settings):
    """erpo_loss (torch backend) on an independent HF forward of `data` with verl's global normalizers:
    (loss, {parameter name: gradient})."""
    model = tiny[2]
    input_ids, attention, response, query, width = padded_reference(tiny, data)
    rows = from_padded(input_ids, attention, response, query_mask=query)
    length = data["responses"].shape[1]

    def scatter(values):  # [B, R] response-aligned -> rows of the padded [B, P + R] layout
        full = torch.zeros(input_ids.shape)
        full[:, width - 1:width - 1 + length] = values.float()
        return full.reshape(-1)

    ell, weight = reference.lookup(prompt_ids_of(data))
    model.zero_grad(set_to_none=True)
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids).logits
    out = erpo_loss(logits.reshape(-1, logits.shape[-1]), rows.targets, rows.token_kind, rows.sample_index,
                    advantages=data["advantages"][:, 0].float(), ref_query_logp=ell, query_weight=weight,
                    old_logp=scatter(data["old_log_probs"]), ref_logp=scatter(data["ref_log_prob"]),
                    token_weight=scatter(data["rollout_is_weights"]), backend="torch",
                    qkl_coef=settings.qkl_coef, clip_low=0.2, clip_high=0.2, dual_clip=config.clip_ratio_c,
                    pg_log_ratio_clamp=20.0, policy_kl_coef=config.kl_loss_coef, kl_clamp=10.0,
                    entropy_coef=config.entropy_coeff, loss_agg="token-mean",
                    num_items=int(data["response_mask"].sum()), num_seqs=len(PROMPTS))
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


def reference_of(tiny, data, offset=None, seed=0):
    """A QueryReference for `data`'s prompts: ell_theta0 = the HF model's ell(q) + `offset` (random when None),
    random w(q)."""
    g = torch.Generator().manual_seed(seed)
    input_ids, attention, _, query, _ = padded_reference(tiny, data)
    logp = verl_engine.hf_token_logp(tiny[2], input_ids, attention)
    rows = from_padded(input_ids, attention, torch.zeros_like(input_ids), query_mask=query)
    ell = torch.zeros(len(PROMPTS), dtype=torch.float64).index_add_(
        0, rows.sample_index, torch.where(rows.token_kind == 1, logp.reshape(-1), 0.0).double())
    shift = torch.rand(len(PROMPTS), generator=g) * 3 - 1.5 if offset is None else torch.full((len(PROMPTS),), offset)
    weight = torch.rand(len(PROMPTS), generator=g) * 2
    entries = {prompt_hash(ids): (float(e + s), float(w))
               for ids, e, s, w in zip(prompt_ids_of(data), ell, shift, weight)}
    return QueryReference(entries, "test-cache.json", tiny[1])


def test_query_kl_equals_erpo_loss_on_an_hf_forward(tiny):
    """qkl_coef > 0, random w(q), ell_theta0 != ell_theta: loss and every gradient equal erpo_loss's (torch
    backend) on an independent HF forward of the same batch."""
    engine = engine_for(tiny, use_remove_padding=True)
    config = actor_config()
    data = batch(tiny, engine, nested=False)
    reference = reference_of(tiny, data)
    settings = ERPOSettings(qkl_coef=0.5, query_weight="static")
    outputs, grads = verl_engine.loss_and_grads(engine, data, erpo_loss_fn(config, settings, reference))
    out, expected = erpo_reference_loss(tiny, data, config, reference, settings)
    assert out.metrics["qkl"] > 1e-2
    assert sum(outputs["loss"]) == pytest.approx(out.loss.item(), rel=1e-5)
    for name, grad in expected.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_query_kl_is_alpha_times_the_mean_over_the_mini_batch(tiny, mode):
    """Whatever verl's loss_agg_mode does to the response terms (seq-mean-token-sum-norm divides them by a horizon),
    the Query-KL adds alpha * mean_s k3(r_s) over the mini-batch's samples: with r = 0.7 on every prompt, the loss
    summed over the micro-batches grows by alpha * k3(0.7) against qkl_coef = 0."""
    engine = engine_for(tiny, use_remove_padding=True)
    config = actor_config(loss_agg_mode=mode, loss_scale_factor=32 if mode == "seq-mean-token-sum-norm" else None)
    data = batch(tiny, engine, nested=False)
    reference = reference_of(tiny, data, offset=0.7)
    losses = [sum(verl_engine.loss_and_grads(engine, data, erpo_loss_fn(
        config, ERPOSettings(qkl_coef=alpha, query_weight="none"), reference))[0]["loss"]) for alpha in (0.0, 0.3)]
    assert losses[1] - losses[0] == pytest.approx(0.3 * (math.exp(0.7) - 0.7 - 1), rel=1e-4)


def test_query_kl_is_zero_at_theta0(tiny):
    """ell_theta0 = ell_theta (w = 1): the Query-KL is 0 (fp32 rounding) and the gradient is verl's."""
    engine = engine_for(tiny, use_remove_padding=True)
    config = actor_config()
    data = batch(tiny, engine, nested=False)
    reference = reference_of(tiny, data, offset=0.0)
    reference.entries = {key: (ell, 1.0) for key, (ell, _) in reference.entries.items()}
    ours = verl_engine.loss_and_grads(engine, data, erpo_loss_fn(config, ERPOSettings(qkl_coef=0.5), reference))
    assert max(abs(v) for v in metric_values(ours[0])["actor/qkl"]) < 1e-10
    assert_same(ours, verl_engine.loss_and_grads(engine, data, partial(ppo_loss, config=config)), rel=1e-5)


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_scored_cache_is_the_losss_ell_theta_at_theta0(tiny, tmp_path, param_dtype, temperature,
                                                              use_remove_padding):
    """ell_theta0(q) scored by the actor's engine (verl's compute_log_prob on each prompt alone) equals, prompt by
    prompt, the ell_theta(q) that erpo_ppo_loss sums from the prompt rows of prompt + response on the same engine at
    theta0 (micro-batches of one sample: `actor/query_logp` is that sample's), for prompts of 5 to 61 tokens
    left-padded in the actor's batch, in verl's fp32 and bf16 mixed precision (its CPU cross entropy, which rounds
    each log-prob to bf16, included), at T = 1 and 0.7, with remove-padding (packed) or padded forwards: the
    Query-KL at theta0 is 0. The cache records the engine's precision. (The HF model in the driver scored on the CPU
    gave 8.6e-6 in bf16 at T = 1 before 2026-11-27.)"""
    _, tokenizer, model = tiny
    engine = engine_for(tiny, param_dtype=param_dtype, micro_batch_size=1, use_remove_padding=use_remove_padding)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in (37, 5, 61, 12)]
    data = verl_engine.set_engine_keys(engine, verl_engine.actor_batch(model, prompts, [[5, 6, 7], [8, 9], [4], [3, 5]],
                                                                       pad_id=tokenizer.pad_token_id),
                                       calculate_entropy=False)
    assert data["attention_mask"][1, :56].sum() == 0 and data["attention_mask"][1, 56:61].all()   # left padding
    from verl.utils import tensordict_utils as tu
    tu.assign_non_tensor(data, temperature=temperature)
    # scored by an engine of the same weights and precision in micro-batches of 2 prompts, over 2 ranks
    scorer = engine_for(tiny, param_dtype=param_dtype, micro_batch_size=2, use_remove_padding=use_remove_padding)
    reference, group = engine_reference(tiny, scorer, prompts, tmp_path / "cache.json", temperature=temperature,
                                        world_size=2)
    assert group.calls == [4]
    config = actor_config(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, use_kl_loss=False,
                          entropy_coeff=0.0)
    loss_fn = erpo_loss_fn(config, ERPOSettings(qkl_coef=1.0, query_weight="none"), reference)
    metrics = metric_values(verl_engine.loss_and_grads(engine, data, loss_fn)[0])
    ell0 = reference.lookup(prompts)[0]
    assert bool((ell0 < -4).all()) and metrics["actor/query_logp"] == ell0.tolist()
    assert metrics["actor/qkl"] == [0.0] * 4
    cache = ReferenceCache.load(tmp_path / "cache.json")
    dtype = "bfloat16" if param_dtype == "bf16" else "float32"
    assert cache.precision.startswith(f"dtype={dtype},autocast={dtype if param_dtype == 'bf16' else 'off'},"
                                      "path=verl-engine,device=cpu")


def test_prompt_calls_bound_the_tokens_and_fill_every_part():
    """Longest first; a call holds at most tokens_per_call tokens counting each prompt at the call's longest (a
    longer prompt goes alone), padded with copies of its shortest to a multiple of `multiple`, dealt round-robin."""
    lengths = [5, 40, 12, 12, 7, 30, 3]
    assert prompt_calls(lengths, multiple=2, tokens_per_call=60) == [[1, 1], [5, 2], [3, 0, 4, 6]]
    assert prompt_calls(lengths, multiple=1, tokens_per_call=10**6) == [[1, 5, 2, 3, 4, 0, 6]]
    assert prompt_calls([], multiple=4, tokens_per_call=8) == []
    with pytest.raises(ValueError, match="multiple and tokens_per_call must be >= 1, got 0 and 8"):
        prompt_calls(lengths, multiple=0, tokens_per_call=8)


def test_engine_scoring_over_calls_and_ranks_is_the_prompts_log_likelihood(tiny):
    """engine_query_logp sums each prompt's rows 1 .. P - 1 (a one-token prompt: 0): an independent HF forward's
    ell(q), and bit for bit the same in one call on one rank as in calls of at most 40 tokens over 2 ranks with
    micro-batches of 2 (padding copies to multiples of 4)."""
    _, tokenizer, model = tiny
    engine = engine_for(tiny, use_remove_padding=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in (9, 1, 17, 6, 3)]
    whole = verl_engine.EngineWorkerGroup(engine, world_size=1)
    one = engine_query_logp(whole, prompts, temperature=1.0, multiple=2, tokens_per_call=10**6)
    split = verl_engine.EngineWorkerGroup(engine, world_size=2)
    assert engine_query_logp(split, prompts, temperature=1.0, multiple=4, tokens_per_call=40) == one
    assert whole.calls == [6] and split.calls == [4, 4]     # 17 tokens alone (x 4 > 40), then 9, 6, 3 and 1
    for ids, ell in zip(prompts, one):
        ids = torch.tensor([ids])
        expected = verl_engine.hf_token_logp(model, ids, torch.ones_like(ids))[0, :-1].double().sum().item()
        assert ell == pytest.approx(expected, rel=1e-5, abs=0)
    assert one[1] == 0.0


def test_engine_scoring_matches_each_result_to_its_prompt_under_dynamic_batch_size(tiny):
    """verl's dynamic batch size regroups each rank's sequences into micro-batches by their tokens and puts the
    outputs back in the order sent (`restore_dynamic_batch`); engine_query_logp reads each result by position, which
    its length check cannot verify among prompts of one length. Prompts of equal lengths and other tokens keep their
    own ell(q): each is the value the prompt gets scored alone."""
    _, tokenizer, _ = tiny
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in (5, 9, 5, 12, 5, 9, 3, 5)]
    alone = verl_engine.EngineWorkerGroup(engine_for(tiny, use_remove_padding=True))
    expected = [engine_query_logp(alone, [p], temperature=1.0, multiple=2, tokens_per_call=10**6)[0] for p in prompts]
    dynamic = verl_engine.EngineWorkerGroup(engine_for(tiny, use_remove_padding=True, use_dynamic_bsz=True,
                                                       max_token_len=16), world_size=2)
    assert engine_query_logp(dynamic, prompts, temperature=1.0, multiple=2, tokens_per_call=10**6) == \
        pytest.approx(expected, rel=1e-5, abs=0)
    assert len(set(expected)) == len(prompts)   # no two alike: a result read for another prompt would show


def test_query_kl_at_theta0_at_the_rollout_temperature(tiny, tmp_path):
    """verl's engine scores logits / rollout temperature (0.7 here), and so does the cache it builds at it: the
    Query-KL at theta0 is 0; a cache at T = 1 is far off."""
    from verl.utils import tensordict_utils as tu
    engine = engine_for(tiny, use_remove_padding=True)
    data = batch(tiny, engine, nested=False)
    tu.assign_non_tensor(data, temperature=0.7)
    config = actor_config(use_kl_loss=False, entropy_coeff=0.0)
    qkl = {}
    for temperature in (0.7, 1.0):
        reference, _ = engine_reference(tiny, engine, prompt_ids_of(data), tmp_path / f"{temperature}.json",
                                        temperature=temperature)
        loss_fn = erpo_loss_fn(config, ERPOSettings(qkl_coef=1.0, query_weight="none"), reference)
        qkl[temperature] = max(metric_values(verl_engine.loss_and_grads(engine, data, loss_fn)[0])["actor/qkl"])
    assert qkl[0.7] == 0 and qkl[1.0] > 1e-2


def test_train_batch_step_moves_theta_and_the_query_kl(tiny, tmp_path):
    """verl's own train_batch (zero_grad, forward/backward over micro-batches, optimizer step) with the ERPO loss
    and a cache the engine built at start: theta moves, the Query-KL becomes > 0."""
    engine = verl_engine.build_engine(tiny[0], lr=1e-2)
    config = actor_config(use_kl_loss=False, entropy_coeff=0.0)
    data = batch(tiny, engine, entropy=False)
    reference, _ = engine_reference(tiny, engine, prompt_ids_of(batch(tiny, engine, nested=False)),
                                    tmp_path / "cache.json")
    loss_fn = erpo_loss_fn(config, ERPOSettings(qkl_coef=0.5), reference)
    before = {n: p.full_tensor().clone() for n, p in engine.module.named_parameters()}
    with engine.train_mode():
        first = engine.train_batch(data.clone(), loss_fn)
        second = engine.train_batch(data.clone(), loss_fn)
    moved = [n for n, p in engine.module.named_parameters() if not torch.equal(p.full_tensor(), before[n])]
    assert len(moved) == len(before)
    assert max(abs(v) for v in metric_values(first)["actor/qkl"]) == 0          # theta0
    assert min(metric_values(second)["actor/qkl"]) > 1e-6
    assert math.isfinite(second["metrics"]["grad_norm"])


def test_missing_prompt_is_a_clear_error(tiny):
    engine = engine_for(tiny, use_remove_padding=True)
    data = batch(tiny, engine, nested=False)
    reference = reference_of(tiny, data)
    reference.entries.pop(prompt_hash(prompt_ids_of(data)[1]))
    with pytest.raises(ValueError, match="prompt '22\\+3=' has no ell_theta0\\(q\\) in the reference cache"):
        verl_engine.loss_and_grads(engine, data, erpo_loss_fn(actor_config(), ERPOSettings(), reference))


def unexpected_scoring(prompts):
    raise AssertionError("the cache was scored again instead of read")


def test_a_prompt_missing_at_a_step_is_not_blamed_on_the_cache(tiny, tmp_path):
    """At start, a cache that lacks a training prompt says the data or its tokenization changed since it was built,
    and to rebuild it. At a training step every training prompt was there, so a prompt missing then was built
    otherwise by verl (here a shorter left-truncation than the scoring's), which a rebuild would not add: the one
    line names the prompt, how erpo tokenized the training set, and what works in verl instead."""
    path, tokenizer, _ = tiny
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    cache = str(tmp_path / "cache.json")
    read = partial(load_or_build_reference, path=cache, temperature=1.0, precision="fp32",
                   score=lambda ids: [-1.5 * len(p) for p in ids], trainer="verl", remedy=REBUILD,
                   step_miss=STEP_MISS)
    reference = read(path, tokenizer, prompts)
    truncated = prompts[1][-3:]
    with pytest.raises(ValueError) as missed:
        reference.lookup([prompts[0], truncated])
    assert str(missed.value) == (f"prompt {tokenizer.decode(truncated)!r} has no ell_theta0(q) in the reference "
                                 f"cache {cache} (1 of 2 prompts missing) {STEP_MISS}")
    assert "+erpo.query_weight=none" in STEP_MISS and "changed since" not in str(missed.value)
    with pytest.raises(ValueError) as refused:
        read(path, tokenizer, prompts + [tokenizer("5+5=")["input_ids"]])
    assert str(refused.value).endswith(f"(1 of 5 prompts missing) {CHANGED} {REBUILD}")


def test_cache_of_another_model_tokenizer_temperature_or_precision_is_refused(tiny, tmp_path):
    """A cache is read only under the weights, tokenizer, temperature and precision it was built with, and only for
    prompts it holds; otherwise one line names what differs."""
    path, tokenizer, _ = tiny
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    cache = str(tmp_path / "cache.json")
    engine = engine_for(tiny, use_remove_padding=True)
    reference, _ = engine_reference(tiny, engine, prompts, cache)
    assert reference.lookup(prompts)[0].lt(0).all()
    fp32 = engine_precision(engine.model_config, FP32, "cpu")
    read = partial(load_or_build_reference, path=cache, temperature=1.0, precision=fp32, score=unexpected_scoring,
                   trainer="verl", remedy=REBUILD)
    assert read(path, tokenizer, prompts).entries == reference.entries
    other = tmp_path / "other"
    tiny_test_model(tokenizer, seed=1).save_pretrained(other)
    with pytest.raises(ValueError, match="does not match this run: model"):
        read(str(other), tokenizer, prompts)
    changed = build_tokenizer()
    changed.chat_template = "{{ messages }}"
    with pytest.raises(ValueError, match="does not match this run: tokenizer"):
        read(path, changed, prompts)
    with pytest.raises(ValueError, match="temperature"):
        read(path, tokenizer, prompts, temperature=0.7)
    bf16 = engine_precision(engine.model_config, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"^\S+cache.json does not match this run: precision: cache built with "
                                         r"dtype=float32,autocast=off,path=verl-engine,device=cpu,[^;]*, training "
                                         r"scores with dtype=bfloat16,autocast=bfloat16,path=verl-engine,device=cpu,"
                                         r"[^;]*\. Delete it to rebuild it, or set \+erpo.ref_cache=\.\.\. to another "
                                         r"path\.$"):
        read(path, tokenizer, prompts, precision=bf16)
    with pytest.raises(ValueError, match="has no ell_theta0"):
        read(path, tokenizer, prompts + [tokenizer("5+5=")["input_ids"]])


@pytest.mark.parametrize("setting, recorded", [
    (dict(attn_implementation="eager"), r"attention=sdpa,remove_padding=true,liger=false,fused_kernels=off, training "
                                        r"scores with [^;]*,attention=eager,remove_padding=true,liger=false,"
                                        r"fused_kernels=off"),
    (dict(use_remove_padding=False), r"attention=sdpa,remove_padding=true,liger=false,fused_kernels=off, training "
                                     r"scores with [^;]*,attention=sdpa,remove_padding=false,liger=false,"
                                     r"fused_kernels=off")],
    ids=["attention", "remove_padding"])
def test_cache_of_another_attention_kernel_or_padding_is_refused(tiny, tmp_path, setting, recorded):
    """The actor's forward also depends on its attention kernel (verl's
    `actor_rollout_ref.model.override_config.attn_implementation`) and on `use_remove_padding` (packed or padded):
    a cache scored under one is refused by an actor under another, in one line naming both, where it was read before.
    (On this CPU the tiny model's ell_theta0(q) came out the same under eager and sdpa, packed and padded, on
    2026-11-27; flash-attn, on a GPU, is another kernel.)"""
    tokenizer = tiny[1]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    cache = tmp_path / "cache.json"
    engine_reference(tiny, engine_for(tiny, use_remove_padding=True), prompts, cache)
    other = engine_for(tiny, **{"use_remove_padding": True, **setting})
    with pytest.raises(ValueError, match=r"^\S+cache.json does not match this run: precision: cache built with "
                                         r"dtype=float32,[^;]*," + recorded + r"\. Delete it"):
        engine_reference(tiny, other, prompts, cache)


def model_config_with(tiny, tmp_path, *settings):
    """verl's HFModelConfig of the run's `actor_rollout_ref.model` with `settings` (dotlist items) merged in."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    config = OmegaConf.merge(run_config(tiny, tmp_path), OmegaConf.from_dotlist(list(settings)))
    return omega_conf_to_dataclass(config.actor_rollout_ref.model)


def test_the_precision_records_the_attention_kernel_verl_resolves_and_liger(tiny, tmp_path):
    """The record holds what verl 0.9.1's model config resolves and its FSDP engine builds the actor with: flash-attn 2
    where `override_config.attn_implementation` is unset, the setting where set; `use_remove_padding`, `use_liger`
    (Liger's RMSNorm, rotary and SwiGLU kernels in the actor) as set, and the fused log-prob kernels' backend (off, or
    `fused_kernel_options.impl_backend`, torch in verl's config)."""
    def recorded(*settings):
        return engine_precision(model_config_with(tiny, tmp_path, *settings), FP32, "cpu").split(",")[-4:]
    assert recorded() == ["attention=flash_attention_2", "remove_padding=true", "liger=false", "fused_kernels=off"]
    assert recorded("actor_rollout_ref.model.override_config.attn_implementation=eager",
                    "actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.model.use_liger=true",
                    "actor_rollout_ref.model.use_fused_kernels=true") == [
        "attention=eager", "remove_padding=false", "liger=true", "fused_kernels=torch"]
    assert recorded("actor_rollout_ref.model.use_fused_kernels=true",
                    "actor_rollout_ref.model.fused_kernel_options.impl_backend=liger")[-1] == "fused_kernels=liger"
    # verl's triton backend, untested (it runs on CUDA alone), is refused wherever the cache is scored or read: the
    # `erpo` mode and a `set_loss_fn` user's own load_or_build_reference both take their precision from here
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.fused_kernel_options.impl_backend=triton with "
                                         r"use_fused_kernels=true: ERPO's ell_theta0\(q\) is tested with verl's torch"):
        recorded("actor_rollout_ref.model.use_fused_kernels=true",
                 "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton")


def test_a_cache_scored_without_liger_is_refused_by_an_actor_with_it(tiny, tmp_path):
    """`use_liger` swaps the actor's RMSNorm, rotary embedding and SwiGLU for Liger's kernels: a cache the actor scored
    without them is refused by one with them, in one line naming both (read before)."""
    path, tokenizer, _ = tiny
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    cache = str(tmp_path / "cache.json")
    engine_reference(tiny, engine_for(tiny, use_remove_padding=True), prompts, cache)
    liger = engine_precision(model_config_with(tiny, tmp_path, "actor_rollout_ref.model.override_config."
                                               "attn_implementation=sdpa", "actor_rollout_ref.model.use_liger=true"),
                             FP32, "cpu")
    assert liger == engine_precision(engine_for(tiny, use_remove_padding=True).model_config, FP32, "cpu").replace(
        "liger=false", "liger=true")   # all but Liger as the cache's
    with pytest.raises(ValueError, match=r"precision: cache built with [^;]*,liger=false,fused_kernels=off, training "
                                         r"scores with [^;]*,liger=true,fused_kernels=off\. Delete it"):
        load_or_build_reference(path, tokenizer, prompts, path=cache, temperature=1.0, precision=liger,
                                score=unexpected_scoring, trainer="verl", remedy=REBUILD)


@pytest.mark.parametrize("setting, message", [
    (dict(policy_loss={"loss_mode": "gspo"}), "loss_mode='gspo'"), (dict(kl_loss_type="mse"), "kl_loss_type='mse'")])
def test_unsupported_actor_settings_are_refused(setting, message):
    with pytest.raises(ValueError, match=message):
        check_actor_config(actor_config(**setting))


def test_per_token_advantages_are_refused(tiny):
    engine = engine_for(tiny, use_remove_padding=True)
    data = batch(tiny, engine, nested=False)
    data["advantages"] = data["advantages"] + torch.linspace(0, 1, data["advantages"].shape[1])
    with pytest.raises(ValueError, match="one advantage per sample"):
        verl_engine.loss_and_grads(engine, data, erpo_loss_fn(actor_config(), OFF, None))


def test_loss_inputs_are_checked_as_erpo_loss_checks_them(tiny):
    """The verl loss goes through the kernels' own input checks (check_loss_inputs): a negative rollout
    importance-sampling weight is the same one-line error as erpo_loss gives."""
    engine = engine_for(tiny, use_remove_padding=True)
    data = batch(tiny, engine, nested=False)
    data["rollout_is_weights"] = -data["rollout_is_weights"]
    with pytest.raises(ValueError, match="token_weight must be finite and >= 0 on scored rows"):
        verl_engine.loss_and_grads(engine, data, erpo_loss_fn(actor_config(), OFF, None))


@pytest.mark.parametrize("nested", [True, False], ids=["jagged", "padded-fields"])
@pytest.mark.parametrize("with_reference", [False, True], ids=["no-reference", "reference"])
def test_host_reads_per_micro_batch(tiny, nested, with_reference):
    """erpo_ppo_loss reads the host 3 times a micro-batch, counted by LaunchCounter on the CPU (the engine's device)
    around the loss function on verl's engine (not the forward before it, nor the backward after it): the rows' one
    read (lengths, prompt tokens and the advantages' check in one copy), the kernels' value checks (validate=True)
    and the metrics' one read; the looked-up ell_theta0(q) and w(q) are uploaded from pinned memory without a wait.
    Before 2026-11-26: 29 reads on jagged fields, 27 on padded ones, and 2 blocking uploads with the reference
    (three reads per sample and up to three more in each of verl's no_padding_2_padding, three in its policy-loss
    metrics, one per Metric)."""
    engine = engine_for(tiny, use_remove_padding=True)
    config = actor_config()
    data = batch(tiny, engine, nested=nested)
    settings, reference = (ERPOSettings(qkl_coef=0.5), reference_of(tiny, batch(tiny, engine, nested=False))) \
        if with_reference else (OFF, None)
    loss_fn, counts = erpo_loss_fn(config, settings, reference), []

    def counted(*args, **kwargs):
        with LaunchCounter(device="cpu") as counter:
            out = loss_fn(*args, **kwargs)
        counts.append(dict(counter.sync_names))
        return out

    verl_engine.loss_and_grads(engine, data, counted)
    assert counts == [{"Tensor.tolist": 2, "aten._local_scalar_dense": 1}] * 2, counts   # two micro-batches


def test_actor_rows_read_padded_fields_and_refuse_a_mismatch():
    """actor_rows on left-padded prompts: the prompts' real tokens, rows of each kind where verl's layout puts them,
    `gather` = verl's no_padding_2_padding; a row count other than the fields' and an empty prompt are refused."""
    from verl.workers.utils.padding import no_padding_2_padding
    prompts, responses = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[3, 4, 2], [5, 0, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    data = tensordict.TensorDict(prompts=prompts, responses=responses, attention_mask=attention, batch_size=[2])
    response_mask = torch.tensor([[1, 0, 1], [1, 0, 0]])   # a tool output at the first sample's second token
    rows = actor_rows(data, response_mask, 9)
    assert rows.prompt_ids == [[5, 6], [7, 8, 9]]
    assert rows.token_kind.tolist() == [1, 2, 0, 2, 0, 1, 1, 2, 0]
    values = torch.arange(9.0)
    assert torch.equal(rows.gather(values, 3), no_padding_2_padding(values, data))
    with pytest.raises(ValueError, match=r"^the engine's log-probs hold 10 rows, the micro-batch's prompts \+ "
                                         r"responses 9 tokens$"):
        actor_rows(data, response_mask, 10)
    data["attention_mask"] = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="a sample has an empty prompt; ERPO needs at least one prompt token"):
        actor_rows(data, response_mask, 7)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="erpo.query_weight"):
        ERPOSettings(query_weight="current")
    with pytest.raises(ValueError, match="erpo.qkl_estimator"):
        ERPOSettings(qkl_estimator="k3-token")


def run_config(tiny, tmp_path, **erpo):
    """verl's full default PPO config (its generated yaml) for the tiny model, ERPO's options under `erpo`."""
    from omegaconf import OmegaConf
    config = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
    config.actor_rollout_ref.model.path = tiny[0]
    config.actor_rollout_ref.actor.strategy = "fsdp2"
    config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    config.algorithm.adv_estimator = "grpo"
    config.trainer.default_local_dir = str(tmp_path / "ckpt")
    config.trainer.v1.trainer_mode = "erpo"
    config.erpo = erpo
    return config


def test_a_cache_of_more_prompts_gives_the_training_sets_weights(tiny, tmp_path):
    """A cache built for four prompts serves a training set of two of them with appendix C's weights over those
    two, not the stored ones (relative to the four)."""
    tokenizer = tiny[1]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    cache = str(tmp_path / "cache.json")
    engine = engine_for(tiny, use_remove_padding=True)
    everyone, _ = engine_reference(tiny, engine, prompts, cache)
    subset, group = engine_reference(tiny, engine, prompts[1:3], cache)
    assert group.calls == []                                       # read, not scored
    ell, weights = subset.lookup(prompts[1:3])
    torch.testing.assert_close(weights, query_weights(ell.double()))
    assert (weights - everyone.lookup(prompts[1:3])[1]).abs().max() > 0.01


def test_trainer_mode_scores_the_cache_on_the_actors_engine_and_sets_the_loss(tiny, tmp_path, monkeypatch, caplog):
    """`trainer.v1.trainer_mode=erpo` is registered with verl. After verl's own setup (here a stand-in for its Ray /
    TransferQueue setup whose actor worker group runs verl's compute_log_prob on an engine in this process over 2
    ranks, `EngineWorkerGroup`), the trainer has the actor's engine score ell_theta0(q) of the training prompts
    (tokenized as verl's agent loop does), in the actor's precision (verl's default bf16), with no HF model loaded
    in the driver; writes the cache; and sets the ERPO loss on the actor. A second start reads the cache without
    scoring; a start whose actor runs in fp32, or padded (`use_remove_padding=false`), refuses it in one line; a
    resumed run without its cache is refused.
    The driver's log shows the scoring and its progress (INFO, where `import verl` leaves the root logger at
    WARNING)."""
    pytest.importorskip("transfer_queue", exc_type=ModuleNotFoundError)
    import logging

    import transformers
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from erpo.integrations.verl import erpo_ppo_loss
    from erpo.integrations.verl_trainer import ERPOTrainer
    assert get_trainer_cls("erpo") is ERPOTrainer
    engine = engine_for(tiny, param_dtype="bf16")

    def refuse_loading(*args, **kwargs):
        raise AssertionError("a model was loaded in verl's driver")

    for loader in (transformers.AutoModelForCausalLM, transformers.PreTrainedModel):
        monkeypatch.setattr(loader, "from_pretrained", refuse_loading)

    def start(*settings, resumed_at=0, ref_cache=None, prompts=PROMPTS):
        def verl_setup(self):   # what PPOTrainer._setup leaves behind that the ERPO trainer reads
            self.tokenizer, self.processor = tiny[1], None
            self.train_dataset = [{"raw_prompt": [{"role": "user", "content": p}]} for p in prompts]
            self.actor_rollout_wg = verl_engine.EngineWorkerGroup(engine, world_size=2)
            self.global_steps = resumed_at      # _load_checkpoint's: the step of the checkpoint the actor loaded

        monkeypatch.setattr(PPOTrainerSync, "_setup", verl_setup)
        trainer = object.__new__(ERPOTrainer)
        trainer.config = OmegaConf.merge(run_config(tiny, tmp_path, qkl_coef=0.02), OmegaConf.from_dotlist([
            "trainer.device=cpu", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.model.override_config.attn_implementation=sdpa", *settings]))   # the engine's
        trainer.erpo_settings = ERPOSettings(qkl_coef=0.02, ref_cache=ref_cache)
        trainer._setup()
        return trainer.actor_rollout_wg

    caplog.set_level(logging.WARNING)                   # the root logger as `import verl` leaves it
    caplog.set_level(logging.NOTSET, logger="erpo")     # and erpo's unset (caplog's handler then takes every record)
    monkeypatch.setenv("ERPO_PROGRESS_SECONDS", "0")    # a progress line at every call
    group = start()
    assert group.calls == [4]               # the 4 prompts in one call: 2 ranks x micro-batches of 2
    prompts = [tiny[1].apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True)["input_ids"] for p in PROMPTS]
    lines = [record.getMessage() for record in caplog.records if record.name == "erpo"]
    assert lines[0] == (f"reference cache: scoring ell_theta0(q) of 4 prompts ({sum(map(len, prompts))} tokens) on "
                        "the actor's engine, in 1 compute_log_prob calls")
    assert lines[1].startswith("reference cache ell_theta0(q) on the actor's engine: 4/4 prompt (100%), 0:00 elapsed")
    (loss_fn,) = group.loss_fns
    assert loss_fn.func is erpo_ppo_loss and loss_fn.keywords["settings"].qkl_coef == 0.02
    assert loss_fn.keywords["config"].loss_agg_mode == run_config(tiny, tmp_path).actor_rollout_ref.actor.loss_agg_mode
    ell, weight = loss_fn.keywords["reference"].lookup(prompts)
    with pytest.raises(ValueError, match=r"\(1 of 1 prompts missing\) \(it held every training prompt at start, as "
                                         r"verl's single-turn agent loop builds them"):
        loss_fn.keywords["reference"].lookup([prompts[0][-3:]])   # verl truncated it otherwise: no rebuild adds it
    expected, _ = engine_reference(tiny, engine, prompts, tmp_path / "direct.json")
    assert ell.tolist() == expected.lookup(prompts)[0].tolist()
    assert bool((ell < 0).all()) and weight.mean().item() == pytest.approx(1.0, abs=0.3)
    cache = ReferenceCache.load(tmp_path / "ckpt" / "erpo_reference_cache.json")
    assert cache.precision.startswith("dtype=bfloat16,autocast=bfloat16,path=verl-engine,device=cpu")
    assert cache.precision.endswith(",attention=sdpa,remove_padding=true,liger=false,fused_kernels=off")

    again = start()
    assert again.calls == [] and again.loss_fns[0].keywords["reference"].entries == \
        loss_fn.keywords["reference"].entries
    with pytest.raises(ValueError, match=r"^\S+erpo_reference_cache.json does not match this run: precision: cache "
                                         r"built with dtype=bfloat16,.* training scores with dtype=float32,"
                                         r"autocast=off,path=verl-engine,device=cpu,[^\n]*$"):
        start("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32")
    with pytest.raises(ValueError, match=r"does not match this run: precision: cache built with [^;]*,attention=sdpa,"
                                         r"remove_padding=true,liger=false,fused_kernels=off, training scores with "
                                         r"[^;]*,attention=sdpa,remove_padding=false,liger=false,fused_kernels=off\. "
                                         r"Delete it"):
        start("actor_rollout_ref.model.use_remove_padding=false")
    with pytest.raises(ValueError, match=r"^no reference cache at \S+elsewhere.json, and the run resumes at step 3: "
                                         r"ell_theta0\(q\) is scored with the initial weights, which the actor no "
                                         r"longer holds; put the cache of the run's start there \(or set "
                                         r"\+erpo.ref_cache=\.\.\. to its path\), or start afresh$"):
        start(ref_cache=str(tmp_path / "elsewhere.json"), resumed_at=3)
    assert not (tmp_path / "elsewhere.json").exists()
    resumed_group = start(resumed_at=3)   # with its cache, a resumed run reads it and scores nothing
    assert resumed_group.calls == [] and resumed_group.loss_fns[0].keywords["reference"].entries == \
        loss_fn.keywords["reference"].entries
    # A resumed run cannot rebuild a cache it refuses (its actor holds a checkpoint's weights): the message does not
    # send it to delete the cache, which the line above would then refuse, but to the settings that built it.
    resumed = r"The run resumes at step 3, whose actor no longer holds the initial weights: rebuilding the cache "
    with pytest.raises(ValueError, match=r"does not match this run: precision: .*\. " + resumed):
        start("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32", resumed_at=3)
    with pytest.raises(ValueError, match=r"has no ell_theta0\(q\) .*\. " + resumed):
        start(resumed_at=3, prompts=[*PROMPTS, "5+5="])


def test_an_actor_with_dropout_is_refused_with_the_query_kl(tiny):
    """verl trains the actor in train mode with its config's dropout (an OPT's 0.1, an attention_dropout), which
    would make ell_theta(q) noisy against the cache's, scored without it. Checked on the meta device, no weights."""
    pytest.importorskip("transfer_queue", exc_type=ModuleNotFoundError)
    import transformers

    from erpo.integrations.verl_trainer import check_actor_dropout
    config = transformers.AutoConfig.from_pretrained(tiny[0], attn_implementation="sdpa")
    check_actor_dropout(config)          # the tiny Qwen2: none; its config is left as it was
    assert config._attn_implementation == "sdpa"
    config.attention_dropout = 0.2
    with pytest.raises(ValueError, match=r"Qwen2Config trains with dropout \(attention_dropout=0.2\).*override_config"):
        check_actor_dropout(config)
    opt = transformers.OPTConfig(vocab_size=64, hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                 ffn_dim=64, word_embed_proj_dim=32)
    with pytest.raises(ValueError, match=r"OPTConfig trains with dropout \(dropout=0.1\)"):
        check_actor_dropout(opt)


@pytest.mark.parametrize("setting, message", [
    ("algorithm.adv_estimator=gae", "adv_estimator=gae"),
    ("actor_rollout_ref.actor.strategy=megatron", "strategy='megatron'"),
    ("actor_rollout_ref.rollout.multi_turn.enable=true", "multi_turn.enable=true"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "loss_mode='gspo'"),
    ("actor_rollout_ref.model.use_fused_kernels=true actor_rollout_ref.model.fused_kernel_options.impl_backend=triton",
     r"^actor_rollout_ref.model.fused_kernel_options.impl_backend=triton with use_fused_kernels=true: .*triton one "
     r"runs on CUDA alone\); set impl_backend=torch, use_fused_kernels=false, or \+erpo.qkl_coef=0$")])
def test_run_settings_verl_cannot_combine_with_erpo_are_refused(tiny, tmp_path, setting, message):
    pytest.importorskip("transfer_queue", exc_type=ModuleNotFoundError)
    from omegaconf import OmegaConf

    from erpo.integrations.verl_trainer import check_run_config
    config = run_config(tiny, tmp_path)
    check_run_config(config, ERPOSettings())
    config = OmegaConf.merge(config, OmegaConf.from_dotlist(setting.split()))
    with pytest.raises(ValueError, match=message):
        check_run_config(config, ERPOSettings())


def test_precompute_ref_cache_is_refused_by_its_precision(tiny, tmp_path):
    """A cache of `erpo precompute-ref` (data.template=plain, one user turn through the chat template) for the same
    model directory holds verl's prompts, tokenized as verl's agent loop does with the tokenizer verl loads from
    that directory, but was scored by erpo's own forward, not by the actor's engine: refused, naming the precision
    (the Query-KL at theta0 would be the gap between the two forwards)."""
    import json

    from erpo.config import Config, apply_overrides, resolve
    from erpo.models.loading import load_tokenizer
    from erpo.reference.setup import precompute_reference
    pytest.importorskip("transfer_queue", exc_type=ModuleNotFoundError)
    from erpo.integrations.verl_trainer import training_prompt_ids

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"problem": p, "answer": "0"}) + "\n" for p in PROMPTS))
    cfg = resolve(apply_overrides(Config(), [
        f"output_dir={tmp_path / 'pre'}", f"model.name_or_path={tiny[0]}", f"data.source={source}",
        "data.template=plain", "data.use_chat_template=true", "rollout.temperature=1.0"]))
    path = precompute_reference(cfg)[1]
    tokenizer = load_tokenizer(tiny[0])
    prompts = training_prompt_ids([{"raw_prompt": [{"role": "user", "content": p}]} for p in PROMPTS], tokenizer,
                                  hf_model_type="qwen2", chat_template_kwargs={}, prompt_length=1024)
    assert set(map(prompt_hash, prompts)) <= set(ReferenceCache.load(path).entries)
    with pytest.raises(ValueError, match=r"does not match this run: precision: cache built with dtype=float32,"
                                         r"autocast=off,path=fused-linear,.* training scores with dtype=float32,"
                                         r"autocast=off,path=verl-engine,"):
        load_or_build_reference(tiny[0], tokenizer, prompts, path=path, temperature=1.0,
                                precision=engine_precision(engine_for(tiny, use_remove_padding=True).model_config, FP32,
                                                           "cpu"),
                                score=unexpected_scoring, trainer="verl", remedy=REBUILD)
