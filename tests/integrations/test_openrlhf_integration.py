"""erpo.integrations.openrlhf against OpenRLHF 0.11.2's own code: with ERPO's terms off, ERPOPolicyLoss is
`PolicyLoss` (loss, gradient, metrics) for token- and sequence-level aggregation, clip-higher, the dual clip, GSPO
and the global counts OpenRLHF passes; the Query-KL is the kernels' torch reference's, times alpha, with its
gradient; and the user's mistakes are one-line errors."""
import sys
import types

import pytest
import torch

pytest.importorskip("openrlhf", reason="OpenRLHF is not in the test extra: pip install --no-deps openrlhf==0.11.2")

from erpo.integrations.openrlhf import ERPOPolicyLoss  # noqa: E402
from erpo_kernels import logprob_erpo_loss  # noqa: E402


@pytest.fixture(scope="module")
def openrlhf_models():
    """`openrlhf.models` (PolicyLoss, Actor) without flash-attn: the package imports its ring-attention helpers
    (`ring_attn_utils`), which import flash_attn at the top, absent on a CPU machine. They serve the packed path
    only (packing_samples, ring attention), which these tests do not take, so a stand-in module takes their place
    while the package is imported. Stubbing that module rather than flash_attn keeps flash_attn absent for
    transformers, which probes for it."""
    def packed_path_only(*args, **kwargs):
        raise RuntimeError("the packed path needs flash-attn, absent here")

    stand_in = types.ModuleType("openrlhf.models.ring_attn_utils")
    stand_in.gather_and_pad_tensor = stand_in.unpad_and_slice_tensor = packed_path_only
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, stand_in.__name__, stand_in)
        import openrlhf.models as models
    return models


def batch(seed=0, num=5, width=9, spread=0.6):
    """A micro-batch as OpenRLHF's actor step holds it: log_probs / old_log_probs / action_mask [B, A], each sample's
    advantage broadcast along its actions (mixed signs), one sample with a tool output inside its actions, ratios
    spread wide enough to clip at both ends and to reach the dual clip."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([width, 4, 7, 1, 6][:num])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[2, 2:4] = False   # a tool output between two actions
    old = -torch.rand(num, width, generator=gen) * 3
    log_probs = (old + torch.randn(num, width, generator=gen) * spread) * mask
    log_probs[0, 1] = old[0, 1] + 1.5     # ratio e^1.5 > 3 on a negative advantage: the dual clip
    advantages = torch.tensor([-1.3, 0.7, 0.4, -0.2, 1.1][:num])[:, None].expand(num, width) * mask
    return log_probs, old * mask, advantages.contiguous(), mask


GLOBAL = dict(dp_size=2, batch_num_tokens=torch.tensor(61.0), global_batch_size=torch.tensor(12.0))
OPTIONS = {
    "token-level": dict(),
    "sequence-level": dict(token_level_loss=False),
    "clip-higher": dict(clip_eps_low=0.2, clip_eps_high=0.28),
    "dual-clip": dict(dual_clip=3.0),
    "sequence-level dual-clip": dict(token_level_loss=False, dual_clip=3.0, clip_eps_high=0.28),
    "gspo": dict(policy_loss_type="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4),
}


def loss_and_grad(loss_fn, log_probs, *args, **kwargs):
    """(loss, d loss / d log_probs, clip_ratio, ppo_kl) of one call."""
    log_probs = log_probs.clone().requires_grad_(True)
    loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = loss_fn(log_probs, *args, **kwargs)
    assert vllm_kl is None and is_filter_ratio is None
    loss.backward()
    return loss.detach(), log_probs.grad, clip_ratio, ppo_kl


@pytest.mark.parametrize("global_counts", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_without_erpo_terms_it_is_policy_loss(openrlhf_models, name, global_counts):
    log_probs, old, advantages, mask = batch()
    counts = GLOBAL if global_counts else {}
    theirs = loss_and_grad(openrlhf_models.PolicyLoss(**OPTIONS[name]), log_probs, old, advantages,
                           action_mask=mask, **counts)
    ours = loss_and_grad(ERPOPolicyLoss(**OPTIONS[name], qkl_coef=0.0), log_probs, old, advantages,
                         action_mask=mask, **counts)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-7)
    assert theirs[2] > 0 and theirs[1].abs().sum() > 0   # something is clipped, and a gradient flows


def test_query_weight_scales_each_sample_policy_term(openrlhf_models):
    """w(q) multiplies a sample's policy term: PolicyLoss on advantages times w (the clipped surrogate is
    positively homogeneous in the advantage), loss and gradient."""
    log_probs, old, advantages, mask = batch(seed=1)
    weight = torch.tensor([0.3, 1.7, 0.0, 2.0, 1.0])
    theirs = loss_and_grad(openrlhf_models.PolicyLoss(dual_clip=3.0), log_probs, old, advantages * weight[:, None],
                           action_mask=mask, **GLOBAL)
    ours = loss_and_grad(ERPOPolicyLoss(dual_clip=3.0, qkl_coef=0.0), log_probs, old, advantages, action_mask=mask,
                         query_weight=weight, **GLOBAL)
    torch.testing.assert_close(ours[:2], theirs[:2], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("global_counts", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("estimator", ["k3", "k1", "k2"])
def test_query_kl_is_the_reference_times_alpha(estimator, global_counts):
    """The loss with alpha > 0 minus the loss with alpha = 0 is alpha times the Query-KL of erpo_kernels' torch
    reference on the per-token prompt log-probs whose sums are ell_theta(q) (dp_size times it over
    global_batch_size with the global counts), and so is its gradient with respect to those log-probs; ell_theta(q)
    gets no gradient from the policy term."""
    log_probs, old, advantages, mask = batch(seed=2)
    num, alpha = log_probs.shape[0], 0.05
    gen = torch.Generator().manual_seed(3)
    prompt_logp = -torch.rand(num, 6, generator=gen) * 2   # per-token log-probs of 6 prompt tokens, tokens 2..7
    ref_query_logp = prompt_logp.sum(1) + torch.randn(num, generator=gen) * 0.8   # theta0 away from theta
    counts = GLOBAL if global_counts else {}

    def ours(coef):
        per_token = prompt_logp.clone().requires_grad_(True)
        loss, *_ = ERPOPolicyLoss(qkl_coef=coef, qkl_estimator=estimator)(
            log_probs, old, advantages, action_mask=mask, query_logp=per_token.sum(1), ref_query_logp=ref_query_logp,
            **counts)
        loss.backward()
        return loss.detach(), per_token.grad

    with_qkl, grad = ours(alpha)
    without, no_grad = ours(0.0)
    assert torch.count_nonzero(no_grad) == 0
    per_token = prompt_logp.clone().requires_grad_(True)
    reference = logprob_erpo_loss(
        per_token.reshape(-1), torch.ones(per_token.numel(), dtype=torch.long),
        torch.arange(num).repeat_interleave(6), advantages=torch.zeros(num), ref_query_logp=ref_query_logp,
        qkl_coef=alpha, qkl_estimator=estimator, num_seqs=counts.get("global_batch_size"), backend="torch")
    scale = counts.get("dp_size", 1)
    (reference.loss * scale).backward()
    torch.testing.assert_close(with_qkl - without, reference.loss.detach() * scale, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, per_token.grad, rtol=1e-5, atol=1e-8)
    assert (with_qkl - without) > 0


def test_metrics_go_to_experience_info():
    """ERPO's metrics as per-sample [B] tensors in OpenRLHF's experience.info: qkl the micro-batch's mean k3,
    query_logp ell_theta(q), query_weight_mean w(q)."""
    log_probs, old, advantages, mask = batch(seed=4)
    num = log_probs.shape[0]
    query_logp = -torch.rand(num) * 10
    ref_query_logp = query_logp + torch.linspace(-0.5, 0.5, num)
    weight = torch.linspace(0.5, 1.5, num)
    info = {}
    ERPOPolicyLoss(qkl_coef=0.01)(log_probs, old, advantages, action_mask=mask, query_logp=query_logp,
                                  ref_query_logp=ref_query_logp, query_weight=weight, info=info, **GLOBAL)
    ratio = ref_query_logp - query_logp
    k3 = torch.exp(ratio) - ratio - 1
    torch.testing.assert_close(info["qkl"], k3.mean().expand(num), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(info["query_logp"], query_logp)
    torch.testing.assert_close(info["query_weight_mean"], weight)


def test_errors_are_one_line():
    log_probs, old, advantages, mask = batch()
    cases = [
        (lambda: ERPOPolicyLoss(policy_loss_type="cispo"), r"^policy_loss_type must be one of \['ppo', 'gspo'\]"),
        (lambda: ERPOPolicyLoss(is_correction_level="token"), r"^is_correction_level='token' is not supported"),
        (lambda: ERPOPolicyLoss(qkl_coef=-1.0), r"^qkl_coef must be a finite number >= 0"),
        (lambda: ERPOPolicyLoss(qkl_estimator="k3-token"), r"^qkl_estimator must be one of"),
        (lambda: ERPOPolicyLoss(dual_clip=0.9), r"dual_clip"),
        (lambda: ERPOPolicyLoss()(log_probs, old, advantages, action_mask=mask), r"^qkl_coef != 0 needs query_logp"),
        (lambda: ERPOPolicyLoss(qkl_coef=0.0)(log_probs, old, advantages), r"^action_mask is required"),
        (lambda: ERPOPolicyLoss(qkl_coef=0.0)(log_probs, old, advantages, action_mask=mask,
                                              query_logp=torch.zeros(2)), r"^query_logp must have shape \[5\]"),
        (lambda: ERPOPolicyLoss(qkl_coef=0.0)(log_probs, old, advantages + torch.rand(advantages.shape) * mask,
                                              action_mask=mask), r"^ERPO needs one advantage per sample"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            make()
        assert "\n" not in str(error.value)
