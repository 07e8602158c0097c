"""The contenders as pytest-benchmark tests (CUDA only; skipped elsewhere).

    pytest bench/test_bench.py --benchmark-only --benchmark-columns=median,iqr,rounds

One case per path at N=4096 on the Qwen2.5-7B lm_head, bf16; each contender must pass the same correctness check
as `python -m bench` before it is timed. `python -m bench` is the full suite (floors, memory, all sizes, report).
"""
from __future__ import annotations

import pytest
import torch

from bench.check import OURS, PEERS, check_contender
from bench.contenders import CONTENDERS, ERPO_OPTIONS
from bench.problem import SHAPES, build_problem

pytest.importorskip("pytest_benchmark", exc_type=ModuleNotFoundError)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="bench timings need a CUDA GPU")

ROWS = 4096
ROUNDS = 20
WARMUP_ROUNDS = 5
_PROBLEMS = {}


def _problem(path: str):
    if path not in _PROBLEMS:
        _PROBLEMS.clear()  # one path's inputs on the GPU at a time
        _PROBLEMS[path] = build_problem(path, SHAPES["qwen2.5-7b"], ROWS, rows_per_sample=1024, query_frac=0.25,
                                        dtype=torch.bfloat16, device=torch.device("cuda"), seed=0, chunk_rows=4096,
                                        clip_low=ERPO_OPTIONS["clip_low"], clip_high=ERPO_OPTIONS["clip_high"])
    return _PROBLEMS[path]


@pytest.mark.parametrize("contender", CONTENDERS, ids=lambda c: f"{c.path}-{c.key}")
def test_forward_backward(benchmark, contender):
    missing = contender.requirement(torch.device("cuda"))
    if missing is not None:
        pytest.skip(f"{contender.key}: {missing[0]}: {missing[1]}")
    problem = _problem(contender.path)
    with contender.knobs():  # what every call of the contender runs under (erpo-dh32: d hidden held in fp32)
        prepared = contender.prepare(problem)
        check = check_contender(problem, prepared, contender.computes, 4096,
                                OURS if contender.held_to_ours else PEERS)
        assert check.ok, check.failures

        def step():
            prepared.step()
            torch.cuda.synchronize()
        benchmark.group = f"{contender.path} N={ROWS} fwd+bwd"
        benchmark.extra_info.update(label=contender.label, computes=contender.computes, loss_err=check.loss_err,
                                    grad_err=check.grad_err)
        benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
