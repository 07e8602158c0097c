"""The public entry points on the inputs real callers pass, against the plain formula or the torch reference, on both
backends: views of the logits / hidden / lm_head (a padded vocabulary's slice, a transposed or sliced weight),
strided per-sample and per-row tensors, integer rows of other dtypes, other float dtypes of the loss's tensors, empty
batches, and the in-place backward's limits (a second backward, an expanded tensor). Each guards a silent wrong
answer found by the surface audit of 2026-11-28 or pins a contract of docs/API.md."""
import numpy as np
import pytest
import torch

from erpo_kernels import (
    api,
    erpo_loss,
    fused_linear_erpo_loss,
    fused_linear_token_logprobs,
    logprob_erpo_loss,
    query_weights,
    token_logprobs,
)
from helpers import loss_inputs, random_batch

BACKENDS = ["torch", "triton"]
INPLACE_ERROR = "modified by an inplace operation"


def plain_logprobs(logits, targets):
    """log_softmax + gather in float64: the formula itself (0 where the target is -100)."""
    logp = torch.log_softmax(logits.double(), -1).gather(1, targets.long().clamp_min(0)[:, None])[:, 0]
    return torch.where(targets == -100, torch.zeros_like(logp), logp)


def loss_and_grad(logits, batch, backend, **extra):
    """erpo_loss and d loss / d logits on `logits` (a leaf copy, so any view stays as the caller holds it)."""
    leaf = logits.detach().clone() if logits.is_contiguous() else logits.detach()
    leaf.requires_grad_(True)
    tensors = {**loss_inputs(batch), **extra}
    out = erpo_loss(leaf, batch["targets"], batch["token_kind"], batch["sample_index"], backend=backend,
                    qkl_coef=0.1, **tensors)
    out.loss.backward()
    return out, leaf.grad


# -- the in-place backward -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["token_logprobs", "erpo_loss"])
def test_a_second_backward_after_the_in_place_one_is_refused_not_wrong(entry, device):
    """The in-place backward writes d logits over the logits it saved: a second backward through the graph
    (retain_graph) read those d logits as logits and returned a wrong gradient without an error (0.2 to 0.4 off).
    Now the logits' version counter moves as with any in-place op, and autograd refuses with its own error; the
    out-of-place backward still gives twice the gradient."""
    batch = random_batch(num_rows=24, vocab=29, device=device)

    def backward_twice(inplace: bool):
        leaf = batch["logits"].clone().requires_grad_(True)
        logits = leaf * 1.0  # a non-leaf, as a model's logits
        if entry == "token_logprobs":
            loss = token_logprobs(logits, batch["targets"], backend="triton", inplace_backward=inplace).sum()
        else:
            loss = erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend="triton",
                             inplace_backward=inplace, **loss_inputs(batch)).loss
        loss.backward(retain_graph=True)
        first = leaf.grad.clone()
        loss.backward()
        return first, leaf.grad

    first, twice = backward_twice(inplace=False)
    torch.testing.assert_close(twice, 2 * first, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        backward_twice(inplace=True)


def test_an_op_that_saved_the_logits_refuses_them_after_the_in_place_backward(device):
    """Another op that saved the logits for its own backward, run after the in-place one, would read d logits:
    autograd now refuses (the version counter), where it computed with them before."""
    batch = random_batch(num_rows=12, vocab=17, device=device)
    leaf = batch["logits"].clone().requires_grad_(True)
    logits = leaf * 1.0
    squares = (logits * logits).sum()  # saves the logits; made first, so its backward runs after logp's
    loss = token_logprobs(logits, batch["targets"], backend="triton", inplace_backward=True).sum() + squares
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        loss.backward()


@pytest.mark.parametrize("entry", ["token_logprobs", "erpo_loss"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_in_place_backward_refuses_logits_whose_elements_share_memory(entry, backend, device):
    """An expanded tensor's rows are one memory: d logits written over them overwrote each other (a gradient 9 off,
    no error). inplace_backward=True on such logits is now a one-line ValueError; without it they are fine."""
    batch = random_batch(num_rows=12, vocab=17, device=device)
    row = batch["logits"][:1].clone().requires_grad_(True)

    def call(inplace: bool):
        logits = (row * 1.0).expand(12, 17)
        if entry == "token_logprobs":
            return token_logprobs(logits, batch["targets"], backend=backend, inplace_backward=inplace).sum()
        return erpo_loss(logits, batch["targets"], batch["token_kind"], batch["sample_index"], backend=backend,
                         inplace_backward=inplace, **loss_inputs(batch)).loss

    with pytest.raises(ValueError, match=r"^inplace_backward=True writes d logits into logits, but their elements "
                                         r"share memory \(stride \(0, 1\) for shape \(12, 17\)"):
        call(inplace=True)
    (grad,) = torch.autograd.grad(call(inplace=False), row)
    whole = row.detach().expand(12, 17).contiguous().requires_grad_(True)
    if entry == "token_logprobs":
        expected = token_logprobs(whole, batch["targets"], backend="torch").sum()
    else:
        expected = erpo_loss(whole, batch["targets"], batch["token_kind"], batch["sample_index"], backend="torch",
                             **loss_inputs(batch)).loss
    (whole_grad,) = torch.autograd.grad(expected, whole)
    torch.testing.assert_close(grad, whole_grad.sum(0, keepdim=True), rtol=1e-5, atol=1e-6)


def test_the_logits_are_checked_once_with_the_in_place_backward(monkeypatch, device):
    """The logits' checks and the in-place backward's are one step, called once per call with the call's
    inplace_backward (they were two functions called side by side at both call sites); it refuses what each refused."""
    batch = random_batch(num_rows=6, vocab=11, device=device)
    calls = []
    check = api.check_logits
    monkeypatch.setattr(api, "check_logits", lambda logits, inplace_backward: calls.append(inplace_backward) or check(
        logits, inplace_backward))
    token_logprobs(batch["logits"], batch["targets"], backend="torch", inplace_backward=True)
    erpo_loss(batch["logits"], batch["targets"], batch["token_kind"], batch["sample_index"], backend="torch",
              **loss_inputs(batch))
    assert calls == [True, False]
    expanded = batch["logits"][:1].expand(6, 11)
    check(expanded, False)
    with pytest.raises(ValueError, match=r"^inplace_backward=True writes d logits into logits"):
        check(expanded, True)
    with pytest.raises(TypeError, match=r"^logits must be float32, bfloat16 or float16, got torch.float64$"):
        check(batch["logits"].double(), True)


# -- the loss's constants ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["logits", "logprobs", "fused"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_gradient_reaches_the_loss_s_constant_tensors(path, backend, device):
    """advantages, ref_query_logp, query_weight, old_logp, ref_logp, token_weight and rollout_logp are constants
    (TRL's habit: advantages and old / reference log-probs carry no gradient). The torch reference differentiated
    through them (a critic's advantages that required grad got a gradient from the actor's loss) where the Triton
    path did not: now no backend does, and the gradient with respect to the logits is unchanged."""
    batch = random_batch(num_rows=24, vocab=29, device=device)
    names = ("advantages", "ref_query_logp", "query_weight", "old_logp", "ref_logp", "token_weight", "rollout_logp")
    values = {**loss_inputs(batch), "token_weight": torch.rand(24, device=device),
              "rollout_logp": batch["old_logp"] - 0.1}
    hidden = torch.randn(24, 16, device=device)
    weight = torch.randn(29, 16, device=device) * 0.3

    def loss(tensors):
        source = (hidden if path == "fused" else batch["logits"]).clone().requires_grad_(True)
        rows = (batch["token_kind"], batch["sample_index"])
        options = dict(backend=backend, qkl_coef=0.1, policy_kl_coef=0.05, **tensors)
        if path == "logits":
            out = erpo_loss(source, batch["targets"], *rows, **options)
        elif path == "logprobs":
            logp, entropy = token_logprobs(source, batch["targets"].where(batch["token_kind"] != 0, -100),
                                           return_entropy=True, backend="torch")
            out = logprob_erpo_loss(logp, *rows, entropy=entropy, **options)
        else:
            out = fused_linear_erpo_loss(source, weight, batch["targets"], *rows, **options)
        return out.loss, source

    constants = {name: values[name].clone().requires_grad_(True) for name in names}
    value, source = loss(constants)
    grads = torch.autograd.grad(value, [source, *constants.values()], allow_unused=True)
    assert [name for name, grad in zip(names, grads[1:]) if grad is not None] == []
    detached_value, detached_source = loss(values)
    (expected,) = torch.autograd.grad(detached_value, detached_source)
    assert torch.equal(value.detach(), detached_value.detach()) and torch.equal(grads[0], expected)


# -- views, strides and dtypes: what held, pinned --------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_that_are_views_give_the_formula_s_values_and_gradients(backend, device):
    """A padded vocabulary's slice (Qwen's 152064 columns, its tokenizer's fewer: row stride != V), a storage offset,
    a transposed tensor: token_logprobs is log_softmax + gather, and erpo_loss and its gradient are those on the
    contiguous copy."""
    batch = random_batch(num_rows=20, vocab=37, device=device)
    padded = torch.randn(20, 48, device=device) * 3
    views = {"vocab slice": padded[:, :37], "offset": padded.flatten()[5:5 + 20 * 37].view(20, 37),
             "transposed": padded[:, :37].t().contiguous().t()}
    for name, view in views.items():
        logp = token_logprobs(view, batch["targets"], backend=backend)
        torch.testing.assert_close(logp.double(), plain_logprobs(view, batch["targets"]), rtol=1e-5, atol=1e-5,
                                   msg=name)
        out, grad = loss_and_grad(view, batch, backend)
        ref, ref_grad = loss_and_grad(view.contiguous(), batch, "torch")
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hidden_and_lm_head_views_give_the_logits_path_s_values(backend, device):
    """The fused-linear path on a transposed lm_head (stored [D, V]) and a slice of a padded vocabulary's rows, with
    hidden states as `hidden[:, :-1]` of [B, T, D] reshaped: the values and
    gradients of erpo_loss on the materialized logits."""
    batch = random_batch(num_rows=24, vocab=29, device=device)
    g = torch.Generator().manual_seed(1)
    base_hidden = torch.randn(2, 13, 16, generator=g).to(device)
    weights = {"transposed": (torch.randn(16, 29, generator=g) * 0.3).to(device).t(),
               "padded vocabulary's rows": (torch.randn(40, 16, generator=g) * 0.3).to(device)[:29]}
    hidden = base_hidden[:, :-1].reshape(24, 16)
    for name, weight in weights.items():
        h, w = hidden.clone().requires_grad_(True), weight.detach().requires_grad_(True)
        out = fused_linear_erpo_loss(h, w, batch["targets"], batch["token_kind"], batch["sample_index"],
                                     backend=backend, qkl_coef=0.1, **loss_inputs(batch))
        out.loss.backward()
        rh, rw = hidden.clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
        ref = erpo_loss(rh @ rw.t(), batch["targets"], batch["token_kind"], batch["sample_index"], backend="torch",
                        qkl_coef=0.1, **loss_inputs(batch))
        ref.loss.backward()
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(h.grad, rh.grad, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(w.grad, rw.grad, rtol=1e-4, atol=1e-5, msg=name)
        logp = fused_linear_token_logprobs(hidden, weight, batch["targets"], backend=backend)
        torch.testing.assert_close(logp.double(), plain_logprobs(hidden @ weight.t(), batch["targets"]), rtol=1e-5,
                                   atol=1e-5, msg=name)


def strided(tensor):
    """The same values as a column of a [n, 2] tensor: stride 2, storage offset 1."""
    return torch.stack([torch.full_like(tensor, 7), tensor], 1)[:, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_and_other_dtypes_give_the_same_loss(backend, device):
    """The [S] and [N] tensors as strided views (a column of a wider tensor), the rows as int32 / uint8, advantages
    in float64 or bfloat16 (cast to the loss's fp32 as the reference does): the loss of the contiguous int64 / fp32
    call, bit for bit on one backend."""
    batch = random_batch(num_rows=24, vocab=29, device=device)
    extra = {"token_weight": torch.rand(24, device=device), "rollout_logp": batch["old_logp"] - 0.1}
    tensors = {**loss_inputs(batch), **extra}
    rows = (batch["targets"], batch["token_kind"], batch["sample_index"])

    def loss(rows, tensors):
        return erpo_loss(batch["logits"], *rows, backend=backend, qkl_coef=0.1, policy_kl_coef=0.05,
                         **tensors).loss
    expected = loss(rows, tensors)
    cases = {"strided tensors": (rows, {name: strided(t) for name, t in tensors.items()}),
             "strided int32 rows": (tuple(strided(t.int()) for t in rows), tensors),
             "uint8 kind and sample": ((rows[0], rows[1].to(torch.uint8), rows[2].to(torch.uint8)), tensors),
             "float64 tensors": (rows, {name: t.double() for name, t in tensors.items()})}
    for name, (case_rows, case_tensors) in cases.items():
        assert torch.equal(loss(case_rows, case_tensors), expected), name
    bf16 = {**tensors, "advantages": tensors["advantages"].bfloat16()}
    torch.testing.assert_close(loss(rows, bf16), loss(rows, {**tensors, "advantages": bf16["advantages"].float()}),
                               rtol=0, atol=0)


# -- empty batches: the contract docs/API.md writes -------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"top_entropy_quantile": 0.5}], ids=["defaults", "entropy-filter"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_without_rows_is_a_zero_loss_as_torch_sum_of_nothing(backend, options, device):
    """N = 0 (an empty micro-batch), or rows that score nothing: the loss is 0 (sums over no rows, as torch.sum of
    an empty tensor; the means divide by max(count, 1), as TRL's masked means), its gradient zero, the [N] outputs
    empty, the [S] outputs and the metrics 0; token_logprobs returns empty [0] vectors. With the entropy filter the
    Triton threshold's kernel read one element of the empty tensor (a segmentation fault in the interpreter, an
    out-of-bounds read on a GPU); it reads nothing now."""
    empty = torch.zeros(0, dtype=torch.long, device=device)
    logits = torch.randn(0, 11, device=device, requires_grad=True)
    logp, entropy = token_logprobs(logits, empty, return_entropy=True, backend=backend)
    assert logp.shape == entropy.shape == (0,) and logp.dtype == entropy.dtype == torch.float32
    out = erpo_loss(logits, empty, empty, empty, advantages=torch.ones(2, device=device),
                    ref_query_logp=torch.full((2,), -3.0, device=device), ref_logp=torch.zeros(0, device=device),
                    policy_kl_coef=0.1, backend=backend, **options)
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert out.loss.item() == 0 and grad.shape == (0, 11) and out.token_logp.shape == (0,)
    assert out.query_logp.tolist() == [0.0, 0.0] and out.response_logp.tolist() == [0.0, 0.0]
    assert {name: value.item() for name, value in out.metrics.items()} == dict.fromkeys(out.metrics, 0)
    batch = random_batch(num_rows=12, vocab=11, device=device)
    unscored = torch.zeros_like(batch["token_kind"])
    leaf = batch["logits"].clone().requires_grad_(True)
    out = erpo_loss(leaf, batch["targets"], unscored, batch["sample_index"], backend=backend, **loss_inputs(batch),
                    **options)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    assert out.loss.item() == 0 and torch.equal(grad, torch.zeros_like(grad))
    assert {name: value.item() for name, value in out.metrics.items()} == dict.fromkeys(out.metrics, 0)


def test_an_empty_query_s_weight_is_the_clip_whatever_the_sign_of_its_zero(device):
    """A query whose cached ell_theta0 is 0 (a one-token prompt, whose first token nothing predicts: a sum over no
    rows, +0.0) has surprisal 0 and weight clip(mean / 0, 0, 2) = 2. The weight was formed from -ell, -0.0 for
    +0.0: mean / -0.0 = -inf, clipped to 0, so such a prompt's policy gradient was dropped (2 for an ell of -0.0)."""
    for zero in (0.0, -0.0):
        ell = torch.tensor([-3.0, -6.0, zero], device=device)
        for validate in (True, False):
            weights = query_weights(ell, validate=validate)
            torch.testing.assert_close(weights, torch.tensor([1.0, 0.5, 2.0], device=device), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_scalar_options_are_the_numbers_they_hold(backend, device):
    """An option computed with numpy (np.float64 subclasses float, so the checks took it) reached the fused-linear
    path's option string as 'np.float64(0.1)' and failed in ast.literal_eval with a traceback naming no argument;
    np.float32 / np.int64 were refused as not numbers. Every option and the logit transform now hold the Python
    number (validation.plain_number): the loss of the Python floats, on the logits and fused-linear paths."""
    batch = random_batch(num_rows=16, vocab=19, device=device)
    hidden = torch.randn(16, 8, device=device)
    weight = torch.randn(19, 8, device=device) * 0.3
    numpy_options = {"clip_low": np.float64(0.1), "qkl_coef": np.float32(0.25), "num_items": np.int64(7),
                     "temperature": np.float64(0.7)}
    python_options = {name: value.item() for name, value in numpy_options.items()}
    rows = (batch["targets"], batch["token_kind"], batch["sample_index"])
    for options in (numpy_options, python_options):
        fused = fused_linear_erpo_loss(hidden, weight, *rows, backend=backend, **loss_inputs(batch), **options)
        logits = erpo_loss(hidden @ weight.t(), *rows, backend=backend, **loss_inputs(batch), **options)
        logp = token_logprobs(batch["logits"], batch["targets"], temperature=options["temperature"], backend=backend)
        if options is numpy_options:
            expected = (fused.loss, logits.loss, logp)
    assert torch.equal(fused.loss, expected[0]) and torch.equal(logits.loss, expected[1])
    assert torch.equal(logp, expected[2])
