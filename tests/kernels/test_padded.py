"""padded_erpo_loss and FusedLinearERPOLoss on [B, T] batches in TRL's layout: the values and gradients of the packed
erpo_loss on the same data (rows placed by hand here), both the logits and the hidden paths, any padding width,
and one-line errors on bad shapes."""
import pytest
import torch

from erpo_kernels import (
    FusedLinearERPOLoss,
    completion_layout,
    erpo_loss,
    from_padded,
    fused_linear_erpo_loss,
    padded_erpo_loss,
)
from helpers import assert_compiled_equals_eager
from launch_counts import LaunchCounter

B, P, C, V, D = 3, 5, 6, 17, 8
T = P + C
OPTIONS = dict(qkl_coef=0.1, policy_kl_coef=0.05, entropy_coef=0.01, backend="torch")


def trl_batch(*, device, seed=0):
    """Left-padded prompts, right-padded completions, a tool output inside sample 2's completion, and every
    completion-aligned tensor, on `device`."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(B, P, dtype=torch.long, device=device)
    prompt_mask[0, :2] = 0
    completion_mask = torch.ones(B, C, dtype=torch.long, device=device)
    completion_mask[1, 4:] = 0
    tool_mask = torch.ones(B, C, dtype=torch.long, device=device)
    tool_mask[2, 2:4] = 0
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float32).to(device)
    weight = torch.randn(V, D, generator=g, dtype=torch.float32).to(device)
    bias = torch.randn(V, generator=g, dtype=torch.float32).to(device)
    logp_guess = -torch.rand(B, C, generator=g).to(device) * 3 - 0.5
    return dict(prompt_ids=torch.randint(0, V, (B, P), generator=g).to(device), prompt_mask=prompt_mask,
                completion_ids=torch.randint(0, V, (B, C), generator=g).to(device), completion_mask=completion_mask,
                tool_mask=tool_mask, hidden=hidden, weight=weight, bias=bias,
                advantages=torch.tensor([1.0, -0.5, 0.3], device=device),
                ref_query_logp=torch.tensor([-9.0, -12.0, -10.0], device=device),
                old_logp=logp_guess + 0.2 * torch.randn(B, C, generator=g).to(device),
                ref_logp=logp_guess + 0.2 * torch.randn(B, C, generator=g).to(device))


def batch_inputs(data):
    return {k: data[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask",
                                 "advantages", "ref_query_logp", "old_logp", "ref_logp")}


def logits_of(data):
    return data["hidden"] @ data["weight"].T + data["bias"]


def packed_reference(data, logits):
    """erpo_loss on every [B * T] position, the completion-aligned tensors placed on their rows by hand."""
    device = logits.device
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
    attention = torch.cat([data["prompt_mask"], data["completion_mask"]], dim=1)
    response = torch.cat([torch.zeros(B, P, dtype=torch.long, device=device),
                          data["completion_mask"] * data["tool_mask"]], dim=1)
    rows = from_padded(input_ids, attention, response)
    old, ref = torch.zeros(B * T, device=device), torch.zeros(B * T, device=device)
    for b in range(B):
        for j in range(C):   # completion token j of sample b is predicted at position P + j - 1
            old[b * T + P + j - 1], ref[b * T + P + j - 1] = data["old_logp"][b, j], data["ref_logp"][b, j]
    out = erpo_loss(logits.reshape(B * T, V), rows.targets, rows.token_kind, rows.sample_index,
                    advantages=data["advantages"], ref_query_logp=data["ref_query_logp"], old_logp=old, ref_logp=ref,
                    **OPTIONS)
    completion_rows = torch.arange(B, device=device)[:, None] * T + P - 1 + torch.arange(C, device=device)[None, :]
    scored = (data["completion_mask"] * data["tool_mask"]).bool()
    return out, torch.where(scored, out.token_logp[completion_rows], 0.0)


def test_logits_path_equals_the_packed_loss_values_and_gradients(device):
    data = trl_batch(device=device)
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


LAYOUTS = {   # changes to trl_batch's (left-padded prompts, right-padded completions, a tool output in sample 2)
    "left and right padding, a tool output": lambda d: None,
    "no tool_mask": lambda d: d.update(tool_mask=None),
    "a completion all padding": lambda d: d["completion_mask"][1].zero_(),
    "every completion empty": lambda d: d["completion_mask"].zero_(),
    "an empty prompt": lambda d: d["prompt_mask"][2].zero_(),
}


def scored_rows_alone(data, path, leaves, **options):
    """The loss on the scored rows alone, selected by hand with boolean masks (what padded_erpo_loss did before it
    kept every position on the logits path), and its token_logp, entropy [B, C] placed back."""
    device = leaves[0].device
    tool = torch.ones_like(data["completion_mask"]) if data["tool_mask"] is None else data["tool_mask"]
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
    attention = torch.cat([data["prompt_mask"], data["completion_mask"]], dim=1)
    response = torch.cat([torch.zeros(B, P, dtype=torch.long, device=device), data["completion_mask"] * tool], dim=1)
    rows = from_padded(input_ids, attention, response)
    scored = rows.token_kind != 0
    aligned = {}
    for name in ("old_logp", "ref_logp"):
        full = torch.zeros(B, T, device=device)
        full[:, P - 1:T - 1] = data[name]
        aligned[name] = full.reshape(-1)[scored]
    packed = (rows.targets[scored], rows.token_kind[scored], rows.sample_index[scored])
    tensors = dict(advantages=data["advantages"], ref_query_logp=data["ref_query_logp"], **aligned, **options)
    if path == "logits":
        out = erpo_loss(leaves[0].reshape(B * T, V)[scored], *packed, **tensors)
    else:
        out = fused_linear_erpo_loss(leaves[0].reshape(B * T, D)[scored], leaves[1], *packed, bias=leaves[2],
                                     **tensors)

    def placed(values):
        full = torch.zeros(B * T, device=device)
        full[scored] = values
        return full.reshape(B, T)[:, P - 1:T - 1]
    return out, placed(out.token_logp), placed(out.entropy)


def leaves_of(data, path):
    if path == "logits":
        return [logits_of(data).detach().requires_grad_()]
    return [data[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]


@pytest.mark.parametrize("path", ["logits", "hidden"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_position_as_a_row_equals_the_scored_rows_alone(layout, backend, path, device):
    """The logits path keeps all B * T positions as rows (kind 0 where nothing is scored), the fused-linear path
    selects the scored rows. Per-row values are those of the scored rows alone bit for bit, and so is the gradient
    of a token-level loss without the Query-KL (d loss / d logp_t then holds no sum over rows: the row's own terms
    over the response count). Sums over rows (the loss, the metrics, ell_theta(q) and so the Query-KL's gradient, a
    sequence's log-ratio) may differ in the last bits on the logits path: the kernels' reduction order follows the
    rows' positions, which the kind-0 rows shift."""
    data = trl_batch(seed=6, device=device)
    LAYOUTS[layout](data)
    for options, bitwise in ((dict(backend=backend, qkl_coef=0.0), True),
                             (dict(OPTIONS, backend=backend), path == "hidden")):
        leaves, expected_leaves = leaves_of(data, path), leaves_of(data, path)
        model = dict(zip(("logits",) if path == "logits" else ("hidden", "weight", "bias"), leaves))
        out = padded_erpo_loss(**model, **batch_inputs(data), **options)
        out.loss.backward()
        expected, token_logp, entropy = scored_rows_alone(data, path, expected_leaves, **options)
        expected.loss.backward()
        torch.testing.assert_close(out.token_logp, token_logp, rtol=0, atol=0)
        torch.testing.assert_close(out.entropy, entropy, rtol=0, atol=0)
        same = dict(rtol=0, atol=0) if bitwise else dict(rtol=1e-5, atol=1e-6)
        for ours, theirs in zip(leaves, expected_leaves):
            torch.testing.assert_close(ours.grad, theirs.grad, **same)
        torch.testing.assert_close(out.loss, expected.loss, **(same if path == "hidden" else dict(rtol=1e-5,
                                                                                                   atol=1e-6)))
        for name, value in expected.metrics.items():
            torch.testing.assert_close(out.metrics[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_host_reads_follow_validate(path, device):
    """padded_erpo_loss fwd+bwd on the Triton path reads nothing on the host with validate=False on the logits path
    (no selection of the scored rows, no mask check) and once with validate=True: the loss's row checks, and in the
    full-sequence form its mask check with them, in the same read (TRL's prompt/completion form holds the mask check
    by construction). The fused-linear path adds one read, the selection of the scored rows, whose host layout the
    chunk plan reuses (two before 2026-11-26: the plan read the layout again)."""
    data = trl_batch(device=device)
    inputs = batch_inputs(data)
    full = dict(inputs, input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1))
    for name in ("prompt_ids", "prompt_mask", "completion_ids"):
        full.pop(name)
    fused_reads = int(path == "hidden")
    for form, batch in (("prompt/completion", inputs), ("full sequences", full)):
        for validate, reads in ((False, fused_reads), (True, fused_reads + 1)):
            model = dict(zip(("logits",) if path == "logits" else ("hidden", "weight", "bias"), leaves_of(data, path)))
            with LaunchCounter() as counter:
                padded_erpo_loss(**model, **batch, **dict(OPTIONS, backend="triton"), validate=validate).loss.backward()
            assert counter.syncs == reads, (form, validate, counter.sync_names)
            if path == "logits":   # no boolean-mask indexing either (no data-dependent shape)
                assert not {"aten.index", "aten.index_put_", "aten.nonzero"} & set(counter.names), counter.names


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logits_path_compiles_whole(backend, validate, device):
    """No data-dependent shape on the logits path (every position is a row): torch.compile traces the call whole
    (fullgraph; the scored rows' selection made it fail before), its value checks as device-side asserts."""
    data = trl_batch(seed=7, device=device)

    def loss(logits):
        return padded_erpo_loss(logits=logits, **batch_inputs(data), **dict(OPTIONS, backend=backend),
                                validate=validate).loss

    assert_compiled_equals_eager(loss, logits_of(data).detach().requires_grad_(), grad_rtol=1e-5)


def test_completion_layout_rows_scatter_and_gather(device):
    """Every position is a row: targets -100 and kind 0 where nothing is scored; scatter places completion token j's
    value on row P + j - 1 when it is a response row (0 elsewhere), gather reads it back; `scored()` the R scored
    rows alone, in position order."""
    data = trl_batch(device=device)
    layout = completion_layout(**{k: data[k] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                        "completion_mask", "tool_mask")})
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
    attention = torch.cat([data["prompt_mask"], data["completion_mask"]], dim=1)
    response = torch.cat([torch.zeros(B, P, dtype=torch.long, device=device),
                          data["completion_mask"] * data["tool_mask"]], dim=1)
    rows = from_padded(input_ids, attention, response)
    assert torch.equal(layout.targets, rows.targets) and torch.equal(layout.token_kind, rows.token_kind)
    assert torch.equal(layout.sample_index, rows.sample_index)
    scored_response = (data["completion_mask"] * data["tool_mask"]).bool()
    values = torch.arange(1.0, B * C + 1, device=device).reshape(B, C)
    on_rows = layout.scatter(values)
    assert on_rows.shape == (B * T,)
    expected = torch.zeros(B, T, device=device)
    expected[:, P - 1:T - 1] = torch.where(scored_response, values, 0.0)
    assert torch.equal(on_rows, expected.reshape(-1))
    assert torch.equal(layout.gather(on_rows), torch.where(scored_response, values, 0.0))
    scored = layout.scored()
    kept = rows.token_kind != 0
    assert torch.equal(scored.index, kept.nonzero().squeeze(1))
    assert torch.equal(scored.targets, rows.targets[kept]) and torch.equal(scored.token_kind, rows.token_kind[kept])
    assert torch.equal(scored.scatter(values), on_rows[kept])
    assert torch.equal(scored.gather(on_rows[kept]), layout.gather(on_rows))


def test_full_sequences_mask_check_follows_validate(device):
    """With full sequences, completion_mask must lie inside attention_mask's last C columns: one line naming the
    token, with validate=True; validate=False reads nothing and skips it."""
    data = trl_batch(device=device)
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
    attention = torch.cat([data["prompt_mask"], data["completion_mask"]], dim=1)
    attention[1, P + 2] = 0
    masks = dict(input_ids=input_ids, attention_mask=attention, completion_mask=data["completion_mask"])
    with pytest.raises(ValueError, match="completion_mask marks completion token 2 of sample 1, which "
                                         "attention_mask marks as padding"):
        completion_layout(**masks)
    with LaunchCounter() as counter:
        completion_layout(**masks, validate=False)
    assert counter.syncs == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_full_sequences_mask_check_raises_through_the_loss(backend, device):
    """padded_erpo_loss on the logits path reads the full-sequence mask check with the loss's row checks: a
    completion token on padding raises its own message first, even when a row check fails too; validate=False
    skips both."""
    data = trl_batch(device=device)
    inputs = batch_inputs(data)
    attention = torch.cat([inputs.pop("prompt_mask"), inputs["completion_mask"]], dim=1)
    attention[1, P + 2] = 0
    full = dict(inputs, input_ids=torch.cat([inputs.pop("prompt_ids"), inputs.pop("completion_ids")], dim=1),
                attention_mask=attention)
    bad_weight = torch.ones(B, C, device=device)
    bad_weight[0, 1] = -1.0  # a row check fails too
    for extra in ({}, dict(token_weight=bad_weight)):
        with pytest.raises(ValueError, match="completion_mask marks completion token 2 of sample 1, which "
                                             "attention_mask marks as padding"):
            padded_erpo_loss(logits=logits_of(data), **full, **extra, **dict(OPTIONS, backend=backend))
    with pytest.raises(ValueError, match="token_weight must be finite and >= 0 on scored rows"):
        attention[1, P + 2] = 1
        padded_erpo_loss(logits=logits_of(data), **full, token_weight=bad_weight, **dict(OPTIONS, backend=backend))
    attention[1, P + 2] = 0
    padded_erpo_loss(logits=logits_of(data), **full, **dict(OPTIONS, backend=backend), validate=False)


def test_hidden_path_equals_the_logits_path_values_and_gradients(device):
    data = trl_batch(seed=1, device=device)
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


def test_full_sequences_and_wider_padding_give_the_same_loss(device):
    """The full-sequence form equals the prompt/completion form, and two more padding columns on each side
    (holding NaN logits) change nothing."""
    data = trl_batch(seed=2, device=device)
    logits = logits_of(data)
    reference = padded_erpo_loss(logits=logits, **batch_inputs(data), **OPTIONS)
    inputs = batch_inputs(data)
    full = dict(input_ids=torch.cat([inputs.pop("prompt_ids"), inputs.pop("completion_ids")], dim=1),
                attention_mask=torch.cat([inputs.pop("prompt_mask"), data["completion_mask"]], dim=1))
    torch.testing.assert_close(padded_erpo_loss(logits=logits, **full, **inputs, **OPTIONS).loss, reference.loss)

    def widen(x, value=0):   # two columns before the prompt and two after the completion
        pad = torch.full((B, 2, *x.shape[2:]), value, dtype=x.dtype, device=device)
        return torch.cat([pad, x, pad], dim=1)

    wide = dict(batch_inputs(data), prompt_ids=widen(data["prompt_ids"])[:, :P + 2],
                prompt_mask=widen(data["prompt_mask"])[:, :P + 2])
    for name in ("completion_ids", "completion_mask", "tool_mask", "old_logp", "ref_logp"):
        wide[name] = widen(data[name])[:, 2:]
    out = padded_erpo_loss(logits=widen(logits, float("nan")), **wide, **OPTIONS)
    torch.testing.assert_close(out.loss, reference.loss)
    torch.testing.assert_close(out.token_logp[:, :C], reference.token_logp)
    assert out.token_logp[:, C:].eq(0).all()


def test_fused_linear_module_in_ligers_order_equals_padded_erpo_loss(device):
    data = trl_batch(seed=3, device=device)
    module = FusedLinearERPOLoss(**OPTIONS)
    out = module(data["hidden"], data["weight"], data["completion_ids"], data["completion_mask"], data["advantages"],
                 data["bias"], data["ref_logp"], data["old_logp"], prompt_ids=data["prompt_ids"],
                 prompt_mask=data["prompt_mask"], ref_query_logp=data["ref_query_logp"], tool_mask=data["tool_mask"])
    expected = padded_erpo_loss(hidden=data["hidden"], weight=data["weight"], bias=data["bias"],
                                **batch_inputs(data), **OPTIONS)
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(out.token_logp, expected.token_logp)


def test_fused_linear_module_ligers_completion_layout_and_reference_input(device):
    """Without the prompt (qkl_coef=0), _input is Liger's [B, C, D] (position j predicts completion token j); the
    reference's log-probs come from ref_input / ref_weight when ref_per_token_logps is None."""
    data = trl_batch(seed=4, device=device)
    options = dict(OPTIONS, qkl_coef=0.0)
    g = torch.Generator().manual_seed(5)
    ref_hidden = torch.randn(B, C, D, generator=g, dtype=torch.float32).to(device)
    ref_weight = torch.randn(V, D, generator=g, dtype=torch.float32).to(device)
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
def test_bad_input_is_one_line(change, message, device):
    data = trl_batch(device=device)
    inputs = dict(batch_inputs(data), logits=logits_of(data), **OPTIONS)
    change(inputs)
    with pytest.raises((ValueError, TypeError)) as error:
        padded_erpo_loss(**inputs)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_fused_linear_module_refuses_the_query_kl_without_the_prompt(device):
    data = trl_batch(device=device)
    with pytest.raises(ValueError, match="the Query-KL .* needs the prompt"):
        FusedLinearERPOLoss(backend="torch")(data["hidden"][:, P - 1:T - 1], data["weight"], data["completion_ids"],
                                             data["completion_mask"], data["advantages"])


def test_fused_linear_module_refuses_a_reference_input_of_other_positions(device):
    data = trl_batch(device=device)
    with pytest.raises(ValueError, match=r"ref_input must have _input's shape \(3, 11, 8\)"):
        FusedLinearERPOLoss(backend="torch", policy_kl_coef=0.1)(
            data["hidden"], data["weight"], data["completion_ids"], data["completion_mask"], data["advantages"],
            None, None, None, data["hidden"][:, 1:], data["weight"], prompt_ids=data["prompt_ids"],
            prompt_mask=data["prompt_mask"], ref_query_logp=data["ref_query_logp"])


def test_padded_rows_bench_times_both_pipelines(device):
    """`python -m bench.padded_rows` (every position as a row against the scored rows selected first) runs on the
    device and counts the scored rows it times: B * (real prompt tokens - 1 + completion tokens)."""
    from bench.padded_rows import markdown, run
    results = run(batch=2, prompt=4, completion=6, vocab=37, fractions=(0.5,), reps=1, warmup=0, device=device)
    (row,) = results
    assert (row["positions"], row["scored"]) == (2 * 10, 2 * (2 - 1 + 3))
    assert row["every_position_ms"] > 0 and row["selected_ms"] > 0
    assert "| 0.40 | 8 |" in markdown(results)
