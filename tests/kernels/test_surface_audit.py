"""The public entry points on the inputs real callers pass, against the plain formula or the torch reference, on both
backends: views of the logits / hidden / lm_head (a padded vocabulary's slice, a transposed or sliced weight),
strided per-sample and per-row tensors, integer rows of other dtypes, other float dtypes of the loss's tensors, empty
batches, and the in-place backward's limits (a second backward, an expanded tensor). Each guards a silent wrong
answer found by the surface audit of 2026-11-28 or pins a contract of docs/API.md."""
import pytest
import torch

from erpo_kernels import erpo_loss, fused_linear_erpo_loss, logprob_erpo_loss, token_logprobs
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
