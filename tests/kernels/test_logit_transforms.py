"""Logit transforms (LogitTransform: logits * logit_scale, then logit_softcap * tanh(. / logit_softcap), then
/ temperature) on both paths (logits, fused-linear) and both backends (torch, Triton): forward and
backward against the explicit formula differentiated by autograd in float64; and the Hugging Face config reader. On the
`device` fixture's device (Triton compiled on a GPU when one is present)."""
import pytest
import torch

from erpo_kernels import (
    ERPOLoss,
    LossOptions,
    erpo_loss,
    fused_linear_erpo_loss,
    fused_linear_loss,
    fused_linear_token_logprobs,
    logit_transforms_from_config,
    token_logprobs,
)
from erpo_kernels.triton_logits import FORWARD_VARIANTS, forward_variant
from helpers import loss_inputs, random_batch
from plain_formula import plain_erpo_loss

BACKENDS = ["torch", "triton"]
TRANSFORMS = [  # (logit_scale, logit_softcap, temperature)
    (1.0, 2.0, 1.0),  # Gemma-2-style cap that bites (logits up to ~+-20 below)
    (0.0625, None, 1.0),  # Cohere's logit_scale
    (0.25, 3.0, 0.7),  # all three, in their order
]
IDS = [f"scale={s},cap={c},T={t}" for s, c, t in TRANSFORMS]


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """fused_linear_token_logprobs' chunks of a few rows (as in test_fused_linear.py): every chunk loop and tail
    of the fused paths runs."""
    monkeypatch.setattr(fused_linear_loss, "DEFAULT_WORKSPACE_BYTES", 30_000)


def formula(logits, targets, scale, softcap, temperature):
    """float64 (logp, entropy) of the explicit formula; logp 0 where target == -100."""
    z = logits.double() * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_probs = torch.log_softmax(z / temperature, -1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    logp = log_probs.gather(1, targets.clamp_min(0)[:, None]).squeeze(1)
    return torch.where(targets == -100, 0.0, logp), entropy


def upstream(num_rows, *, device, seed=2):
    """Random d loss / d logp and d loss / d H on `device`, zero on rows 1 and 5 (rows without gradient)."""
    g = torch.Generator().manual_seed(seed)
    g_logp, g_entropy = torch.randn(num_rows, generator=g).to(device), torch.randn(num_rows, generator=g).to(device)
    g_logp[[1, 5]] = 0.0
    g_entropy[[1, 5]] = 0.0
    return g_logp, g_entropy


def assert_grad_close(got, want, dtype):
    """Gradients relative to their largest entry: fp32 to 1e-5, bf16 to bf16's rounding."""
    scale = want.abs().max().clamp_min(1e-12)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
    torch.testing.assert_close(got.double() / scale, want / scale, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [37, 300, 4096 + 37])  # tails of every block size
@pytest.mark.parametrize("transform", TRANSFORMS, ids=IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_path_matches_the_float64_formula(backend, transform, vocab, dtype, device):
    scale, softcap, temperature = transform
    num_rows = 9
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(num_rows, vocab, generator=g) * 8).to(device, dtype)
    targets = torch.randint(0, vocab, (num_rows,), generator=g).to(device)
    targets[[1, 4]] = -100
    g_logp, g_entropy = upstream(num_rows, device=device)

    x = logits.clone().requires_grad_(True)
    logp, entropy = token_logprobs(x, targets, temperature=temperature, logit_scale=scale, logit_softcap=softcap,
                                   return_entropy=True, backend=backend)
    ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()

    exact = logits.double().requires_grad_(True)
    want_logp, want_entropy = formula(exact, targets, scale, softcap, temperature)
    ((want_logp * g_logp.double()).sum() + (want_entropy * g_entropy.double()).sum()).backward()

    torch.testing.assert_close(logp.double(), want_logp.detach(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(entropy.double(), want_entropy.detach(), rtol=1e-5, atol=2e-5)
    assert x.grad.dtype == dtype
    assert_grad_close(x.grad, exact.grad, dtype)
    assert torch.all(x.grad[[1, 5]] == 0)  # rows without gradient: exact zeros


def linear_inputs(num_rows, hidden_dim, vocab, dtype, bias, *, device, seed=1):
    """hidden @ weight.T + bias with logits of about +-20 (so a cap of 2 or 3 saturates many of them), on `device`."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, hidden_dim, generator=g).to(device, dtype)
    weight = (torch.randn(vocab, hidden_dim, generator=g) * 8 / hidden_dim ** 0.5).to(device, dtype)
    b = torch.randn(vocab, generator=g).to(device, dtype) if bias else None
    return hidden, weight, b


@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)],
                         ids=str)
@pytest.mark.parametrize("transform", TRANSFORMS, ids=IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_path_matches_the_float64_formula(backend, transform, dtype, bias, device):
    """N = 40 rows in 4 backward chunks of 13 (and a tail of 1), V = 300 in vocabulary blocks of 96 (and a tail)."""
    scale, softcap, temperature = transform
    num_rows, hidden_dim, vocab = 40, 48, 300
    hidden, weight, b = linear_inputs(num_rows, hidden_dim, vocab, dtype, bias, device=device)
    targets = torch.randint(0, vocab, (num_rows,), generator=torch.Generator().manual_seed(3)).to(device)
    targets[::7] = -100
    g_logp, g_entropy = upstream(num_rows, device=device)

    ours = [None if t is None else t.clone().requires_grad_(True) for t in (hidden, weight, b)]
    logp, entropy = fused_linear_token_logprobs(ours[0], ours[1], targets, bias=ours[2], temperature=temperature,
                                                logit_scale=scale, logit_softcap=softcap, return_entropy=True,
                                                backend=backend)
    ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()

    exact = [None if t is None else t.double().requires_grad_(True) for t in (hidden, weight, b)]
    logits = exact[0] @ exact[1].t() + (0 if exact[2] is None else exact[2])
    want_logp, want_entropy = formula(logits, targets, scale, softcap, temperature)
    ((want_logp * g_logp.double()).sum() + (want_entropy * g_entropy.double()).sum()).backward()

    torch.testing.assert_close(logp.double(), want_logp.detach(), rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(entropy.double(), want_entropy.detach(), rtol=1e-5, atol=5e-5)
    for got, want in zip(ours, exact):
        if want is None:
            continue
        assert got.grad.dtype == dtype
        assert_grad_close(got.grad, want.grad, dtype)
    assert torch.all(ours[0].grad[[1, 5]] == 0)  # rows without gradient: exact zeros in d hidden


def test_the_cap_bites_in_these_tests(device):
    """The logits above reach far beyond the caps (else a test with and without the cap could not tell them apart)."""
    hidden, weight, b = linear_inputs(40, 48, 300, torch.float32, True, device=device)
    logits = hidden @ weight.t() + b
    assert logits.abs().max() > 15 and (logits.abs() > 3).float().mean() > 0.3
    targets = torch.randint(0, 300, (40,)).to(device)
    capped = fused_linear_token_logprobs(hidden, weight, targets, bias=b, logit_softcap=2.0, backend="torch")
    plain = fused_linear_token_logprobs(hidden, weight, targets, bias=b, backend="torch")
    assert (capped - plain).abs().max() > 1.0


@pytest.mark.parametrize("softcap", [5.0, 1000.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_soft_cap_is_accurate_for_tiny_and_saturated_logits(backend, softcap, device, fma_as_compiled):
    """The Triton tanh is built from exp without cancellation near 0 (tanh from expm1, itself by Kahan's trick) and
    near saturation (1 - tanh^2 = 4 e / (1 + e)^2): logits from 1e-7 to 1e5 (tanh = 1 in fp32, the slope 0) against
    float64, to fp32 rounding. With the cap of 1000 the logits sit in tanh's linear part, where tanh from
    1 - exp(-2|x|) would be off by ~c * 6e-8 = 6e-5. Under the interpreter with the GPU's FMA contraction."""
    magnitudes = torch.tensor([1e-7, 1e-4, 1e-2, 0.3, 1.0, 4.0, 20.0, 90.0, 1e5], device=device)
    logits = torch.cat([magnitudes, -magnitudes, torch.zeros(1, device=device)]).repeat(3, 1)
    logits[:2, [7, 8, 16, 17]] = 0.0  # rows 0 and 1 without saturated logits: lse ~ 20, where fp32 resolves 2e-6
    logits[1] *= 0.5
    targets = torch.tensor([4, 12, 8], device=device)
    x = logits.clone().requires_grad_(True)
    logp, entropy = token_logprobs(x, targets, logit_softcap=softcap, return_entropy=True, backend=backend)
    (logp.sum() + entropy.sum()).backward()
    exact = logits.double().requires_grad_(True)
    want_logp, want_entropy = formula(exact, targets, 1.0, softcap, 1.0)
    (want_logp.sum() + want_entropy.sum()).backward()
    # 4e-6: two fp32 ulps of logp ~ -20 (tanh from 1 - exp(-2|x|) is off by 6e-5 here at the cap of 1000); row 2,
    # lse ~ 1000, is exact: its max holds all the mass (on the H200, 2026-11-26, the base-2 loop was one ulp of
    # 1000 off there, 6.1e-5, while it subtracted a rounded product of the max)
    torch.testing.assert_close(logp.double(), want_logp.detach(), rtol=0, atol=4e-6)
    torch.testing.assert_close(entropy.double(), want_entropy.detach(), rtol=0, atol=4e-6)
    torch.testing.assert_close(x.grad.double(), exact.grad, rtol=1e-5, atol=1e-7)
    assert torch.all(x.grad[2, [8, 17]].abs() < 1e-7)  # +-1e5: saturated, no gradient through the cap


@pytest.mark.parametrize("variant", FORWARD_VARIANTS)
def test_a_soft_capped_row_whose_max_holds_all_the_mass_is_exact(variant, device, fma_as_compiled):
    """Cap 1000 and a spread of ~390 in z: exp(-390) is 0 in fp32, so the max holds all the mass and the row's logp
    at the max and its entropy are exactly 0, as in the reference, the max's z = 1000 tanh(0.3) not being a float
    (under the interpreter with the GPU's FMA contraction: z must reach the loops as a float, not as a product
    fused into their subtraction of the max). The max in the first of the row's full steps (V = 2 * 2048 + 5)."""
    logits = torch.full((2, 2 * 2048 + 5), -100.0, device=device)
    logits[:, 7] = 300.0
    targets = torch.tensor([7, 8], device=device)
    with forward_variant(variant):
        logp, entropy = token_logprobs(logits, targets, logit_softcap=1000.0, return_entropy=True, backend="triton")
    want_logp, want_entropy = token_logprobs(logits, targets, logit_softcap=1000.0, return_entropy=True,
                                             backend="torch")
    assert logp[0] == 0 and torch.all(entropy == 0) and want_logp[0] == 0 and torch.all(want_entropy == 0)
    torch.testing.assert_close(logp, want_logp, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, True])
def test_loss_options_reach_the_kernels(fused, backend, device):
    """erpo_loss / fused_linear_erpo_loss / ERPOLoss with logit_scale and logit_softcap: the float64 loss of the
    transformed logits (tests/support/plain_formula.py) and its gradient through the transform."""
    options = {"logit_scale": 0.5, "logit_softcap": 3.0, "temperature": 0.8, "qkl_coef": 0.3, "policy_kl_coef": 0.1,
               "entropy_coef": 0.05}
    batch = random_batch(num_rows=40, vocab=300, device=device)
    hidden, weight, b = linear_inputs(40, 48, 300, torch.float32, True, device=device)
    exact = [t.double().requires_grad_(True) for t in (hidden, weight, b)]
    logits = exact[0] @ exact[1].t() + exact[2]
    z = 3.0 * torch.tanh(0.5 * logits / 3.0)
    plain_options = {k: v for k, v in options.items() if k not in ("logit_scale", "logit_softcap")}
    expected = plain_erpo_loss(z, batch["targets"], batch["token_kind"], batch["sample_index"], **loss_inputs(batch),
                               **plain_options)
    expected.backward()
    ours = [t.clone().requires_grad_(True) for t in (hidden, weight, b)]
    rows = (batch["targets"], batch["token_kind"], batch["sample_index"])
    if fused:
        out = fused_linear_erpo_loss(ours[0], ours[1], *rows, bias=ours[2], backend=backend, **loss_inputs(batch),
                                     **options)
    else:
        module = ERPOLoss(backend=backend, **options)
        out = module(ours[0] @ ours[1].t() + ours[2], *rows, **loss_inputs(batch))
        assert torch.equal(out.loss, erpo_loss(ours[0] @ ours[1].t() + ours[2], *rows, backend=backend,
                                               **loss_inputs(batch), **options).loss)
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(ours, exact):
        assert_grad_close(got.grad, want.grad, torch.float32)


@pytest.mark.parametrize("name,value,match", [
    ("logit_scale", 0.0, "logit_scale must be a finite number > 0"),
    ("logit_scale", float("nan"), "logit_scale must be a finite number > 0"),
    ("logit_scale", None, "logit_scale must be a finite number > 0"),
    ("logit_softcap", 0.0, "logit_softcap must be None or a finite number > 0"),
    ("logit_softcap", -30.0, "logit_softcap must be None or a finite number > 0"),
    ("logit_softcap", float("inf"), "logit_softcap must be None or a finite number > 0"),
    ("logit_softcap", True, "logit_softcap must be None or a finite number > 0"),
])
def test_bad_transforms_are_refused_on_every_entry_point(name, value, match, device):
    logits = torch.randn(4, 10, device=device)
    targets = torch.tensor([1, 2, 3, -100], device=device)
    with pytest.raises(ValueError, match=match):
        LossOptions(**{name: value})
    with pytest.raises(ValueError, match=match):
        ERPOLoss(**{name: value})
    with pytest.raises(ValueError, match=match):
        token_logprobs(logits, targets, **{name: value})
    with pytest.raises(ValueError, match=match):
        fused_linear_token_logprobs(torch.randn(4, 8, device=device), torch.randn(10, 8, device=device), targets,
                                    **{name: value})


# --- the Hugging Face config reader ---

def tiny(config_class, **overrides):
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    return config_class(**{**base, **overrides})


def test_config_reader_on_model_families():
    from transformers import CohereConfig, Gemma2Config, GraniteConfig, Qwen2Config

    assert logit_transforms_from_config(tiny(Gemma2Config, final_logit_softcapping=30.0)) == {
        "logit_scale": 1.0, "logit_softcap": 30.0}
    assert logit_transforms_from_config(tiny(CohereConfig, logit_scale=0.0625)) == {
        "logit_scale": 0.0625, "logit_softcap": None}
    assert logit_transforms_from_config(tiny(GraniteConfig, logits_scaling=8.0)) == {  # Granite divides
        "logit_scale": 0.125, "logit_softcap": None}
    assert logit_transforms_from_config(tiny(Qwen2Config)) == {"logit_scale": 1.0, "logit_softcap": None}
    # attn_logit_softcapping acts on attention scores, not on the final logits: not a reason to refuse
    assert tiny(Gemma2Config).attn_logit_softcapping == 50.0
    assert logit_transforms_from_config(tiny(Gemma2Config, final_logit_softcapping=None))["logit_softcap"] is None


def test_config_reader_refuses_what_it_does_not_know():
    from transformers import LlamaConfig, MptConfig, Qwen2Config

    config = tiny(Qwen2Config)
    config.final_logits_temperature = 2.0  # a name that looks like a final-logit transform
    with pytest.raises(ValueError, match="final_logits_temperature = 2.0 looks like a transform of the final logits"):
        logit_transforms_from_config(config)
    config = tiny(LlamaConfig)
    config.logits_scaling = 4.0  # Granite divides by it, HyperCLOVAX multiplies: unknown for Llama
    with pytest.raises(ValueError, match="logits_scaling = 4.0 on model_type 'llama'"):
        logit_transforms_from_config(config)
    config.logits_scaling = 1.0  # neutral either way
    assert logit_transforms_from_config(config) == {"logit_scale": 1.0, "logit_softcap": None}
    with pytest.raises(ValueError, match="logit_scale = 0.5 on model_type 'mpt'"):  # transformers' MPT ignores it
        logit_transforms_from_config(MptConfig(logit_scale=0.5))
    config = tiny(Qwen2Config)
    config.final_logit_softcapping = -1.0
    with pytest.raises(ValueError, match="final_logit_softcapping = -1.0: expected None or a finite number > 0"):
        logit_transforms_from_config(config)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_gemma2_gives_the_models_own_log_probs(backend, device):
    """A tiny Gemma2ForCausalLM (built from its config) with final_logit_softcapping = 2 (its logits reach past it):
    the fused path on (hidden, lm_head.weight) and the logits path on the raw lm_head output, with the options read
    from the config, give log_softmax of the model's own (capped) logits. Without the options they do not."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = tiny(Gemma2Config, final_logit_softcapping=2.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval().to(device)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # tied: raw logits of several units, beyond the cap of 2
    ids = torch.randint(0, 64, (2, 12)).to(device)
    out = model(ids, output_hidden_states=True)
    hidden = out.hidden_states[-1].reshape(-1, 32)  # after the final norm: what lm_head reads
    targets = torch.roll(ids, -1, 1).reshape(-1)
    own = torch.log_softmax(out.logits.float().reshape(-1, 64), -1).gather(1, targets[:, None]).squeeze(1)
    raw = model.lm_head(hidden)
    assert raw.abs().max() > 4.0 and out.logits.abs().max() <= 2.0
    options = logit_transforms_from_config(config)
    assert options == {"logit_scale": 1.0, "logit_softcap": 2.0}
    weight = model.lm_head.weight
    with torch.no_grad():
        fused = fused_linear_token_logprobs(hidden, weight, targets, backend=backend, **options)
        logits_path = token_logprobs(raw, targets, backend=backend, **options)
        uncapped = fused_linear_token_logprobs(hidden, weight, targets, backend=backend)
    torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits_path, own, rtol=1e-5, atol=1e-5)
    assert (uncapped - own).abs().max() > 0.1
