"""Random packed batches for the loss tests."""
import torch


def random_batch(num_rows=48, vocab=37, num_samples=5, dtype=torch.float32, seed=0, scale=3.0, device="cpu"):
    """A packed batch with query and response rows, a few rows of kind 0 holding target -100, and every input
    tensor of API.md filled; drawn on the CPU (the same numbers everywhere), then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=g) * scale).to(dtype)
    kind = torch.randint(0, 3, (num_rows,), generator=g)
    kind[:3] = torch.tensor([1, 2, 0])
    sample_index = torch.randint(0, num_samples, (num_rows,), generator=g)
    targets = torch.randint(0, vocab, (num_rows,), generator=g)
    targets[kind == 0] = -100
    logp_guess = -torch.rand(num_rows, generator=g) * 4 - 0.5
    batch = dict(
        logits=logits, targets=targets, token_kind=kind, sample_index=sample_index,
        advantages=torch.randn(num_samples, generator=g),
        ref_query_logp=-torch.rand(num_samples, generator=g) * 20 - 10,
        query_weight=torch.rand(num_samples, generator=g) * 2,
        old_logp=logp_guess + 0.3 * torch.randn(num_rows, generator=g),
        ref_logp=logp_guess + 0.3 * torch.randn(num_rows, generator=g),
    )
    return {name: tensor.to(device) for name, tensor in batch.items()}


def loss_inputs(batch, with_tensors=("advantages", "ref_query_logp", "query_weight", "old_logp", "ref_logp")):
    return {k: batch[k] for k in with_tensors}


def assert_compiled_equals_eager(loss, logits, *, grad_rtol):
    """`loss(logits)` compiled whole (fullgraph, aot_eager) equals eager in value (rtol 1e-6) and in its gradient
    with respect to `logits` (rtol `grad_rtol`, atol 1e-7)."""
    torch._dynamo.reset()
    eager = loss(logits)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(logits)
    (grad,) = torch.autograd.grad(compiled, logits)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, eager_grad, rtol=grad_rtol, atol=1e-7)
