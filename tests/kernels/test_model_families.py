"""The loss the way users run it, on the model families they train. For each family (Qwen2: q/k/v bias, untied
head; Llama: no bias, untied; Gemma-2: tied embeddings scaled by sqrt(D), final-logit soft-cap, sliding window;
Qwen3-MoE: routed experts), each trainer's batch layout (TRL's left-padded prompts, erpo's right-padded sequences,
verl's packed samples) and each public path (`erpo_loss` on the model's logits, every position, as ERPOTrainer's
logits path hands them; `fused_linear_erpo_loss` on the final hidden states of the scored rows and the lm_head, with
the family's logit transform, in row chunks that split the prompts), a tiny model built from its transformers config
(2 layers, hidden 32, vocabulary 333: a tail for every Triton block; no download) runs as trainers run it: fp32
weights under `torch.autocast(..., dtype=torch.bfloat16)` (TRL's and verl's bf16), and for the fused path also bf16
weights (erpo train's default on CUDA, DeepSpeed's bf16). Our loss (both backends; Triton in its interpreter on CPU)
is compared with the plain formula (tests/support/plain_formula.py, float64) evaluated on the same forward and
backpropagated through the same graph.

theta0 is another set of weights: the model under test is theta0 moved by two gradient steps that raise two prompts'
likelihood and lower the third's, so r_s = ell_theta0(q) - ell_theta(q) is tens of nats of both signs (the Query-KL
on its linear continuation: slope e^5 - 1 = 147 above, about -1 below), and ref_logp, the Policy-KL's reference, is
theta0's. w(q) is not 1, old_logp is off-policy (ratios leave the clip range), an entropy bonus and a Policy-KL are
on: every term of the loss sends a gradient into the model.

What each side runs in, and the bounds (u = 2^-24, fp32's unit roundoff; the oracle's float64 rounding is
negligible beside it, so each bound is the rounding of our side):
- logits path: the model's logits are bf16 (autocast's lm_head); ours reads them exactly into fp32 and forms each
  log-prob in fp32: |d logp| <= (V + 8) u (a sum of V exponentials and its log). Its d logits is formed in fp32
  (relative error twice that, plus (V + 8) u of the row's largest entry where p_t - 1 cancels) and stored in bf16,
  rounded to nearest: within half an ulp, 2^-8 of the value (8 significant bits). Triton's interpreter truncates
  instead, a whole ulp: this tier's conftest holds it to the compiled rounding (tests/support/interpreter_as_gpu.py).
- fused path: under autocast the final norm's output is fp32 (the residual stream is) and so are the weights, so the
  loss runs in fp32; with bf16 weights its operands are bf16. Either way its logits come from a GEMM with fp32
  output, off by at most dz = D u max sum_d |h_d W_vd|, which moves a log-prob by at most 2 dz besides the
  log-softmax's (V + 8) u. Its d logits are off by 2 (V + 8) u + 4 dz relatively (p_j moves by 2 dz, the cap's slope
  less), plus half a bf16 ulp where they are stored in bf16 (bf16 inputs); d hidden = d logits @ W and
  d weight = d logits^T @ hidden, fp32 dots of V and R terms (V u, R u), are within that relative error of the sum of
  their terms' magnitudes (|d logits| @ |W|, |d logits|^T @ |hidden|), plus half a bf16 ulp of themselves where they
  are returned in bf16. d weight is the lm_head's alone (the loss reads it through a view; a tied embedding adds the
  input side's part to the parameter).
- ell_theta(q) is an fp32 sum of n <= 36 log-probs: within n |d logp| + n u |ell|. The loss: the Query-KL moves by
  at most qkl_coef (e^5 - 1) (its steepest slope) times that; the response terms, a token-mean whose rows'
  sensitivity to their log-prob is a few units (|A| w ratio, beta e^(ref - logp)), by less than one max ell bound
  (>= 22 log-prob bounds); the objective's own fp32 arithmetic by (V + 8) u of the loss.
- every parameter of the model, under autocast: the two sides' gradients (d logits, d hidden) enter autocast's bf16
  backward, whose every rounding to bf16 may go the other way for the two once their inputs differ in the last bits:
  a flipped element moves by one bf16 ulp, at most 2^-7 of itself. We allow each parameter's gradient that much in
  norm, |G_ours - G| <= 2^-7 |G|: flips are rare (the inputs agree to fp32 rounding), so what is measured is a
  fraction of it, while a gradient that reaches the wrong parameter, misses the tied head's part or the soft-cap's
  slope, or loses a term of the loss is off by order one (a Query-KL coefficient 1% off already fails d logits and
  the loss). With bf16 weights the comparison stops at what the loss returns: d hidden then differs from the
  oracle's by rounding in every entry, not by rare flips, and the model's all-bf16 backward (attention and norms
  included) turns a random half-ulp change of d hidden into more than one ulp on attention parameters (so it does
  with the oracle's own d hidden): noise of the model's precision, not of the loss.
The errors measured, over their bounds, are in CHANGELOG.md (session 2026-11-27 06:17).
"""
import copy
import math
import os
from dataclasses import dataclass

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton` (also done by conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import erpo_kernels.fused_linear_loss as chunked  # noqa: E402
from erpo_kernels import LossOptions, erpo_loss, fused_linear_erpo_loss, logit_transforms_from_config  # noqa: E402
from erpo_kernels.layout import completion_layout, from_padded  # noqa: E402
from plain_formula import plain_erpo_loss  # noqa: E402
from test_fused_linear_loss import budget_for  # noqa: E402

VOCAB, HIDDEN = 333, 32
U = 2.0 ** -24              # fp32's unit roundoff
BF16_HALF_ULP = 2.0 ** -8   # rounding to the nearest bf16 moves a value by at most this much of itself
BF16_ULP = 2.0 ** -7        # one bf16 ulp, at most this much of the value
LOGSOFTMAX = (VOCAB + 8) * U   # an fp32 log-softmax's error on a row, nats
PROMPTS, COMPLETIONS = (36, 29, 22), (8, 5, 7)   # tokens per sample
CHUNK_ROWS = 16   # the fused path's chunks: every prompt is split, so its rows are pre-passed
DRIFT_SIGNS = (1.0, -1.0, 1.0)   # the drift raises the 1st and 3rd prompts' likelihood (r < 0) and lowers the 2nd's
OPTIONS = dict(qkl_coef=0.01, policy_kl_coef=0.04, entropy_coef=0.01)   # qkl_linear_beyond: the default
STEEPEST_QKL_SLOPE = math.expm1(LossOptions().qkl_linear_beyond)   # k3's slope beyond +c_q, the largest
SAMPLE_INPUTS = dict(advantages=torch.tensor([1.0, -0.8, 0.5], device="cpu"),
                     query_weight=torch.tensor([0.6, 1.8, 1.2], device="cpu"))

COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Family:
    """A model family as a tiny config: its classes, the settings that make it that family, and what its model
    must have (a head tied to the embedding, a bias on the attention projections), checked when it is built."""

    config_class: type
    model_class: type
    settings: dict
    tied: bool
    attention_bias: bool


FAMILIES = {
    "qwen2": Family(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}, tied=False, attention_bias=True),
    "llama": Family(transformers.LlamaConfig, transformers.LlamaForCausalLM, {}, tied=False, attention_bias=False),
    "gemma2": Family(transformers.Gemma2Config, transformers.Gemma2ForCausalLM,   # raw logits pass the cap (checked)
                     dict(final_logit_softcapping=5.0, sliding_window=16, tie_word_embeddings=True),
                     tied=True, attention_bias=False),
    "qwen3-moe": Family(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
                        tied=False, attention_bias=False),
}
LAYOUTS = ("left-padded", "right-padded", "packed")


def tiny_model(family: str) -> torch.nn.Module:
    """theta0 of `family`, fp32, seeded, its head scaled so that the logits spread over several nats as a trained
    model's do (at the configs' init they are all about 0, every log-prob about -log V)."""
    spec = FAMILIES[family]
    torch.manual_seed(0)
    model = spec.model_class(spec.config_class(**COMMON, **spec.settings)).train()
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == spec.tied
    assert (model.model.layers[0].self_attn.q_proj.bias is not None) == spec.attention_bias
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


@dataclass
class Batch:
    """A batch as the model reads it (`model_inputs`) and as the loss reads it: a row per position of the forward,
    flattened (targets, token_kind, sample_index [N]; kind 0 where nothing is scored)."""

    model_inputs: dict
    targets: torch.Tensor
    token_kind: torch.Tensor
    sample_index: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch({name: t.to(device) for name, t in self.model_inputs.items()}, self.targets.to(device),
                     self.token_kind.to(device), self.sample_index.to(device))


def batch_in(layout: str, seed: int = 1) -> Batch:
    """Three samples of PROMPTS / COMPLETIONS random tokens in `layout`: "left-padded" (TRL: prompts left-padded,
    completions right-padded; `completion_layout`), "right-padded" (erpo: whole sequences right-padded; `from_padded`)
    or "packed" (verl's remove-padding: the samples back to back in one row, positions restarting at each; the row
    of a sample's last token predicts nothing). Built on the host, as trainers build it."""
    g = torch.Generator().manual_seed(seed)
    samples = [(torch.randint(3, VOCAB, (p,), generator=g, device="cpu"),
                torch.randint(3, VOCAB, (c,), generator=g, device="cpu"))
               for p, c in zip(PROMPTS, COMPLETIONS)]
    if layout == "left-padded":
        prompt_ids, prompt_mask = (torch.zeros(len(samples), max(PROMPTS), dtype=torch.long, device="cpu")
                                   for _ in range(2))
        completion_ids, completion_mask = (torch.zeros(len(samples), max(COMPLETIONS), dtype=torch.long, device="cpu")
                                           for _ in range(2))
        for b, (prompt, completion) in enumerate(samples):
            prompt_ids[b, max(PROMPTS) - len(prompt):], prompt_mask[b, max(PROMPTS) - len(prompt):] = prompt, 1
            completion_ids[b, :len(completion)], completion_mask[b, :len(completion)] = completion, 1
        rows = completion_layout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                                 completion_mask=completion_mask)
        return Batch(dict(input_ids=rows.input_ids, attention_mask=rows.attention_mask), rows.targets,
                     rows.token_kind, rows.sample_index)
    lengths = [len(p) + len(c) for p, c in samples]
    ids, attention, response = (torch.zeros(len(samples), max(lengths), dtype=torch.long, device="cpu")
                                for _ in range(3))
    for b, (prompt, completion) in enumerate(samples):
        ids[b, :lengths[b]] = torch.cat([prompt, completion])
        attention[b, :lengths[b]] = 1
        response[b, len(prompt):lengths[b]] = 1
    rows = from_padded(ids, attention, response)
    if layout == "right-padded":
        return Batch(dict(input_ids=ids, attention_mask=attention), rows.targets, rows.token_kind, rows.sample_index)
    real = attention.reshape(-1).bool()
    positions = torch.cat([torch.arange(n, device="cpu") for n in lengths])
    return Batch(dict(input_ids=ids.reshape(-1)[real][None], position_ids=positions[None]), rows.targets[real],
                 rows.token_kind[real], rows.sample_index[real])


def forward(model, batch: Batch):
    """(logits [N, V], final hidden states [N, D]) of `model` on `batch` as trainers run it: under bf16 autocast for
    fp32 weights (TRL's and verl's mixed precision), as it is for bf16 weights (erpo's, DeepSpeed's bf16)."""
    with torch.autocast(batch.targets.device.type, dtype=torch.bfloat16, enabled=model.dtype == torch.float32):
        out = model(**batch.model_inputs, output_hidden_states=True, use_cache=False)
    return out.logits.reshape(-1, VOCAB), out.hidden_states[-1].reshape(-1, HIDDEN)


def row_logp(logits: torch.Tensor, targets: torch.Tensor, token_kind: torch.Tensor) -> torch.Tensor:
    """float64 log-prob [N] (nats) of each row's target under `logits` [N, V]; 0 on rows of kind 0."""
    logp = torch.log_softmax(logits.double(), -1).gather(1, targets.clamp_min(0)[:, None]).squeeze(1)
    return torch.where(token_kind != 0, logp, 0.0)


def query_sums(row_values: torch.Tensor, token_kind: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """[S] sums of `row_values` [N] over each sample's query rows (ell(q) for log-probs)."""
    return torch.zeros(len(PROMPTS), dtype=row_values.dtype, device=row_values.device).index_add_(
        0, sample_index, torch.where(token_kind == 1, row_values, 0.0))


def drifted(theta0, batch: Batch, steps: int = 2, step_size: float = 0.03):
    """A copy of theta0 moved by `steps` gradient steps of norm `step_size` on sum_s DRIFT_SIGNS[s] ell(q_s) (fp32):
    each prompt's likelihood drifts by tens of nats, up or down, as RL training moves it."""
    model = copy.deepcopy(theta0)
    for _ in range(steps):
        ell = query_sums(row_logp(model(**batch.model_inputs).logits.reshape(-1, VOCAB), batch.targets,
                                  batch.token_kind), batch.token_kind, batch.sample_index)
        signs = torch.tensor(DRIFT_SIGNS, dtype=ell.dtype, device=ell.device)
        grads = torch.autograd.grad((ell * signs).sum(), list(model.parameters()))
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p.add_(g, alpha=step_size / norm)
    return model


@dataclass
class Case:
    """A family's drifted model in a layout, and the loss's inputs from its theta0: per sample [S] and per row [N]."""

    model: torch.nn.Module
    batch: Batch
    inputs: dict
    drift: torch.Tensor   # [S] float64: r_s = ell_theta0(q_s) - ell_theta(q_s), nats


CASES: dict = {}


def case_of(family: str, layout: str, precision: str, device: torch.device) -> Case:
    """The `Case` of `family` in `layout` on `device`, its weights fp32 (`precision` "autocast") or bf16 ("bf16"),
    built once per module."""
    if (family, layout, precision, device) not in CASES:
        theta0, batch = tiny_model(family).to(device), batch_in(layout).to(device)
        model = drifted(theta0, batch)
        if precision == "bf16":   # drifted in fp32, as a trainer's fp32 master weights
            theta0, model = theta0.bfloat16(), model.bfloat16()
        with torch.no_grad():
            ref_logp = row_logp(forward(theta0, batch)[0], batch.targets, batch.token_kind)
            logp = row_logp(forward(model, batch)[0], batch.targets, batch.token_kind)
        noise = 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64,
                                  device="cpu").to(device)
        ell0, ell = (query_sums(values, batch.token_kind, batch.sample_index) for values in (ref_logp, logp))
        inputs = dict({name: t.to(device) for name, t in SAMPLE_INPUTS.items()}, ref_query_logp=ell0.float(),
                      ref_logp=ref_logp.float(),
                      old_logp=torch.where(batch.token_kind == 2, logp + noise, 0.0).float())
        CASES[family, layout, precision, device] = Case(model, batch, inputs, ell0 - ell)
    return CASES[family, layout, precision, device]


def parameter_gradients(model) -> dict:
    """{name: gradient} of the parameters that received one; then cleared."""
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def error_over_bound(ours: torch.Tensor, oracle: torch.Tensor, bound) -> float:
    """max over entries of |ours - oracle| / bound (bound a number or a tensor; 0 / 0 is 0): <= 1 when within."""
    return float(((ours.double() - oracle.double()).abs() / bound).nan_to_num(nan=0.0).max())


def fused_bounds(hidden: torch.Tensor, weight: torch.Tensor, d_hidden: torch.Tensor, d_weight: torch.Tensor,
                 d_logits: torch.Tensor) -> tuple:
    """The fused path's bounds (module docstring): (on a row's log-prob, nats; on each entry of d hidden [R, D]; on
    each entry of d weight [V, D]), from the hidden rows [R, D] and the lm_head [V, D] our loss read (fp32 or bf16)
    and the plain formula's float64 gradients with respect to them and to the logits before the cap [R, V]."""
    exact_hidden, exact_weight = hidden.double(), weight.double()
    gemm = HIDDEN * U * float((exact_hidden.abs() @ exact_weight.abs().t()).max())
    hidden_terms, weight_terms = d_logits.abs() @ exact_weight.abs(), d_logits.abs().t() @ exact_hidden.abs()
    d_logits_error = 2 * LOGSOFTMAX + 4 * gemm
    if hidden.dtype == torch.bfloat16:   # d logits stored in bf16, d hidden and d weight returned in bf16
        d_logits_error += BF16_HALF_ULP
    hidden_bound = (d_logits_error + VOCAB * U) * hidden_terms
    weight_bound = (d_logits_error + len(hidden) * U) * weight_terms
    if hidden.dtype == torch.bfloat16:
        hidden_bound, weight_bound = hidden_bound + BF16_HALF_ULP * d_hidden.abs(), \
            weight_bound + BF16_HALF_ULP * d_weight.abs()
    return LOGSOFTMAX + 2 * gemm, hidden_bound, weight_bound


def errors_against_the_plain_formula(family: str, layout: str, path: str, backend: str, precision: str,
                                     device: torch.device) -> dict:
    """{what: its largest error over its bound (module docstring)} for our loss on `path` ("logits" or "fused")
    with `backend`, against the plain formula on the same forward of `family`'s drifted model in `layout`, its weights
    in `precision` ("autocast": fp32 under bf16 autocast; "bf16"): token_logp, query_logp, loss, the gradients our
    loss returns ("d logits"; "d hidden", "d weight": the lm_head's, without a tied embedding's part) and, under
    autocast, per parameter of the model, its gradient's error in norm over 2^-7 of its norm."""
    case = case_of(family, layout, precision, device)
    model, batch, head = case.model, case.batch, case.model.get_output_embeddings()
    logits, hidden = forward(model, batch)
    if path == "logits":   # the model's own (capped) logits, every position
        rows = torch.arange(len(batch.targets), device=device)
        read = {"logits": logits}
    else:   # the scored rows' final hidden states (fp32 under autocast), selected as erpo's final_hidden does, and
        # the lm_head through a view, whose gradient is the loss's d weight alone (a tied embedding adds its own)
        rows = (batch.token_kind != 0).nonzero().squeeze(1)
        read = {"hidden": hidden.index_select(0, rows).to(head.weight.dtype),
                "weight": head.weight.view_as(head.weight)}
    for tensor in read.values():
        tensor.retain_grad()
    targets, token_kind, sample_index = batch.targets[rows], batch.token_kind[rows], batch.sample_index[rows]
    inputs = {name: value[rows] if name in ("old_logp", "ref_logp") else value for name, value in case.inputs.items()}
    transform = logit_transforms_from_config(model.config)   # the fused path applies it; the logits hold it already
    if path == "logits":
        ours = erpo_loss(logits, targets, token_kind, sample_index, backend=backend, **inputs, **OPTIONS)
    else:
        budget = budget_for(CHUNK_ROWS, head.weight.dtype, device, backend, vocab=VOCAB, hidden_dim=HIDDEN)
        workspace = chunked.plan_workspace(len(rows), HIDDEN, VOCAB, head.weight.dtype, device,
                                           chunked.ROW_KERNELS[backend], budget, False)
        assert workspace.chunk_rows < min(PROMPTS) - 1   # every prompt's query rows split across chunks
        ours = fused_linear_erpo_loss(read["hidden"], read["weight"], targets, token_kind, sample_index,
                                      bias=head.bias, backend=backend, workspace_bytes=budget, **inputs, **OPTIONS,
                                      **transform)
    ours.loss.backward(retain_graph=True)
    our_read, our_grads = {name: t.grad.clone() for name, t in read.items()}, parameter_gradients(model)

    # the oracle: float64 logits of the same forward (the fused path's: hidden @ W, then the family's cap)
    exact = {name: t.double() for name, t in read.items()}
    for tensor in exact.values():
        tensor.retain_grad()
    raw = exact["logits"] if path == "logits" else exact["hidden"] @ exact["weight"].t()
    raw.retain_grad()
    z = raw
    if path == "fused" and transform["logit_softcap"] is not None:
        cap = transform["logit_softcap"]
        assert raw.abs().max() > cap   # the cap bites
        z = cap * torch.tanh(raw / cap)
    oracle = plain_erpo_loss(z, targets, token_kind, sample_index, **inputs, **OPTIONS)
    oracle.backward()
    oracle_grads = parameter_gradients(model)

    if path == "logits":   # bf16 logits are exact in fp32
        g = exact["logits"].grad.abs()
        logp_bound = LOGSOFTMAX
        read_bounds = {"logits": (BF16_HALF_ULP + 2 * LOGSOFTMAX) * g + LOGSOFTMAX * g.amax(1, keepdim=True)}
    else:
        logp_bound, *fused = fused_bounds(read["hidden"].detach(), head.weight.detach(), exact["hidden"].grad,
                                          exact["weight"].grad, raw.grad)
        read_bounds = dict(zip(("hidden", "weight"), fused))
    scored, logp = token_kind != 0, row_logp(z.detach(), targets, token_kind)
    ell = query_sums(logp, token_kind, sample_index)
    n = torch.tensor(PROMPTS, dtype=torch.float64, device=device)
    ell_bound = n * logp_bound + n * U * ell.abs()
    loss_bound = ((OPTIONS["qkl_coef"] * STEEPEST_QKL_SLOPE + 1) * float(ell_bound.max())
                  + LOGSOFTMAX * abs(oracle.item()))
    errors = {"token_logp": error_over_bound(ours.token_logp[scored], logp[scored], logp_bound),
              "query_logp": error_over_bound(ours.query_logp, ell, ell_bound),
              "loss": error_over_bound(ours.loss.detach(), oracle.detach(), loss_bound)}
    for name, bound in read_bounds.items():
        errors[f"d {name}"] = error_over_bound(our_read[name], exact[name].grad, bound)
    assert our_grads.keys() == oracle_grads.keys() == {name for name, _ in model.named_parameters()}
    if precision == "autocast":
        for name, want in oracle_grads.items():
            errors[name] = float((our_grads[name].double() - want.double()).norm()
                                 / (BF16_ULP * want.double().norm()))
    return errors


# The torch backend (CPU users' "auto") in every family x layout x path under autocast; the Triton kernels (GPU
# users'), which the interpreter runs about 30 times slower, in each family x path, in a layout per pair such that
# each path meets all three layouts and each family two. bf16 weights (erpo train's default on CUDA) for the fused
# path, whose kernels then run on bf16 operands: every family on the torch backend, Gemma-2 (tied, capped) on Triton.
TRITON_LAYOUT = {("qwen2", "logits"): "left-padded", ("qwen2", "fused"): "packed",
                 ("llama", "logits"): "right-padded", ("llama", "fused"): "left-padded",
                 ("gemma2", "logits"): "packed", ("gemma2", "fused"): "right-padded",
                 ("qwen3-moe", "logits"): "left-padded", ("qwen3-moe", "fused"): "right-padded"}
MATRIX = [(family, layout, path, "torch", "autocast") for family in FAMILIES for layout in LAYOUTS
          for path in ("logits", "fused")]
MATRIX += [(family, layout, path, "triton", "autocast") for (family, path), layout in TRITON_LAYOUT.items()]
MATRIX += [(family, TRITON_LAYOUT[family, "fused"], "fused", "torch", "bf16") for family in FAMILIES]
MATRIX += [("gemma2", TRITON_LAYOUT["gemma2", "fused"], "fused", "triton", "bf16")]


@pytest.mark.parametrize("family, layout, path, backend, precision", MATRIX,
                         ids=["-".join(case) for case in MATRIX])
def test_loss_and_every_parameter_gradient_match_the_plain_formula(family, layout, path, backend, precision, device):
    drift = case_of(family, layout, precision, device).drift
    signs = torch.tensor(DRIFT_SIGNS, dtype=drift.dtype, device=device)
    assert (drift.abs() > 10).all() and torch.equal(drift.sign(), -signs)
    errors = errors_against_the_plain_formula(family, layout, path, backend, precision, device)
    beyond = {name: round(error, 3) for name, error in errors.items() if not error <= 1}
    assert not beyond, f"beyond their bounds (error / bound): {beyond}"
