"""The entropy filter's quantile (`masked_quantile`): torch.quantile's value bit for bit on the pooled rows, with
static shapes, so the filtered loss compiles whole (fullgraph) with no data-dependent op in its graph. On the
`device` fixture's tensors (CUDA when present)."""
import warnings

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from erpo_kernels import erpo_loss
from erpo_kernels.objective import high_entropy_mask, masked_quantile

QUANTILES = (0.0, 0.2, 0.5, 1 / 3, 0.8, 1.0)


def pools(seed: int, device, count: int = 200):
    """(values [n], rows [n]) pairs: n from 1 to 9 (and 300 now and then), Gaussian or heavily tied values, pools of
    every size from none to all rows, some holding a NaN or an infinite value, fp32 and fp64; drawn on the CPU, then
    moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        n = 300 if i % 10 == 9 else 1 + i % 9
        dtype = torch.float64 if i % 2 else torch.float32
        values = torch.randn(n, generator=g, dtype=dtype)
        if i % 3 == 0:  # ties
            values = torch.randint(0, 3, (n,), generator=g).to(dtype) * 0.5
        if i % 7 == 0:
            values[torch.randint(0, n, (1,), generator=g)] = float("nan")
        if i % 11 == 0:
            values[torch.randint(0, n, (1,), generator=g)] = float("inf")
        rows = torch.rand(n, generator=g) < (i % 5) / 4  # none (i % 5 == 0), a quarter ..., all (i % 5 == 4)
        yield values.to(device), rows.to(device)


def same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(torch.equal(actual, expected) or (actual.isnan() & expected.isnan()))


@pytest.mark.parametrize("q", QUANTILES)
def test_masked_quantile_is_torch_quantile_of_the_pool(q, device):
    for values, rows in pools(int(q * 1000), device):
        expected = torch.quantile(values[rows].float(), q) if rows.any() else torch.tensor(float("nan"), device=device)
        actual = masked_quantile(values, rows, q)
        assert actual.dtype == torch.float32 and actual.shape == ()
        assert same(actual, expected), (values, rows, q, actual, expected)


@pytest.mark.parametrize("q", QUANTILES)
def test_triton_masked_quantile_is_masked_quantile(q, device):
    """The fused objective's threshold (`triton_quantile`, pooling the rows of kind 2): masked_quantile's value, bit
    for bit (torch.quantile's on the pool)."""
    pytest.importorskip("triton", exc_type=ModuleNotFoundError)
    from erpo_kernels.triton_quantile import masked_quantile_op

    for values, rows in pools(int(q * 1000) + 1, device, count=60):
        values = values.float()
        kind = torch.where(rows, 2, torch.where(torch.arange(rows.shape[0], device=device) % 2 == 0, 1, 0))
        actual, expected = masked_quantile_op(values, kind, 2, q), masked_quantile(values, rows, q)
        assert actual.dtype == torch.float32 and actual.shape == ()
        assert same(actual, expected), (values, rows, q, actual, expected)


def test_triton_masked_quantile_of_an_empty_pool_is_nan_and_forms_no_inf_minus_inf(device):
    """No row pooled: NaN, without the kernel reading the +inf the other rows sort to and forming inf - inf (numpy's
    RuntimeWarning under the interpreter, made an error here; compiled, nothing would say so)."""
    pytest.importorskip("triton", exc_type=ModuleNotFoundError)
    from erpo_kernels.triton_quantile import masked_quantile_op

    values = torch.randn(7, generator=torch.Generator().manual_seed(3)).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert masked_quantile_op(values, torch.ones(7, dtype=torch.long, device=device), 2, 0.3).isnan()
    assert masked_quantile_op(values, torch.full((7,), 2, device=device), 2, 0.0) == values.min()


def test_masked_quantile_small_pools_by_hand(device):
    def pool(*kept):
        return torch.tensor(kept, device=device)

    values = torch.tensor([3.0, 1.0, 2.0, 10.0], device=device)
    assert masked_quantile(values, pool(True, False, False, False), 0.5).item() == 3.0  # n = 1
    assert masked_quantile(values, pool(True, True, False, False), 0.25).item() == 1.5  # n = 2: lerp
    assert masked_quantile(values, pool(True, True, True, True), 1.0).item() == 10.0
    assert masked_quantile(values, pool(False, False, False, False), 0.5).isnan()  # n = 0
    with_nan = torch.tensor([3.0, float("nan"), 2.0, 10.0], device=device)
    assert masked_quantile(with_nan, pool(True, True, False, False), 0.5).isnan()  # a pooled NaN
    assert masked_quantile(with_nan, pool(True, False, True, False), 0.5).item() == 2.5  # NaN not pooled


def test_entropy_filter_keeps_no_row_when_the_quantile_is_nan(device):
    def entropies(*values):
        return torch.tensor(values, device=device)

    rows = torch.tensor([True, True, True, False], device=device)
    assert high_entropy_mask(entropies(1.0, 2.0, 3.0, 0.0), rows, 0.5).tolist() == [False, True, True, False]
    assert not high_entropy_mask(entropies(1.0, float("nan"), 3.0, 0.0), rows, 0.5).any()
    assert not high_entropy_mask(entropies(1.0, 2.0), torch.zeros(2, dtype=torch.bool, device=device), 0.5).any()
    assert high_entropy_mask(entropies(), torch.zeros(0, dtype=torch.bool, device=device), 0.5).shape == (0,)


def test_entropy_filtered_loss_compiles_whole_without_data_dependent_ops(device):
    """fullgraph=True (a graph break is an error) gives the eager loss and gradient, and neither the traced graph nor
    the forward and backward aten graphs hold a quantile or `aten.equal` (the data-dependent op that broke the graph
    under torch 2.11)."""
    n, vocab = 24, 11
    g = torch.Generator().manual_seed(5)
    kind = torch.tensor([1, 1, 2, 2, 2, 2, 0, 2] * 3)
    targets = torch.randint(0, vocab, (n,), generator=g).masked_fill(kind == 0, -100).to(device)
    kind, sample_index = kind.to(device), (torch.arange(n) // 8).to(device)
    logits = torch.randn(n, vocab, generator=g).to(device).requires_grad_(True)
    options = dict(advantages=torch.tensor([1.0, -0.5, 0.25], device=device),
                   old_logp=(-torch.rand(n, generator=g) - 1).to(device),
                   qkl_coef=0.0, pg_objective="cispo", top_entropy_quantile=0.3, entropy_coef=0.01,
                   backend="torch")
    graphs = []

    def record(graph, example_inputs):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    def recording_backend(graph, example_inputs):
        graphs.append(graph)
        return aot_autograd(fw_compiler=record, bw_compiler=record)(graph, example_inputs)

    def loss(logits):
        out = erpo_loss(logits, targets, kind, sample_index, **options)
        return out.loss, out.metrics["kept_tokens"]

    torch._dynamo.reset()
    eager, eager_kept = loss(logits)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    compiled, kept = torch.compile(loss, fullgraph=True, backend=recording_backend)(logits)
    (grad,) = torch.autograd.grad(compiled, logits)
    assert 0 < eager_kept < (kind == 2).sum() and torch.equal(kept, eager_kept)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-7)
    assert len(graphs) == 3  # dynamo's graph, aot's forward and backward
    ops = {str(getattr(node.target, "__name__", node.target)) for graph in graphs for node in graph.graph.nodes
           if node.op in ("call_function", "call_method")}
    assert {"sort", "sort.default"} <= ops  # the quantile is in the graph (dynamo's and aot's forward), ...
    assert not {op for op in ops if "quantile" in op or op.startswith("equal")}  # ... as static-shape ops
