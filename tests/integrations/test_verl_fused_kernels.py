"""ERPO on verl's fused log-prob kernels (`actor_rollout_ref.model.use_fused_kernels=true`), on verl's real FSDP
engine (bench/verl_engine.py): its torch backend (verl's default `fused_kernel_options.impl_backend`) and its liger
backend give the prompt rows' and the response rows' log-probs and entropy of the logits path, and the ERPO loss's
gradients through them, far from theta0, in fp32 and in verl's bf16 mixed precision; a cache they scored is the
loss's ell_theta(q) at theta0; the cache records the backend, so one scored the other way is refused. What stays
refused is refused for a reason a test here shows: the Triton backend runs on CUDA alone, and verl's fused forward
drops the final-logit transform of Gemma-2 and Granite."""
import os

import pytest
import torch

# verl (and tensordict) through bench.verl_engine: it sets verl's CPU platform before verl is imported
verl_engine = pytest.importorskip("bench.verl_engine", exc_type=ModuleNotFoundError)

from transformers import AutoModelForCausalLM  # noqa: E402
from verl.models.transformers.dense_common import forward_with_torch_backend  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from erpo.integrations.query_reference import load_or_build_reference  # noqa: E402
from erpo.integrations.verl import (  # noqa: E402
    FUSED_BACKENDS,
    REBUILD,
    ERPOSettings,
    actor_rows,
    check_fused_kernels,
    check_fused_logits,
    erpo_loss_fn,
    fused_kernels_backend,
)
from erpo.integrations.verl_reference import engine_precision  # noqa: E402
from erpo.models.tiny import build_tokenizer, save_model_dir  # noqa: E402
from erpo.reference.cache import ReferenceCache  # noqa: E402
from family_models import tiny_lm  # noqa: E402
from test_verl_integration import (  # noqa: E402
    PROMPTS,
    RESPONSE_LENGTHS,
    actor_config,
    engine_param_dtype,
    engine_reference,
    metric_values,
    prompt_ids_of,
    reference_of,
    run_config,
    unexpected_scoring,
)
from tiny_models import TEST_SIZE  # noqa: E402

# Liger's Triton kernels on the CPU engine's tensors: in Triton's interpreter only (the suite's default on a CPU)
BACKENDS = ("torch", pytest.param("liger", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Liger's Triton kernels on CPU tensors need TRITON_INTERPRET=1")))


@pytest.fixture(scope="module")
def far(tmp_path_factory):
    """(model directory, tokenizer, HF model) of the tests' tiny Qwen2 moved far from its initial weights (every
    weight + 0.05 N(0, 1), lm_head x 4: log-probs down to -13 nats at T = 0.7), the theta of a run in progress."""
    tokenizer = build_tokenizer()
    start = AutoModelForCausalLM.from_pretrained(save_model_dir(tmp_path_factory.mktemp("theta0"), tokenizer, 0,
                                                                **TEST_SIZE))
    torch.manual_seed(1)
    with torch.no_grad():
        for param in start.parameters():
            param.add_(0.05 * torch.randn_like(param))
        start.lm_head.weight.mul_(4.0)
    path = tmp_path_factory.mktemp("far")
    start.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer, start


ENGINES = {}


def engine_of(far, **settings):
    """One engine per model directory (`far[0]`) and setting for the whole file (`fused_kernels`: verl's
    impl_backend; None: the logits path)."""
    key = (str(far[0]), tuple(sorted(settings.items())))
    if key not in ENGINES:
        ENGINES[key] = verl_engine.build_engine(far[0], **settings)
    return ENGINES[key]


def actor_data(far, engine, temperature):
    """The actor's micro-batches of PROMPTS and random responses (a tool output masked), at `temperature`."""
    _, tokenizer, model = far
    g = torch.Generator().manual_seed(0)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    responses = [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in RESPONSE_LENGTHS]
    data = verl_engine.actor_batch(model, prompts, responses, pad_id=tokenizer.pad_token_id)
    tu.assign_non_tensor(data, temperature=temperature)
    return verl_engine.set_engine_keys(engine, data, calculate_entropy=True)


def scored_rows(far, engine, temperature, loss_fn):
    """The engine's log-probs and entropy of the rows that score a token (query and response rows; a sample's last
    row scores what follows it, which the fused path reads otherwise when padded), and every parameter's gradient
    of `loss_fn` (an erpo_loss_fn) over the micro-batches."""
    seen = []

    def probe(model_output, data, dp_group=None):
        log_probs, entropy = model_output["log_probs"].values(), model_output["entropy"].values()
        rows = actor_rows(data, data.select("response_mask").to_padded_tensor()["response_mask"],
                          log_probs.shape[0])
        kept = rows.token_kind != 0
        seen.append((log_probs[kept].detach().float(), entropy[kept].detach().float(), rows.token_kind[kept]))
        return loss_fn(model_output=model_output, data=data, dp_group=dp_group)

    _, grads = verl_engine.loss_and_grads(engine, actor_data(far, engine, temperature), probe)
    log_probs, entropy, kind = (torch.cat(parts) for parts in zip(*seen))
    return log_probs, entropy, kind, grads


# bf16: the fused torch backend divides the bf16 logits by the temperature in bf16 (a Python float), the logits path
# in fp32, and only the logits path rounds the log-prob to bf16 (its CPU cross entropy): the two differ by a few
# roundings of logits of up to ~20 / 0.7 here (2^-8 relative each), not by a token's log-prob (nats)
BF16_LOGP_ATOL = 0.125


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_rows_and_gradients_equal_the_logits_paths(far, backend, param_dtype, use_remove_padding):
    """verl's fused kernels (torch, liger) against its logits path on the same engine settings and weights, far from
    theta0, at T = 0.7, with the Query-KL (ell_theta0 = ell_theta + U(-1.5, 1.5)), static w(q), the KL loss and the
    entropy bonus on: the query rows' and response rows' log-probs and entropy, and every gradient of the ERPO loss.
    fp32: to fp32 rounding (the PPO clip and dual clip biting). bf16: within `BF16_LOGP_ATOL`, and the gradients
    within 10% (norm of the difference against the gradient's) with the clip range opened (ratio bounds 1 +- 100,
    dual clip 1e4): a ratio that the two paths' log-probs put on either side of a clip bound (a bf16 rounding apart)
    drops or keeps that token's whole gradient, far more than rounding, with verl's default clip 0.2."""
    settings = dict(param_dtype=param_dtype, use_remove_padding=use_remove_padding)
    logits, fused = engine_of(far, **settings), engine_of(far, fused_kernels=backend, **settings)
    reference = reference_of(far, actor_data(far, logits, 0.7))
    config = actor_config() if param_dtype == "fp32" else actor_config(
        clip_ratio=100.0, clip_ratio_low=100.0, clip_ratio_high=100.0, clip_ratio_c=1e4)
    loss_fn = erpo_loss_fn(config, ERPOSettings(qkl_coef=0.5, query_weight="static"), reference)
    expected_logp, expected_entropy, kind, expected_grads = scored_rows(far, logits, 0.7, loss_fn)
    assert fused.module.forward.__func__ is forward_with_torch_backend   # verl's fused forward (all three backends')
    assert fused.module._verl_fused_kernels_backend == backend
    logp, entropy, fused_kind, grads = scored_rows(far, fused, 0.7, loss_fn)
    assert torch.equal(kind, fused_kind) and set(kind.tolist()) == {1, 2}
    assert expected_logp.min() < -10 and expected_entropy.max() > 1
    assert expected_grads.keys() == grads.keys() and len(grads) > 5
    if param_dtype == "fp32":
        torch.testing.assert_close(logp, expected_logp, rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(entropy, expected_entropy, rtol=1e-6, atol=2e-6)
        for name, grad in expected_grads.items():
            scale = grad.abs().max().item()
            assert scale > 0, name
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-4 * scale, msg=name)
    else:
        torch.testing.assert_close(logp, expected_logp, rtol=0, atol=BF16_LOGP_ATOL)
        torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=BF16_LOGP_ATOL)
        assert not torch.equal(logp, logp.bfloat16().float())     # fp32 log-probs: not rounded to bf16
        for name, grad in expected_grads.items():
            assert grad.norm() > 0 and (grads[name] - grad).norm() <= 0.1 * grad.norm(), name


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_the_fused_kernels_scored_is_the_losss_ell_theta_at_theta0(far, tmp_path, backend, param_dtype,
                                                                          use_remove_padding):
    """ell_theta0(q) scored through verl's compute_log_prob by a fused-kernel engine (micro-batches of 2, 2 ranks)
    is, prompt by prompt, the ell_theta(q) erpo_ppo_loss sums from the fused engine's prompt rows of prompt +
    response (micro-batches of 1) at the same weights, at T = 0.7: the Query-KL at theta0 is 0 in bf16, and in fp32
    below 1e-10 (ell_theta(q) to 1e-6 relative: the fused kernels' logits GEMM rounds a row otherwise in a pack of
    other rows, where the logits path's came out bit for bit the same). The cache records the backend."""
    settings = dict(param_dtype=param_dtype, use_remove_padding=use_remove_padding, fused_kernels=backend)
    engine = engine_of(far, micro_batch_size=1, **settings)
    data = actor_data(far, engine, 0.7)
    reference, group = engine_reference(far, engine_of(far, micro_batch_size=2, **settings), prompt_ids_of(data),
                                        tmp_path / "cache.json", temperature=0.7, world_size=2)
    assert group.calls == [4]
    config = actor_config(ppo_micro_batch_size_per_gpu=1, use_kl_loss=False, entropy_coeff=0.0)
    loss_fn = erpo_loss_fn(config, ERPOSettings(qkl_coef=1.0, query_weight="none"), reference)
    metrics = metric_values(verl_engine.loss_and_grads(engine, data, loss_fn)[0])
    ell0 = reference.lookup(prompt_ids_of(data))[0]
    assert bool((ell0 < -5).all())
    if param_dtype == "bf16":
        assert metrics["actor/query_logp"] == ell0.tolist() and metrics["actor/qkl"] == [0.0] * 4
    else:
        assert metrics["actor/query_logp"] == pytest.approx(ell0.tolist(), rel=1e-6, abs=0)
        assert max(metrics["actor/qkl"]) < 1e-10
    assert ReferenceCache.load(tmp_path / "cache.json").precision.endswith(f",fused_kernels={backend}")


def test_train_batch_with_fused_kernels_moves_the_query_kl(far, tmp_path):
    """verl's own train_batch on a fused-kernel engine (torch backend) with a cache it scored at start: the Query-KL
    is 0 at theta0, then > 0, and every parameter moves."""
    engine = verl_engine.build_engine(far[0], lr=1e-2, fused_kernels="torch")
    data = actor_data(far, engine, 1.0)
    reference, _ = engine_reference(far, engine, prompt_ids_of(data), tmp_path / "cache.json")
    loss_fn = erpo_loss_fn(actor_config(use_kl_loss=False, entropy_coeff=0.0), ERPOSettings(qkl_coef=0.5), reference)
    before = {n: p.full_tensor().clone() for n, p in engine.module.named_parameters()}
    with engine.train_mode():
        first = engine.train_batch(data.clone(), loss_fn)
        second = engine.train_batch(data.clone(), loss_fn)
    assert all(not torch.equal(p.full_tensor(), before[n]) for n, p in engine.module.named_parameters())
    assert max(abs(v) for v in metric_values(first)["actor/qkl"]) == 0
    assert min(metric_values(second)["actor/qkl"]) > 1e-6


@pytest.mark.parametrize("cache_backend, run_backend", [(None, "torch"), ("torch", None), ("torch", "liger")],
                         ids=["off-then-torch", "torch-then-off", "torch-then-liger"])
def test_a_cache_scored_with_other_log_prob_kernels_is_refused(far, tmp_path, cache_backend, run_backend):
    """A cache the actor scored with the logits path, or with one fused backend, is refused by an actor that scores
    with another, in one line naming both, where it was read before (in bf16 the two paths' log-probs differ by
    roundings of the logits, `test_fused_rows_and_gradients_equal_the_logits_paths`: a Query-KL at theta0 above 0)."""
    prompts = [far[1](p)["input_ids"] for p in PROMPTS]
    cache = str(tmp_path / "cache.json")
    engine_reference(far, engine_of(far, param_dtype="bf16", fused_kernels=cache_backend), prompts, cache)
    other = engine_of(far, param_dtype="bf16", fused_kernels=run_backend)
    recorded = {None: "off", "torch": "torch", "liger": "liger"}
    with pytest.raises(ValueError, match=rf"^\S+cache.json does not match this run: precision: cache built with "
                                         rf"dtype=bfloat16,[^;]*,fused_kernels={recorded[cache_backend]}, training "
                                         rf"scores with dtype=bfloat16,[^;]*,fused_kernels={recorded[run_backend]}\. "
                                         r"Delete it to rebuild it"):
        load_or_build_reference(far[0], far[1], prompts, path=cache, temperature=1.0,
                                precision=engine_precision(other.model_config, engine_param_dtype(other), "cpu"),
                                score=unexpected_scoring, trainer="verl", remedy=REBUILD)


def test_the_fused_backend_is_read_from_verls_model_config(far, tmp_path):
    """`fused_kernels_backend` of verl's `actor_rollout_ref.model` (its generated config: impl_backend torch) and of
    the HFModelConfig the engine is built with; the Triton backend, or none, is refused with the Query-KL only."""
    from omegaconf import OmegaConf
    model = run_config(far, tmp_path).actor_rollout_ref.model
    assert fused_kernels_backend(model) == "off"
    model.use_fused_kernels = True
    assert fused_kernels_backend(model) == "torch"
    model.fused_kernel_options = OmegaConf.create({})
    assert fused_kernels_backend(model) == "None"
    assert fused_kernels_backend(engine_of(far, fused_kernels="liger").model_config) == "liger"
    for backend in ("off", *FUSED_BACKENDS):
        check_fused_kernels(backend, ERPOSettings())
    for backend in ("triton", "None"):
        check_fused_kernels(backend, ERPOSettings(qkl_coef=0.0))
        with pytest.raises(ValueError, match=rf"^actor_rollout_ref.model.fused_kernel_options.impl_backend={backend} "
                                             r"with use_fused_kernels=true: ERPO's Query-KL is tested with verl's "
                                             r"torch \(its default\) and liger fused backends only"):
            check_fused_kernels(backend, ERPOSettings())


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows that it does not run without CUDA")
def test_verls_triton_backend_does_not_run_without_cuda():
    """Why the Triton backend stays refused: verl 0.9.1's `linear_cross_entropy` takes CUDA tensors only (it opens an
    NVTX range, then asserts `is_cuda`), so no CPU test can check its ell_theta(q), even in Triton's interpreter."""
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    with pytest.raises((RuntimeError, AssertionError)):
        linear_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.long), 1.0, "none")


@pytest.mark.parametrize("kind", ["gemma2", "granite", "qwen3_moe"])
def test_verls_fused_forward_drops_the_final_logit_transform(kind):
    """verl 0.9.1's fused forward (`forward_with_torch_backend`, what `use_fused_kernels` puts in the model's place)
    scores hidden @ lm_head.weight: on Gemma-2 (soft-cap) and Granite (logits scaling) its log-probs are not the
    model's, so ERPO refuses it there (`check_fused_logits`, wherever the cache is scored or read:
    `engine_precision`); on a model without a transform (Qwen3-MoE) they are the model's, and it is accepted."""
    model = tiny_lm(kind)
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])
        fused = forward_with_torch_backend(model, input_ids=ids, return_dict=True).log_probs[0, :-1, None]
    check_fused_logits("off", model.config)
    if kind == "qwen3_moe":
        torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-5)
        check_fused_logits("torch", model.config)
        return
    assert (fused - own).abs().max() > 1.0
    with pytest.raises(ValueError, match=rf"^actor_rollout_ref.model.use_fused_kernels=true: verl's fused forward "
                                         rf"drops {type(model.config).__name__}'s final-logit transform \(.*\), so "
                                         r"ell_theta0\(q\) and w\(q\) would not be the model's log-likelihood; set "
                                         r"use_fused_kernels=false, or \+erpo.qkl_coef=0 \+erpo.query_weight=none$"):
        check_fused_logits("torch", model.config)


def test_an_engine_with_fused_kernels_leaves_other_models_of_its_class_alone(far):
    """verl sets its fused forward on the model's class (every Qwen2 in the process); bench.verl_engine moves it onto
    the engine's model: the HF model and the logits-path engines keep their own forward, and the fused engine runs
    verl's."""
    engine = engine_of(far, fused_kernels="torch")
    assert engine.module.forward.__func__ is forward_with_torch_backend
    assert type(far[2]).forward is not forward_with_torch_backend
    ids = torch.tensor([[5, 6, 7]])
    assert far[2](input_ids=ids).logits.shape == (1, 3, far[2].config.vocab_size)


def test_trainer_mode_with_fused_kernels_scores_the_cache_on_them(far, tmp_path, monkeypatch):
    """`trainer.v1.trainer_mode=erpo` with `actor_rollout_ref.model.use_fused_kernels=true` (verl's config: the torch
    backend) and the Query-KL starts: the actor's fused engine scores the cache (the values `engine_query_logp` gets
    from it directly), which records `fused_kernels=torch`, and the ERPO loss is set; a start without fused kernels
    refuses that cache in one line."""
    pytest.importorskip("transfer_queue", exc_type=ModuleNotFoundError)
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from erpo.integrations.verl_trainer import ERPOTrainer
    engine = engine_of(far, param_dtype="bf16", fused_kernels="torch")

    def start(*settings):
        def verl_setup(self):   # what PPOTrainer._setup leaves behind that the ERPO trainer reads
            self.tokenizer, self.processor = far[1], None
            self.train_dataset = [{"raw_prompt": [{"role": "user", "content": p}]} for p in PROMPTS]
            self.actor_rollout_wg = verl_engine.EngineWorkerGroup(engine, world_size=2)
            self.global_steps = 0

        monkeypatch.setattr(PPOTrainerSync, "_setup", verl_setup)
        trainer = object.__new__(ERPOTrainer)
        trainer.config = OmegaConf.merge(run_config(far, tmp_path, qkl_coef=0.02), OmegaConf.from_dotlist([
            "trainer.device=cpu", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.model.override_config.attn_implementation=sdpa", *settings]))
        trainer.erpo_settings = ERPOSettings(qkl_coef=0.02)
        trainer._setup()
        return trainer.actor_rollout_wg

    group = start("actor_rollout_ref.model.use_fused_kernels=true")
    assert group.calls == [4]
    prompts = [far[1].apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"] for p in PROMPTS]
    expected, _ = engine_reference(far, engine, prompts, tmp_path / "direct.json")
    assert group.loss_fns[0].keywords["reference"].lookup(prompts)[0].tolist() == expected.lookup(prompts)[0].tolist()
    cache = ReferenceCache.load(tmp_path / "ckpt" / "erpo_reference_cache.json")
    assert cache.precision.startswith("dtype=bfloat16,autocast=bfloat16,path=verl-engine,device=cpu")
    assert cache.precision.endswith(",liger=false,fused_kernels=torch")
    with pytest.raises(ValueError, match=r"precision: cache built with [^;]*,fused_kernels=torch, training scores with "
                                         r"[^;]*,fused_kernels=off\. Delete it"):
        start()
