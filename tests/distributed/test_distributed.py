"""erpo.distributed: sharding, single-process fallbacks, DeepSpeed config building, and real 2-process
gloo reductions."""
import importlib.util
import json
import os
import sys

import pytest
import torch

from advantage_ranks import CASES, all_cases, expected_single_process
from erpo import distributed as D
from paths import worker_pythonpath
from process_group import run_group
from torchrun import RANKS_LIMIT_S, free_port

# ---------------------------------------------------------------------------------------------- shard

@pytest.mark.parametrize("num_groups,group_size,world", [(8, 4, 2), (7, 3, 3), (5, 1, 5), (10, 2, 4)])
def test_shard_partitions_whole_groups(num_groups, group_size, world):
    items = [(g, j) for g in range(num_groups) for j in range(group_size)]  # (group, response)
    shares = [D.shard(items, r, world, group_size=group_size) for r in range(world)]
    assert [x for share in shares for x in share] == items          # disjoint, complete, in order
    sizes = [len(share) // group_size for share in shares]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    for share in shares:                                              # every group on exactly one rank
        groups = {g for g, _ in share}
        assert all(sum(1 for g2, _ in share if g2 == g) == group_size for g in groups)


def test_shard_single_rank_is_identity():
    assert D.shard(list("abcdef"), 0, 1) == list("abcdef")


@pytest.mark.parametrize("kwargs,match", [
    (dict(items=[1, 2], rank=2, world=2), "rank"),
    (dict(items=[1, 2], rank=0, world=0), "world"),
    (dict(items=[1, 2, 3], rank=0, world=1, group_size=2), "multiple of group_size"),
    (dict(items=[1, 2], rank=0, world=1, group_size=0), "group_size"),
    (dict(items=[1, 2, 3, 4], rank=0, world=3, group_size=2), "fewer than world"),
])
def test_shard_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.shard(**kwargs)


# ------------------------------------------------------------------------------------- single process

def test_single_process_defaults():
    assert not D.is_initialized()
    assert (D.rank(), D.world_size(), D.is_main(), D.data_parallel_loss_scale()) == (0, 1, True, 1)
    D.barrier()
    t = torch.tensor([1.0, 2.0])
    out = D.all_reduce_sum(t)
    assert torch.equal(out, t) and out is not t
    assert D.all_reduce_sum(3) == 3 and isinstance(D.all_reduce_sum(3), int)
    assert D.all_reduce_max(2.5) == 2.5 and torch.equal(D.all_reduce_max(t), t)
    with pytest.raises(ValueError, match="op"):
        D.all_reduce(t, "min")
    assert D.all_gather_object({"a": 1}) == [{"a": 1}]
    with pytest.raises(TypeError, match="tensor"):
        D.all_reduce_sum("3")


def test_init_distributed_without_launcher_is_a_no_op(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert D.init_distributed() is False and not D.is_initialized()


def test_gathered_is_a_no_op_for_plain_tensors():
    p = torch.nn.Parameter(torch.ones(3))
    with D.gathered([p]):
        assert p.shape == (3,)
    assert not D.is_zero3_param(p)


# ----------------------------------------------------------------------------------- DeepSpeed config

def test_deepspeed_config_fields():
    cfg = D.deepspeed_config(3, bf16=True, offload_optimizer=True, offload_params=True, grad_clip=1.0,
                             micro_batch=4, grad_accum=8, optimizer={"type": "AdamW", "params": {"lr": 1e-6}})
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["device"] == "cpu" and zero["stage3_gather_16bit_weights_on_model_save"]
    assert cfg["bf16"] == {"enabled": True}
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (4, 8)
    assert cfg["gradient_clipping"] == 1.0 and cfg["optimizer"]["type"] == "AdamW"
    plain = D.deepspeed_config(2, bf16=False, grad_clip=None)
    assert plain["gradient_clipping"] == 0.0 and plain["bf16"] == {"enabled": False}
    assert "offload_optimizer" not in plain["zero_optimization"] and "optimizer" not in plain


@pytest.mark.parametrize("kwargs,match", [
    (dict(zero_stage=4), "zero_stage"),
    (dict(zero_stage=True), "zero_stage"),
    (dict(zero_stage=2, offload_params=True), "offload_params"),
    (dict(zero_stage=0, offload_optimizer=True), "offload_optimizer"),
    (dict(zero_stage=2, micro_batch=0), "micro_batch"),
    (dict(zero_stage=2, grad_accum=1.5), "grad_accum"),
    (dict(zero_stage=2, grad_clip=-1.0), "grad_clip"),
    (dict(zero_stage=2, optimizer={"params": {}}), "optimizer"),
])
def test_deepspeed_config_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.deepspeed_config(**kwargs)


def test_hf_deepspeed_config_names_the_missing_accelerate(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate"
                        else real_find_spec(name, *a))
    with pytest.raises(ImportError, match="accelerate"):
        D.hf_deepspeed_config(D.deepspeed_config(3))


def test_hf_deepspeed_config_only_at_zero3():
    assert D.hf_deepspeed_config(D.deepspeed_config(2)) is None
    pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)
    pytest.importorskip("accelerate", exc_type=ModuleNotFoundError)
    from transformers.integrations import is_deepspeed_zero3_enabled

    holder = D.hf_deepspeed_config(D.deepspeed_config(3, bf16=False))
    try:
        assert is_deepspeed_zero3_enabled()
    finally:
        del holder
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    assert not is_deepspeed_zero3_enabled()


# -------------------------------------------------------------------------------- 2 processes (gloo)

# One 2-rank gloo job under torchrun answers every test of this section: each rank writes rank-R.json, one entry per
# test (a job's ~20 s of imports, paid once)
TWO_RANKS_SCRIPT = r"""
import json, os, sys, torch
from erpo import distributed as D
from erpo.train.update_step import entropy_pool
from erpo_kernels import erpo_loss
from advantage_ranks import all_cases
assert D.init_distributed("gloo")
r = D.rank()
lines = {}

total = D.all_reduce_sum(torch.tensor([1.0, 10.0]) * (r + 1))
count = D.all_reduce_sum(r + 5)
largest = D.all_reduce_max(torch.tensor([float(r), 5.0 - r]))
most = D.all_reduce_max(r + 5)
objs = D.all_gather_object({"rank": r})
D.barrier()
lines["reductions"] = f"{r} {D.world_size()} {D.is_main()} {total.tolist()} {count} {largest.tolist()} {most} {objs}"

cat = D.all_gather_cat(torch.arange(r + 2, dtype=torch.float32))   # lengths 2 and 3
# 4 response rows per rank (2 samples of a 1-token query and 2 response tokens): rank 0's rows are near-uniform
# (high entropy), rank 1's peaked (low entropy), so the global median keeps all of rank 0's rows, none of rank 1's
logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(r)) * (0.1 if r == 0 else 8.0)
kind, sample = torch.tensor([1, 2, 2, 1, 2, 2]), torch.tensor([0, 0, 0, 1, 1, 1])
def kept(gather):
    out = erpo_loss(logits, torch.zeros(6, dtype=torch.long), kind, sample, advantages=torch.tensor([1.0, -1.0]),
                    qkl_coef=0.0, top_entropy_quantile=0.5, top_entropy_gather=gather, backend="torch")
    return int(out.metrics["kept_tokens"])
lines["entropy"] = f"{cat.tolist()} {kept(entropy_pool(1.0))} {kept(None)} {kept(entropy_pool(float(r == 0)))}"

lines["advantages"] = all_cases()

D.destroy_distributed()
lines["destroyed"] = not D.is_initialized()
with open(os.path.join(sys.argv[1], f"rank-{r}.json"), "w") as f:
    json.dump(lines, f)
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """TWO_RANKS_SCRIPT on a real 2-rank gloo group under torchrun: each rank's entries, in rank order."""
    root = tmp_path_factory.mktemp("two_ranks")
    script = root / "script.py"
    script.write_text(TWO_RANKS_SCRIPT)
    env = dict(os.environ, PYTHONPATH=worker_pythonpath(), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), str(root)]
    proc = run_group(cmd, env, RANKS_LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((root / f"rank-{r}.json").read_text()) for r in range(2)]


def test_two_process_reductions(two_ranks):
    """A real 2-rank gloo group under torchrun (the deepspeed launcher is exercised end to end in
    tests/distributed/test_multirank.py): the reductions, then the group destroyed."""
    objs = "[{'rank': 0}, {'rank': 1}]"
    assert [rank["reductions"] for rank in two_ranks] == [
        f"0 2 True [3.0, 30.0] 11 [1.0, 5.0] 6 {objs}", f"1 2 False [3.0, 30.0] 11 [1.0, 5.0] 6 {objs}"]
    assert [rank["destroyed"] for rank in two_ranks] == [True, True]


def test_entropy_filter_quantile_is_global_over_ranks(two_ranks):
    """`erpo train`'s entropy filter (top_entropy_quantile) takes its quantile over every rank's response rows, as
    TRL's (update_step.entropy_pool over D.all_gather_cat, which concatenates tensors of different lengths): rank 0
    (high entropies) keeps all 4 rows and rank 1 none, where a per-rank quantile keeps 2 of 4 on each; a stand-in
    micro-batch (rank 1, weight 0) adds no entropies, so the pool is rank 0's (2 kept there, none on rank 1)."""
    assert [rank["entropy"] for rank in two_ranks] == ["[0.0, 1.0, 0.0, 1.0, 2.0] 4 2 2",
                                                       "[0.0, 1.0, 0.0, 1.0, 2.0] 0 2 0"]


def test_rollout_advantages_do_not_depend_on_the_world_size(two_ranks):
    """`erpo train`'s rollout stage on 2 ranks (each holds 3 of the 6 prompt groups) gives every sample the
    advantage one process gives it, for every estimator and scale_rewards: the batch std ("batch") and REINFORCE's
    batch mean are over both ranks' rewards, as TRL's and verl's over the global batch (they were per rank), and a
    sample no reward function scored is left out of them on every rank."""
    one_rank = all_cases()
    ranks = [rank["advantages"] for rank in two_ranks]
    for estimator, scale in CASES:
        case = f"{estimator}/{scale}"
        assert one_rank[case] == pytest.approx(expected_single_process(estimator, scale), abs=1e-6), case
        assert sorted(ranks[0][case]) == ["0,0", "0,1", "2,0", "2,1", "4,0", "4,1"]   # whole groups per rank
        assert {**ranks[0][case], **ranks[1][case]} == pytest.approx(one_rank[case], abs=1e-6), case


def test_all_gather_cat_single_process_and_bad_input():
    values = torch.tensor([1.0, 2.0])
    assert torch.equal(D.all_gather_cat(values), values)
    with pytest.raises(TypeError, match="1-D torch.Tensor"):
        D.all_gather_cat(values.reshape(1, 2))


def test_set_launcher_env_keeps_a_launchers_values_and_fills_a_single_process(monkeypatch, no_launcher_variables):
    monkeypatch.setenv("MASTER_PORT", "29123")
    D.set_launcher_env()
    assert [os.environ[k] for k in D.LAUNCHER_VARIABLES] == \
        ["0", "0", "1", "127.0.0.1", "29123"]
    monkeypatch.delenv("MASTER_PORT")
    D.set_launcher_env()
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536
