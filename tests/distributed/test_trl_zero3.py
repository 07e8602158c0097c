"""TRL's ERPOTrainer on the fused-linear path under DeepSpeed ZeRO-3, enabled as a TRL user does (`deepspeed=` a ZeRO-3
config): TRL runs the backward after `_compute_loss` has returned, so each scoring of the lm_head runs as the head's own
forward (`erpo.sequences.on_whole_lm_head`, `call_as_forward`), which ZeRO-3 gathers for it and again for TRL's
backward. tests/workers/trl_zero3_worker.py trains in one process under torchrun (DeepSpeed's launcher variables, its
CPU accelerator, gloo), fp32 (transformers refuses bf16 without a GPU unless use_cpu, which turns DeepSpeed off).

The comparison is the same steps without DeepSpeed, on the same fused-linear path: the kernels are the same, so the
loss, every metric and every parameter after 3 steps agree to rounding, and a head gradient ZeRO-3 lost or left
unreduced would move the lm_head (or, tied, the embedding) by Adam steps of 3e-2."""
import pytest
import torch

from paths import WORKERS
from torchrun import run_worker

WORKER = WORKERS / "trl_zero3_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)
    pytest.importorskip("trl", exc_type=ModuleNotFoundError)
    return run_worker(WORKER, tmp_path_factory.mktemp("trl_zero3") / "out.pt", nproc=1)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_fused_linear_under_zero3_trains_as_without_deepspeed(runs, tied):
    """Under ZeRO-3 (every parameter partitioned, the lm_head an empty shard again after training: nothing holds it
    gathered), 3 optimizer steps of 2 accumulated micro-batches with the Query-KL and w(q) (tied: from the cache;
    untied: from the current policy, the query rows scored again) log the metrics of the run without DeepSpeed (the
    same names; the values to 1e-5: the Query-KL acting from the second step, grad_norm the whole gradient's before
    clipping) and end with its parameters (the lm_head and the embedding moved by far more than the tolerance)."""
    plain, zero3 = runs["runs"][tied, False], runs["runs"][tied, True]
    assert plain["tied"] == zero3["tied"] == tied
    assert zero3["partitioned"] and zero3["head_released"]
    assert len(plain["logs"]) == len(zero3["logs"]) == 3
    assert zero3["logs"][1]["qkl"] > 1e-3   # moved from theta0: the Query-KL acts
    for step, (expected, got) in enumerate(zip(plain["logs"], zero3["logs"])):
        assert set(got) == set(expected), step
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, name)
    assert set(zero3["params"]) == set(plain["params"])
    assert ("lm_head.weight" in plain["params"]) == (not tied)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    initial = runs["theta0"][tied][head]
    assert (plain["params"][head] - initial).abs().max() > 1e-2
    for name, expected in plain["params"].items():
        torch.testing.assert_close(zero3["params"][name], expected, rtol=1e-5, atol=5e-5, msg=name)


def test_a_model_created_partitioned_is_refused_with_the_query_kl(runs):
    """A model name under ZeRO-3 (TRL loads it partitioned, before any engine): with the Query-KL, ERPOTrainer cannot
    score theta0 when it is built and says so in one line, naming what to do; without the cache
    (qkl_coef=0, query_weight="current") it trains."""
    refused, trained = runs["born_partitioned"]["static"], runs["born_partitioned"]["current"]
    assert "created partitioned by DeepSpeed ZeRO-3" in refused and "\n" not in refused
    assert "pass the model loaded whole" in refused
    assert len(trained) == 2 and all(loss == loss for loss in trained)
