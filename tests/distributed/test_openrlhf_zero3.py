"""OpenRLHF's lean path (`fused_linear=True`) under DeepSpeed ZeRO-3, on 2 CPU ranks (gloo): the lm_head is scored as
its own forward (`erpo.sequences.call_as_forward`), so ZeRO-3 gathers it for the scoring and again for OpenRLHF's
backward, which runs after `actor_logprobs` has returned (`DeepspeedStrategy.backward`: engine.backward, then
engine.step). tests/workers/openrlhf_zero3_worker.py runs both ranks once, for an untied lm_head and one tied to the
input embedding, fp32, every parameter partitioned (no persistence threshold, no reuse distance, no prefetch)."""
import pytest
import torch

from paths import WORKERS
from torchrun import run_worker

WORKER = WORKERS / "openrlhf_zero3_worker.py"


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    pytest.importorskip("deepspeed", exc_type=ModuleNotFoundError)
    pytest.importorskip("openrlhf", reason="OpenRLHF is not in the test extra: pip install --no-deps openrlhf==0.11.2",
                        exc_type=ModuleNotFoundError)
    return run_worker(WORKER, tmp_path_factory.mktemp("openrlhf_zero3") / "out.pt")


def assert_ranks_close(ours, theirs, what, **tolerance):
    """Two lists of the ranks' tensors equal within `tolerance`."""
    for rank, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(mine, reference, msg=f"{what}, rank {rank}", **tolerance)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_lean_path_under_zero3_is_the_unsharded_step(heads, tied):
    """Under ZeRO-3, on each rank: the reference cache's ell_theta0(q) scored on the lean path equals the unsharded
    model's lean scoring (fp32 rounding) and the ZeRO-3 logits path's (1e-5), the head partitioned again after it.
    Far from theta0 (ell(q) moved by over a nat), OpenRLHF's step (ERPOPolicyLoss with the Query-KL and w(q), the
    entropy bonus; backward and step by OpenRLHF's DeepSpeed strategy after the scoring returned): the action
    log-probs, ell_theta(q) and the loss equal the unsharded model's and the ZeRO-3 logits path's; every parameter's
    whole gradient equals the unsharded ranks' average (1e-5 of its norm; tied: the embedding's and the head's parts
    summed) and the logits path's under ZeRO-3 (1e-4 of its norm); the step moved every parameter by -lr x that
    gradient; the head is an empty shard again once the scoring returned and once the backward ran (nothing holds it
    gathered through the step)."""
    head = heads[tied]
    assert head["tied"] == tied
    caches = head["caches"]
    assert caches["zero3-lean-released"] and caches["zero3-logits-released"]
    assert_ranks_close(caches["zero3-lean"], caches["unsharded-lean"], "cache, ZeRO-3 vs unsharded", rtol=1e-6,
                       atol=1e-5)
    assert_ranks_close(caches["zero3-lean"], caches["zero3-logits"], "cache, lean vs logits", rtol=1e-6, atol=1e-5)
    assert min(drift.abs().max() for drift in head["drift"]) > 1.0   # far from theta0: the Query-KL acts
    lean, logits, unsharded = (head["runs"][name] for name in ("zero3-lean", "zero3-logits", "unsharded-lean"))
    for run in (lean, logits):
        assert run["released_after_scoring"] and run["released_after_backward"]
    for key in ("action_log_probs", "query_logp", "loss"):
        assert_ranks_close(lean[key], unsharded[key], f"{key}, ZeRO-3 vs unsharded", rtol=1e-6, atol=1e-6)
        assert_ranks_close(lean[key], logits[key], f"{key}, lean vs logits", rtol=1e-5, atol=1e-5)
    assert ("lm_head.weight" in unsharded["grads"]) == (not tied)
    assert set(lean["grads"]) == set(logits["grads"]) == set(unsharded["grads"])
    for name, grad in unsharded["grads"].items():
        norm = grad.norm()
        assert norm > 0, name
        assert (lean["grads"][name] - grad).norm() <= 1e-5 * norm, name
        assert (lean["grads"][name] - logits["grads"][name]).norm() <= 1e-4 * norm, name
        stepped = head["initial"][name] - head["lr"] * grad
        torch.testing.assert_close(lean["params"][name], stepped, rtol=1e-5, atol=1e-6, msg=name)
