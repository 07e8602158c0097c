"""padded_erpo_loss and FusedLinearERPOLoss on [B, T] batches in TRL's layout: the values and gradients of the packed
erpo_loss on the same data (rows placed by hand here), both the logits and the hidden paths, any padding width,
and one-line errors on bad shapes."""
import pytest
import torch

from erpo_kernels import FusedLinearERPOLoss, erpo_loss, from_padded, padded_erpo_loss

B, P, C, V, D = 3, 5, 6, 17, 8
T = P + C
OPTIONS = dict(qkl_coef=0.1, policy_kl_coef=0.05, entropy_coef=0.01, backend="torch")


def trl_batch(seed=0):
    """Left-padded prompts, right-padded completions, a tool output inside sample 2's completion, and every
    completion-aligned tensor."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 4:] = 0
    tool_mask = torch.ones(B, C, dtype=torch.long)
    tool_mask[2, 2:4] = 0
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float32)
    weight = torch.randn(V, D, generator=g, dtype=torch.float32)
    bias = torch.randn(V, generator=g, dtype=torch.float32)
    logp_guess = -torch.rand(B, C, generator=g) * 3 - 0.5
    return dict(prompt_ids=torch.randint(0, V, (B, P), generator=g), prompt_mask=prompt_mask,
                completion_ids=torch.randint(0, V, (B, C), generator=g), completion_mask=completion_mask,
                tool_mask=tool_mask, hidden=hidden, weight=weight, bias=bias,
                advantages=torch.tensor([1.0, -0.5, 0.3]), ref_query_logp=torch.tensor([-9.0, -12.0, -10.0]),
                old_logp=logp_guess + 0.2 * torch.randn(B, C, generator=g),
                ref_logp=logp_guess + 0.2 * torch.randn(B, C, generator=g))


def batch_inputs(data):
    return {k: data[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask",
                                 "advantages", "ref_query_logp", "old_logp", "ref_logp")}


def logits_of(data):
    return data["hidden"] @ data["weight"].T + data["bias"]


def packed_reference(data, logits):
    """erpo_loss on every [B * T] position, the completion-aligned tensors placed on their rows by hand."""
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
    attention = torch.cat([data["prompt_mask"], data["completion_mask"]], dim=1)
    response = torch.cat([torch.zeros(B, P, dtype=torch.long), data["completion_mask"] * data["tool_mask"]], dim=1)
    rows = from_padded(input_ids, attention, response)
    old, ref = torch.zeros(B * T), torch.zeros(B * T)
    for b in range(B):
        for j in range(C):   # completion token j of sample b is predicted at position P + j - 1
            old[b * T + P + j - 1], ref[b * T + P + j - 1] = data["old_logp"][b, j], data["ref_logp"][b, j]
    out = erpo_loss(logits.reshape(B * T, V), rows.targets, rows.token_kind, rows.sample_index,
                    advantages=data["advantages"], ref_query_logp=data["ref_query_logp"], old_logp=old, ref_logp=ref,
                    **OPTIONS)
    completion_rows = torch.arange(B)[:, None] * T + P - 1 + torch.arange(C)[None, :]
    scored = (data["completion_mask"] * data["tool_mask"]).bool()
    return out, torch.where(scored, out.token_logp[completion_rows], 0.0)


def test_logits_path_equals_the_packed_loss_values_and_gradients():
    data = trl_batch()
    logits = logits_of(data).detach().requires_grad_()
    out = padded_erpo_loss(logits=logits, **batch_inputs(data), **OPTIONS)
    out.loss.backward()
    packed_logits = logits.detach().clone().requires_grad_()
    expected, expected_token_logp = packed_reference(data, packed_logits)
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(logits.grad, packed_logits.grad)
    torch.testing.assert_close(out.token_logp, expected_token_logp)
    torch.testing.assert_close(out.query_logp, expected.query_logp)
    torch.testing.assert_close(out.response_logp, expected.response_logp)
    assert out.token_logp.shape == out.entropy.shape == (B, C)
    assert out.token_logp[2, 2:4].eq(0).all() and out.entropy[1, 4:].eq(0).all()   # tool output, padding
    assert out.metrics.keys() == expected.metrics.keys()


def test_hidden_path_equals_the_logits_path_values_and_gradients():
    data = trl_batch(seed=1)
    hidden, weight, bias = (data[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    fused = padded_erpo_loss(hidden=hidden, weight=weight, bias=bias, **batch_inputs(data), **OPTIONS)
    fused.loss.backward()
    leaves = [data[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    plain = padded_erpo_loss(logits=leaves[0] @ leaves[1].T + leaves[2], **batch_inputs(data), **OPTIONS)
    plain.loss.backward()
    torch.testing.assert_close(fused.loss, plain.loss)
    torch.testing.assert_close(fused.token_logp, plain.token_logp)
    for ours, theirs in zip((hidden, weight, bias), leaves):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_full_sequences_and_wider_padding_give_the_same_loss():
    """The full-sequence form equals the prompt/completion form, and two more padding columns on each side
    (holding NaN logits) change nothing."""
    data = trl_batch(seed=2)
    logits = logits_of(data)
    reference = padded_erpo_loss(logits=logits, **batch_inputs(data), **OPTIONS)
    inputs = batch_inputs(data)
    full = dict(input_ids=torch.cat([inputs.pop("prompt_ids"), inputs.pop("completion_ids")], dim=1),
                attention_mask=torch.cat([inputs.pop("prompt_mask"), data["completion_mask"]], dim=1))
    torch.testing.assert_close(padded_erpo_loss(logits=logits, **full, **inputs, **OPTIONS).loss, reference.loss)

    def widen(x, value=0):   # two columns before the prompt and two after the completion
        pad = torch.full((B, 2, *x.shape[2:]), value, dtype=x.dtype)
        return torch.cat([pad, x, pad], dim=1)

    wide = dict(batch_inputs(data), prompt_ids=widen(data["prompt_ids"])[:, :P + 2],
                prompt_mask=widen(data["prompt_mask"])[:, :P + 2])
    for name in ("completion_ids", "completion_mask", "tool_mask", "old_logp", "ref_logp"):
        wide[name] = widen(data[name])[:, 2:]
    out = padded_erpo_loss(logits=widen(logits, float("nan")), **wide, **OPTIONS)
    torch.testing.assert_close(out.loss, reference.loss)
    torch.testing.assert_close(out.token_logp[:, :C], reference.token_logp)
    assert out.token_logp[:, C:].eq(0).all()


def test_fused_linear_module_in_ligers_order_equals_padded_erpo_loss():
    data = trl_batch(seed=3)
    module = FusedLinearERPOLoss(**OPTIONS)
    out = module(data["hidden"], data["weight"], data["completion_ids"], data["completion_mask"], data["advantages"],
                 data["bias"], data["ref_logp"], data["old_logp"], prompt_ids=data["prompt_ids"],
                 prompt_mask=data["prompt_mask"], ref_query_logp=data["ref_query_logp"], tool_mask=data["tool_mask"])
    expected = padded_erpo_loss(hidden=data["hidden"], weight=data["weight"], bias=data["bias"],
                                **batch_inputs(data), **OPTIONS)
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(out.token_logp, expected.token_logp)


def test_fused_linear_module_ligers_completion_layout_and_reference_input():
    """Without the prompt (qkl_coef=0), _input is Liger's [B, C, D] (position j predicts completion token j); the
    reference's log-probs come from ref_input / ref_weight when ref_per_token_logps is None."""
    data = trl_batch(seed=4)
    options = dict(OPTIONS, qkl_coef=0.0)
    g = torch.Generator().manual_seed(5)
    ref_hidden = torch.randn(B, C, D, generator=g, dtype=torch.float32)
    ref_weight = torch.randn(V, D, generator=g, dtype=torch.float32)
    completion_hidden = data["hidden"][:, P - 1:T - 1]
    mask = data["completion_mask"]
    out = FusedLinearERPOLoss(**options)(completion_hidden, data["weight"], data["completion_ids"], mask,
                                         data["advantages"], data["bias"], None, data["old_logp"],
                                         ref_hidden, ref_weight, None)
    ref_logp = torch.log_softmax(ref_hidden @ ref_weight.T, dim=-1).gather(
        2, data["completion_ids"].unsqueeze(2)).squeeze(2) * mask
    inputs = dict(batch_inputs(data), ref_logp=ref_logp, tool_mask=None)
    expected = padded_erpo_loss(hidden=data["hidden"], weight=data["weight"], bias=data["bias"],
                                **inputs, **options)
    torch.testing.assert_close(out.loss, expected.loss)   # no Query-KL: the prompt rows change nothing
    torch.testing.assert_close(out.token_logp, expected.token_logp)
    assert out.metrics["policy_kl"] != 0


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(logits=d["logits"][:, 1:]), "logits must have shape [B, T, *] with [B, T] = (3, 11)"),
    (lambda d: d.update(old_logp=d["old_logp"][:, 1:]), "old_logp must be completion-aligned"),
    (lambda d: d.update(input_ids=d["prompt_ids"]), "pass either prompt_ids, prompt_mask and completion_ids"),
    (lambda d: d.update(prompt_mask=d["prompt_mask"][:2]), "prompt_mask must have prompt_ids' shape"),
    (lambda d: d.update(tool_mask=d["tool_mask"][:, :2]), "tool_mask must have completion_mask's shape"),
    (lambda d: d.update(hidden=d["logits"]), "pass either logits [B, T, V], or hidden"),
    (lambda d: d.update(qkl_estimator="k3-token"), "qkl_estimator='k3-token' needs reference log-probs"),
    (lambda d: d.update(qkl_coeff=0.1), "did you mean 'qkl_coef'?"),
])
def test_bad_input_is_one_line(change, message):
    data = trl_batch()
    inputs = dict(batch_inputs(data), logits=logits_of(data), **OPTIONS)
    change(inputs)
    with pytest.raises((ValueError, TypeError)) as error:
        padded_erpo_loss(**inputs)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_fused_linear_module_refuses_the_query_kl_without_the_prompt():
    data = trl_batch()
    with pytest.raises(ValueError, match="the Query-KL .* needs the prompt"):
        FusedLinearERPOLoss(backend="torch")(data["hidden"][:, P - 1:T - 1], data["weight"], data["completion_ids"],
                                             data["completion_mask"], data["advantages"])


def test_fused_linear_module_refuses_a_reference_input_of_other_positions():
    data = trl_batch()
    with pytest.raises(ValueError, match=r"ref_input must have _input's shape \(3, 11, 8\)"):
        FusedLinearERPOLoss(backend="torch", policy_kl_coef=0.1)(
            data["hidden"], data["weight"], data["completion_ids"], data["completion_mask"], data["advantages"],
            None, None, None, data["hidden"][:, 1:], data["weight"], prompt_ids=data["prompt_ids"],
            prompt_mask=data["prompt_mask"], ref_query_logp=data["ref_query_logp"])
