"""from_padded: left- and right-padded [B, L] batches to packed rows, and the loss on them; completion_layout's
rows (TRL's prompt / completion columns) and what building them costs."""
import numpy as np
import pytest
import torch

from erpo_kernels import completion_layout, erpo_loss, from_padded, token_logprobs
from erpo_kernels.layout import host_to_device
from launch_counts import LaunchCounter


def test_right_padded_rows(device):
    # sequence 0: prompt 11 12 13, response 21 22; sequence 1: prompt 14 15, response 23, then padding
    input_ids = torch.tensor([[11, 12, 13, 21, 22], [14, 15, 23, 0, 0]], device=device)
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], device=device)
    response = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]], device=device)
    rows = from_padded(input_ids, attention, response)
    assert rows.token_kind.tolist() == [1, 1, 2, 2, 0, 1, 2, 0, 0, 0]
    assert rows.targets.tolist() == [12, 13, 21, 22, -100, 15, 23, -100, -100, -100]
    assert rows.sample_index.tolist() == [0] * 5 + [1] * 5


def test_left_padded_rows(device):
    input_ids = torch.tensor([[0, 0, 14, 15, 23], [11, 12, 13, 21, 22]], device=device)
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], device=device)
    response = torch.tensor([[0, 0, 0, 0, 1], [0, 0, 0, 1, 1]], device=device)
    rows = from_padded(input_ids, attention, response)
    assert rows.token_kind.tolist() == [0, 0, 1, 2, 0, 1, 1, 2, 2, 0]
    assert rows.targets.tolist() == [-100, -100, 15, 23, -100, 12, 13, 21, 22, -100]


def test_padding_side_does_not_change_the_loss(device):
    """The same two samples, left- vs right-padded, give the same loss and per-sample sums."""
    torch.manual_seed(0)
    vocab = 30
    seqs = [([3, 4, 5], [6, 7]), ([8, 9], [10, 11, 12])]
    length = 6
    table = torch.randn(vocab, vocab, device=device)  # logits of position t depend only on token t: padding-invariant

    def batch(left):
        ids, att, resp = [], [], []
        for prompt, answer in seqs:
            tokens = prompt + answer
            pad = [0] * (length - len(tokens))
            ids.append(pad + tokens if left else tokens + pad)
            mask = [1] * len(tokens)
            att.append([0] * len(pad) + mask if left else mask + [0] * len(pad))
            r = [0] * len(prompt) + [1] * len(answer)
            resp.append([0] * len(pad) + r if left else r + [0] * len(pad))
        return torch.tensor(ids, device=device), torch.tensor(att, device=device), torch.tensor(resp, device=device)

    outs = []
    for left in (True, False):
        ids, att, resp = batch(left)
        rows = from_padded(ids, att, resp)
        logits = table[ids.reshape(-1)]
        outs.append(erpo_loss(logits, rows.targets, rows.token_kind, rows.sample_index, backend="torch",
                              advantages=torch.tensor([1.0, -1.0], device=device),
                              ref_query_logp=torch.tensor([-9.0, -5.0], device=device)))
    torch.testing.assert_close(outs[0].loss, outs[1].loss)
    torch.testing.assert_close(outs[0].query_logp, outs[1].query_logp)
    torch.testing.assert_close(outs[0].response_logp, outs[1].response_logp)


def test_from_padded_errors(device):
    ids = torch.tensor([[1, 2, 3]], device=device)
    with pytest.raises(ValueError, match="same"):
        from_padded(ids, torch.ones(1, 2, device=device), torch.zeros(1, 3, device=device))
    with pytest.raises(ValueError, match="response_mask"):
        from_padded(ids, torch.tensor([[1, 1, 0]], device=device), torch.tensor([[0, 0, 1]], device=device))
    with pytest.raises(ValueError, match="input_ids"):
        from_padded(torch.tensor([1, 2, 3], device=device), torch.ones(3, device=device), torch.zeros(3, device=device))


def multi_turn_batch(device):
    """One sample on `device`: prompt 11 12 13, model turn 21 22, tool output 31 32, model turn 23 24, then
    padding."""
    input_ids = torch.tensor([[11, 12, 13, 21, 22, 31, 32, 23, 24, 0]], device=device)
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 0]], device=device)
    response = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 1, 1, 0]], device=device)
    return input_ids, attention, response


def test_tool_outputs_inside_the_completion_are_not_query_rows(device):
    rows = from_padded(*multi_turn_batch(device))
    # rows predicting 31 and 32 (the tool output) score nothing; only 12 and 13 are query rows
    assert rows.token_kind.tolist() == [1, 1, 2, 2, 0, 0, 2, 2, 0, 0]
    assert rows.targets.tolist() == [12, 13, 21, 22, -100, -100, 23, 24, -100, -100]


def test_query_mask_chooses_the_query_tokens(device):
    input_ids, attention, response = multi_turn_batch(device)
    query = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0, 0, 0]], device=device)  # the caller counts the tool output as query
    rows = from_padded(input_ids, attention, response, query_mask=query)
    assert rows.token_kind.tolist() == [1, 1, 2, 2, 1, 1, 2, 2, 0, 0]
    with pytest.raises(ValueError, match="query_mask and response_mask"):
        from_padded(input_ids, attention, response, query_mask=response)
    with pytest.raises(ValueError, match="query_mask marks a token that attention_mask marks as padding"):
        from_padded(input_ids, attention, response, query_mask=torch.ones_like(attention))
    with pytest.raises(ValueError, match="query_mask must have"):
        from_padded(input_ids, attention, response, query_mask=query[:, :-1])


def test_multi_turn_query_kl_is_zero_at_theta0_and_tool_rows_get_no_gradient(device):
    """At theta = theta0 the Query-KL of a multi-turn sample is exactly 0, whatever the tool outputs are: ell(q)
    is the prompt's log-likelihood alone, as the reference cache computes it from the prompt by itself."""
    torch.manual_seed(0)
    input_ids, attention, response = multi_turn_batch(device)
    table = torch.randn(40, 40, device=device)  # logits of position t depend only on token t
    logits = table[input_ids.reshape(-1)].requires_grad_(True)
    prompt = input_ids[:, :3]
    prompt_rows = from_padded(prompt, torch.ones_like(prompt), torch.zeros_like(prompt))
    ref_query_logp = token_logprobs(table[prompt.reshape(-1)], prompt_rows.targets, backend="torch").sum()[None]
    rows = from_padded(input_ids, attention, response)
    out = erpo_loss(logits, rows.targets, rows.token_kind, rows.sample_index, backend="torch",
                    advantages=torch.tensor([1.0], device=device), ref_query_logp=ref_query_logp, qkl_coef=1.0)
    assert out.metrics["qkl"].item() == 0.0
    out.loss.backward()
    tool_rows = [4, 5]  # the rows that predict the tool output 31 32
    assert torch.count_nonzero(logits.grad[tool_rows]) == 0
    assert torch.count_nonzero(logits.grad[[2, 3, 6, 7]], dim=1).min() > 0  # the response rows do learn


def trl_columns(device):
    """Two samples in TRL's columns: prompts [2, 3] left-padded (sample 0: one padding token), completions [2, 4]
    right-padded (sample 1: two padding tokens), a tool output at completion token 1 of sample 0."""
    return dict(prompt_ids=torch.tensor([[0, 11, 12], [13, 14, 15]], device=device),
                prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]], device=device),
                completion_ids=torch.tensor([[21, 31, 22, 23], [24, 25, 0, 0]], device=device),
                completion_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], device=device),
                tool_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]], device=device))


@pytest.mark.parametrize("form", ["prompt/completion", "full sequences"])
def test_completion_layout_rows(form, device):
    """Row t predicts token t + 1: query rows the prompt's real tokens, response rows the completion tokens that
    completion_mask x tool_mask keeps, nothing else (padding, the tool output, the last position); the same rows as
    from_padded on the concatenated batch, in either form of the call."""
    batch = trl_columns(device)
    if form == "full sequences":
        batch = dict(input_ids=torch.cat([batch.pop("prompt_ids"), batch.pop("completion_ids")], dim=1),
                     attention_mask=torch.cat([batch.pop("prompt_mask"), batch["completion_mask"]], dim=1), **batch)
    layout = completion_layout(**batch)
    assert layout.token_kind.tolist() == [0, 1, 2, 0, 2, 2, 0] + [1, 1, 2, 2, 0, 0, 0]
    assert layout.targets.tolist() == [-100, 12, 21, -100, 22, 23, -100] + [14, 15, 24, 25, -100, -100, -100]
    assert layout.sample_index.tolist() == [0] * 7 + [1] * 7
    assert all(t.dtype == torch.int64 and t.is_contiguous()
               for t in (layout.targets, layout.token_kind, layout.sample_index))
    input_ids = torch.tensor([[0, 11, 12, 21, 31, 22, 23], [13, 14, 15, 24, 25, 0, 0]], device=device)
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]], device=device)
    response = torch.tensor([[0, 0, 0, 1, 0, 1, 1], [0, 0, 0, 1, 1, 0, 0]], device=device)
    rows = from_padded(input_ids, attention, response)
    for name in ("targets", "token_kind", "sample_index"):
        assert torch.equal(getattr(layout, name), getattr(rows, name)), name


def test_completion_layout_launches(device):
    """completion_layout is a handful of elementwise kernels: 17 launches in TRL's form with a tool mask (two
    concatenations, the masks, the kinds, the targets, the sample indices, the completion tokens left unscored;
    29 before 2026-11-26), 15 with full sequences and validate=False; no host read either way."""
    batch = trl_columns(device)
    with LaunchCounter() as counter:
        completion_layout(**batch)
    assert counter.launches <= 17 and counter.syncs == 0, counter.names
    full = dict(input_ids=torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
                attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
                completion_mask=batch["completion_mask"], tool_mask=batch["tool_mask"])
    with LaunchCounter() as counter:
        completion_layout(**full, validate=False)
    assert counter.launches <= 15 and counter.syncs == 0, counter.names


def test_host_to_device_uploads_without_a_wait(device):
    """`host_to_device`, the one upload of the loss, the trainer and the integrations: a numpy array or a host
    tensor on the device (named or a torch.device), the same values and dtype, and no host sync (LaunchCounter: a
    non_blocking copy; on CUDA from pinned memory); on the CPU the host memory itself, not a copy."""
    array = np.arange(6, dtype=np.int64).reshape(2, 3)
    with LaunchCounter() as counter:
        uploads = [host_to_device(array, device), host_to_device(torch.from_numpy(array), str(device))]
    assert counter.syncs == 0, counter.sync_names
    for upload in uploads:
        assert upload.device.type == device.type and upload.dtype == torch.int64
        assert upload.cpu().tolist() == [[0, 1, 2], [3, 4, 5]]
    if device.type == "cpu":
        assert all(upload.data_ptr() == array.ctypes.data for upload in uploads)
