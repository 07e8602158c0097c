"""erpo.integrations.openrlhf against OpenRLHF 0.11.2's own code: with ERPO's terms off, ERPOPolicyLoss is `PolicyLoss`
(loss, gradient, metrics) for token- and sequence-level aggregation, clip-higher, the dual clip, GSPO and the global
counts OpenRLHF passes, and its train/rollout correction; the Query-KL is the kernels' torch reference's, times
alpha, with its gradient; `actor_logprobs` on OpenRLHF's `Actor` around a tiny Qwen2 gives Actor.forward's action
log-probs and each prompt's log-likelihood of a plain log_softmax-gather, padded either way, fp32 and bf16, with the
gradient; and the user's mistakes are one-line errors.

OpenRLHF is not in the test extra (its wheel pins flash-attn and a transformers the extra does not install): a test
whose oracle or harness is OpenRLHF's code skips without it. The rest runs everywhere: the loss against the PPO and
GSPO formulas (`policy_formula`), `actor_logprobs` and the cache on `StandInActor` (Actor's forward without OpenRLHF),
the Query-KL, the metrics, the errors. Where OpenRLHF is installed, `test_the_stand_ins_are_openrlhf_own` holds the
stand-ins to OpenRLHF's own code."""
import importlib.metadata
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import erpo.integrations.openrlhf as integration
from bench.openrlhf_memory import ring_attention_stand_in
from erpo.integrations.openrlhf import ERPOPolicyLoss, actor_logprobs
from erpo.models.tiny import build_tokenizer
from erpo_kernels import logprob_erpo_loss
from launch_counts import LaunchCounter
from tiny_models import save_tiny_model

WITHOUT_OPENRLHF = "OpenRLHF is not in the test extra: pip install --no-deps openrlhf==0.11.2"


@pytest.fixture(scope="module")
def openrlhf_models():
    """`openrlhf.models` (PolicyLoss, Actor), imported with `ring_attention_stand_in` in its package; the test skips
    without OpenRLHF."""
    pytest.importorskip("openrlhf", reason=WITHOUT_OPENRLHF, exc_type=ModuleNotFoundError)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "openrlhf.models.ring_attn_utils", ring_attention_stand_in())
        import openrlhf.models as models
    return models


@pytest.fixture(scope="module")
def actor_step(openrlhf_models):
    """OpenRLHF's own `ActorPPOTrainer.training_step`, unmodified. Its package `openrlhf.trainer.ray` imports vLLM
    in its __init__ (absent here; the step does not use it), so the package's folder is mounted under a stand-in
    package module while ppo_actor is imported, with `ring_attention_stand_in` (OpenRLHF's DeepSpeed strategy
    imports it too)."""
    import openrlhf.trainer
    package = types.ModuleType("openrlhf.trainer.ray")
    package.__path__ = [str(Path(openrlhf.trainer.__file__).parent / "ray")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, package.__name__, package)
        patch.setitem(sys.modules, "openrlhf.models.ring_attn_utils", ring_attention_stand_in())
        from openrlhf.trainer.ppo_utils.experience import Experience
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    return ActorPPOTrainer.training_step, Experience


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
    """(loss, d loss / d log_probs, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio) of one call."""
    log_probs = log_probs.clone().requires_grad_(True)
    loss, *metrics = loss_fn(log_probs, *args, **kwargs)
    loss.backward()
    return loss.detach(), log_probs.grad, *metrics


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


def policy_formula(log_probs, old_log_probs, advantages, action_mask, *, clip_eps_low=0.2, clip_eps_high=0.2,
                   dual_clip=None, token_level_loss=True, policy_loss_type="ppo", dp_size=1, batch_num_tokens=None,
                   global_batch_size=None):
    """OpenRLHF's policy losses written from their papers' formulas, the oracle where OpenRLHF is absent: the ratio
    r = exp(log_probs - old_log_probs) per token, its log clamped to +-20 ("ppo"), or per sample the exp of the
    mean log-ratio over its actions ("gspo", arXiv 2507.18071); per token -min(r A, clip(r, 1 - eps_low, 1 + eps_high)
    A), and with a dual clip c at most -c A where A < 0 (arXiv 1912.09729); summed over the action tokens over
    batch_num_tokens times dp_size (without it the mean), or per sample (GSPO always): each sample's mean over its
    actions, summed over global_batch_size times dp_size (without it the mean over samples with an action).
    Returns (loss, clip_ratio: the fraction of action tokens clipped, ppo_kl: the mean of -log r)."""
    mask = action_mask.float()
    log_ratio = log_probs - old_log_probs
    if policy_loss_type == "gspo":
        ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1)).exp()[:, None] * mask
    else:
        ratio = log_ratio.clamp(-20, 20).exp()
    unclipped, clipped = ratio * advantages, ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    if token_level_loss and policy_loss_type == "ppo":
        total = (loss * mask).sum()
        aggregate = total / mask.sum() if batch_num_tokens is None else total / batch_num_tokens * dp_size
    else:
        actions = mask.sum(1)
        per_sample = ((loss * mask).sum(1) / actions.clamp(min=1))[actions > 0]
        aggregate = per_sample.mean() if global_batch_size is None else per_sample.sum() / global_batch_size * dp_size
    clip_ratio = ((clipped < unclipped).float() * mask).sum() / mask.sum()
    return aggregate, clip_ratio, (-log_ratio.detach() * mask).sum() / mask.sum()


@pytest.mark.parametrize("weighted", [False, True], ids=["w=1", "w(q)"])
@pytest.mark.parametrize("global_counts", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_without_the_query_kl_it_is_the_policy_formula(name, global_counts, weighted):
    """Without OpenRLHF: with alpha = 0, ERPOPolicyLoss is `policy_formula` (loss, gradient, clip_ratio, ppo_kl), and
    with w(q) the formula on each sample's advantage times w (the surrogate is positively homogeneous in the
    advantage; the metrics are then the unweighted advantages', as PolicyLoss's on them)."""
    log_probs, old, advantages, mask = batch()
    counts = GLOBAL if global_counts else {}
    weight = torch.tensor([0.3, 1.7, 0.0, 2.0, 1.0]) if weighted else None
    scaled = advantages if weight is None else advantages * weight[:, None]
    theirs = loss_and_grad(lambda *args: policy_formula(*args, **OPTIONS[name], **counts), log_probs, old, scaled,
                           mask)
    ours = loss_and_grad(ERPOPolicyLoss(**OPTIONS[name], qkl_coef=0.0), log_probs, old, advantages,
                         action_mask=mask, query_weight=weight, **counts)
    compared = 2 if weighted else 4
    for mine, reference in zip(ours[:compared], theirs[:compared]):
        torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-7)
    assert ours[2] > 0 and theirs[1].abs().sum() > 0   # something is clipped, and a gradient flows


CORRECTIONS = {
    "token mask ratio": dict(is_correction_level="token"),
    "token clip ratio": dict(is_correction_level="token", is_correction_mode="clip",
                             is_correction_threshold=(0.8, 1.2)),
    "seq mask ratio": dict(is_correction_level="seq", is_correction_threshold=(0.9, 1.1)),
    "token mask binary_kl": dict(is_correction_level="token", is_correction_gating="binary_kl",
                                 is_correction_threshold=(0.0, 0.02)),
    "seq mask tv": dict(is_correction_level="seq", is_correction_gating="tv", is_correction_threshold=(0.0, 0.03)),
    "gspo token mask ratio": dict(is_correction_level="token", policy_loss_type="gspo", clip_eps_low=3e-4,
                                  clip_eps_high=4e-4),
    "sequence-level dual-clip token mask": dict(is_correction_level="token", token_level_loss=False, dual_clip=3.0),
}


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_the_rollout_correction_is_policy_loss(openrlhf_models, name):
    """OpenRLHF's train/rollout correction (is_correction_*): loss, gradient and the four metrics equal
    PolicyLoss's, with some tokens (or sequences) filtered and some kept."""
    log_probs, old, advantages, mask = batch(seed=6)
    rollout = (old + torch.randn(old.shape, generator=torch.Generator().manual_seed(7)) * 0.4) * mask
    theirs = loss_and_grad(openrlhf_models.PolicyLoss(**CORRECTIONS[name]), log_probs, old, advantages,
                           action_mask=mask, rollout_log_probs=rollout, **GLOBAL)
    ours = loss_and_grad(ERPOPolicyLoss(**CORRECTIONS[name], qkl_coef=0.0), log_probs, old, advantages,
                         action_mask=mask, rollout_log_probs=rollout, **GLOBAL)
    for mine, reference in zip(ours, theirs):
        if reference is None:
            assert mine is None
        else:
            torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-7)
    if theirs[5] is not None:   # "ppo": the gate filters part of the batch
        assert 0 < theirs[5] < 1


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
        (lambda: ERPOPolicyLoss(is_correction_level="tok"), r"^is_correction_level must be one of"),
        (lambda: ERPOPolicyLoss(is_correction_level="seq", is_correction_mode="clip"),
         r"^is_correction_mode=clip requires is_correction_level=token"),
        (lambda: ERPOPolicyLoss(is_correction_level="token", is_correction_gating="tv"),
         r"^is_correction_gating=tv takes an upper bound only"),
        (lambda: ERPOPolicyLoss(is_correction_level="token", qkl_coef=0.0)(log_probs, old, advantages,
                                                                            action_mask=mask),
         r"^is_correction_level='token' needs rollout_log_probs"),
        (lambda: ERPOPolicyLoss(qkl_coef=-1.0), r"^qkl_coef must be a finite number >= 0"),
        (lambda: ERPOPolicyLoss(qkl_estimator="k3-token"), r"^qkl_estimator must be one of"),
        (lambda: ERPOPolicyLoss(dual_clip=0.9), r"dual_clip"),
        (lambda: ERPOPolicyLoss()(log_probs, old, advantages, action_mask=mask), r"^qkl_coef != 0 needs query_logp"),
        (lambda: ERPOPolicyLoss(qkl_coef=0.0)(log_probs, old, advantages), r"^action_mask is required"),
        (lambda: ERPOPolicyLoss(qkl_coef=0.0)(log_probs, old, advantages, action_mask=mask,
                                              query_logp=torch.zeros(2)), r"^query_logp must have shape \[5\]"),
        (lambda: ERPOPolicyLoss(qkl_coef=0.0)(log_probs, old, advantages + torch.rand(advantages.shape) * mask,
                                              action_mask=mask), r"^ERPO needs one advantage per sample"),
        (lambda: ERPOPolicyLoss()(log_probs, old, advantages, action_mask=mask, query_logp=torch.zeros(5),
                                  ref_query_logp=torch.zeros(5), dp_size=2, batch_num_tokens=40.0),
         r"^batch_num_tokens without global_batch_size"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            make()
        assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A saved tiny Qwen2 (OpenRLHF's Actor loads a model from a path)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), build_tokenizer())


def openrlhf_actor(openrlhf_models, path, dtype):
    """OpenRLHF's Actor as its trainer builds it (from a path; sdpa attention on the CPU), its weights in `dtype`."""
    return openrlhf_models.Actor(path, attn_implementation="sdpa", param_dtype="bf16").to(dtype)


class StandInActor(torch.nn.Module):
    """What `actor_logprobs` and the reference cache take of OpenRLHF 0.11.2's `Actor` (openrlhf/models/actor.py),
    for a machine without OpenRLHF: `model`, the HF model loaded from a path as Actor loads it (bf16 weights, sdpa
    attention on the CPU, no KV cache) or the model it is given, `temperature`, and Actor.forward without packing:
    position ids counted over the real tokens (1 on padding), fp32 logits divided by the temperature, and with
    action_mask [B, A] the action log-probs of the last A scored positions (a log_softmax-gather, 0 where action_mask
    is 0)."""

    def __init__(self, path_or_model, temperature: float = 1.0):
        super().__init__()
        if isinstance(path_or_model, torch.nn.Module):   # Actor(model) keeps a model it is given as it is
            self.model = path_or_model
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path_or_model, attn_implementation="sdpa",
                                                              dtype=torch.bfloat16)
            self.model.config.use_cache = False
        self.temperature = temperature   # Actor's default 1.0 (the cache records it)

    # allgather_logits and ring_attn_group serve packing only, which Actor then needs flash-attn for
    def forward(self, sequences, action_mask=None, attention_mask=None, return_output=False, allgather_logits=False,
                ring_attn_group=None):
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        output = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        output["logits"] = output["logits"].float() / self.temperature
        if action_mask is None:
            return output
        logp = output["logits"][:, :-1].log_softmax(-1).gather(2, sequences[:, 1:, None]).squeeze(2)
        action_log_probs = logp[:, -action_mask.shape[1]:] * action_mask.float()
        return (action_log_probs, output) if return_output else action_log_probs


@pytest.fixture(params=["openrlhf", "stand-in"])
def actor_kind(request):
    """The actor a test runs on: OpenRLHF's own `Actor` (skipped without OpenRLHF) or `StandInActor`."""
    if request.param == "openrlhf":
        request.getfixturevalue("openrlhf_models")
    return request.param


@pytest.fixture
def make_actor(request, actor_kind, tiny_path):
    """dtype -> a fresh actor of `actor_kind` around the tiny Qwen2, as OpenRLHF's trainer builds it (from a path;
    sdpa attention on the CPU), its weights in `dtype`."""
    if actor_kind == "openrlhf":
        models = request.getfixturevalue("openrlhf_models")
        return lambda dtype: openrlhf_actor(models, tiny_path, dtype)
    return lambda dtype: StandInActor(tiny_path).to(dtype)


@pytest.fixture
def policy_loss(request, actor_kind):
    """The oracle loss of `actor_kind`'s tests (default options): OpenRLHF's own `PolicyLoss`, or `policy_formula`
    (ERPOPolicyLoss against both: `test_without_erpo_terms_it_is_policy_loss`,
    `test_without_the_query_kl_it_is_the_policy_formula`)."""
    if actor_kind == "openrlhf":
        return request.getfixturevalue("openrlhf_models").PolicyLoss()
    return policy_formula


# (prompt, response, tool output inside the response at [start, end) or None): prompts of 3 to 9 tokens
SAMPLES = [([5, 17, 33, 8, 9, 40, 41, 12, 7], [20, 21, 22, 23, 24], None), ([11, 3, 19], [30, 31, 32, 33, 34, 35, 36],
           (2, 4)), ([44, 45, 46, 47, 48], [50], None), ([60, 61, 62, 63], [70, 71, 72], None)]


def padded_batch(layout):
    """The SAMPLES as OpenRLHF's actor step gets them. "left": prompts left-padded to one width, responses
    right-padded, action_mask [B, A] over the response columns (OpenRLHF before 0.11); "right": each sequence from
    column 0, right-padded, action_mask [B, T - 1] over every scored position (0.11's agent executor)."""
    pad = 0
    prompt_width = max(len(p) for p, _, _ in SAMPLES)
    response_width = max(len(r) for _, r, _ in SAMPLES)
    rows, masks, actions = [], [], []
    for prompt, response, tool in SAMPLES:
        acts = [1] * len(response)
        if tool is not None:
            acts[tool[0]:tool[1]] = [0] * (tool[1] - tool[0])
        if layout == "left":
            lead = prompt_width - len(prompt)
            tail = response_width - len(response)
            rows.append([pad] * lead + prompt + response + [pad] * tail)
            masks.append([0] * lead + [1] * (len(prompt) + len(response)) + [0] * tail)
            actions.append(acts + [0] * tail)
        else:
            tail = prompt_width + response_width - len(prompt) - len(response)
            rows.append(prompt + response + [pad] * tail)
            masks.append([1] * (len(prompt) + len(response)) + [0] * tail)
            actions.append(([0] * len(prompt) + acts + [0] * tail)[1:])
    return torch.tensor(rows), torch.tensor(actions, dtype=torch.bool), torch.tensor(masks)


def plain_scores(model, autocast):
    """The oracle, each sample alone (no padding): log_softmax of the model's logits gathered at the next token;
    (ell(q) [B]: tokens 2..P of the prompt, the action log-probs [B] of each sample's response as a list)."""
    ells, actions = [], []
    for prompt, response, tool in SAMPLES:
        ids = torch.tensor([prompt + response])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits.float()
        logp = logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1)
        ells.append(logp[:len(prompt) - 1].sum())
        kept = [j for j in range(len(response)) if tool is None or not tool[0] <= j < tool[1]]
        actions.append(logp[len(prompt) - 1:][kept])
    return torch.stack(ells), actions


def action_values(values, action_mask):
    """[B, A] action-aligned values -> each sample's values on its action tokens, in order."""
    return [row[mask] for row, mask in zip(values, action_mask)]


@pytest.mark.parametrize("precision", ["fp32", "fp32-bf16-autocast", "bf16"])
@pytest.mark.parametrize("layout", ["left", "right"])
def test_actor_logprobs_is_a_plain_log_softmax_gather(make_actor, layout, precision):
    """ell_theta(q) and the action log-probs of one padded forward of the actor (OpenRLHF's Actor, StandInActor)
    equal each sample's plain log_softmax-gather on its own forward (to the rounding of the dtype: the forwards
    differ), and the parameters' gradient of a weighted sum of both equals the oracle's; on the same forward, the
    action log-probs equal the actor's own (Actor's log_probs_from_logits) and ell_theta(q) a log_softmax-gather of
    its logits (to fp32 rounding); the prompts are each sample's prompt tokens."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    autocast = precision == "fp32-bf16-autocast"
    actor = make_actor(dtype)
    sequences, action_mask, attention_mask = padded_batch(layout)
    gen = torch.Generator().manual_seed(5)
    query_coef = torch.randn(len(SAMPLES), generator=gen)
    action_coef = torch.randn(action_mask.shape, generator=gen)

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        scores = actor_logprobs(actor, sequences, action_mask, attention_mask, return_entropy=True)
    ((scores.query_logp * query_coef).sum() + (scores.action_log_probs * action_coef).sum()).backward()
    grads = {name: p.grad.float().clone() for name, p in actor.named_parameters()}
    actor.zero_grad()

    ell, actions = plain_scores(actor.model, autocast)
    coefs = action_values(action_coef, action_mask)
    ((ell * query_coef).sum() + sum((a * c).sum() for a, c in zip(actions, coefs))).backward()
    # fp32: the padded and the unpadded forwards differ by fp32 rounding; bf16 by bf16's (a prompt sums 2..8 rows)
    tol = dict(rtol=1e-5, atol=1e-5) if precision == "fp32" else dict(rtol=0.02, atol=0.06)
    torch.testing.assert_close(scores.query_logp, ell.detach(), **tol)
    for mine, plain in zip(action_values(scores.action_log_probs.detach(), action_mask), actions):
        torch.testing.assert_close(mine, plain.detach(), **tol)
    assert (scores.action_log_probs[~action_mask] == 0).all()
    grad_tol = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=0.1, atol=0.05)
    for name, p in actor.named_parameters():
        scale = p.grad.float().abs().max()
        torch.testing.assert_close(grads[name] / scale, p.grad.float() / scale, **grad_tol, msg=name)
    assert scores.prompt_ids == [prompt for prompt, _, _ in SAMPLES]

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        theirs, output = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True)
    torch.testing.assert_close(scores.action_log_probs.detach(), theirs, rtol=1e-6, atol=1e-6)
    same_forward = output["logits"][:, :-1].log_softmax(-1).gather(2, sequences[:, 1:, None]).squeeze(2)
    starts = attention_mask.argmax(1)   # each sample's first real token
    ell_same_forward = torch.stack([same_forward[b, start:start + len(prompt) - 1].sum()
                                    for b, (start, (prompt, _, _)) in enumerate(zip(starts.tolist(), SAMPLES))])
    torch.testing.assert_close(scores.query_logp.detach(), ell_same_forward, rtol=1e-6, atol=1e-5)
    logits = output["logits"][:, :-1][:, -action_mask.shape[1]:]
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    ours = scores.output.entropy[:, -action_mask.shape[1]:]   # where OpenRLHF's step reads it
    torch.testing.assert_close(ours[action_mask], entropy[action_mask], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["left", "right"])
def test_the_entropy_bonus_has_actor_forward_gradient(openrlhf_models, tiny_path, layout):
    """OpenRLHF's entropy bonus (actor.entropy_coef) backpropagates through `output.entropy[:, -A:]`: the one
    `actor_logprobs` sets has the gradient of Actor.forward's (`compute_entropy`), for every parameter."""
    actor = openrlhf_actor(openrlhf_models, tiny_path, torch.float32)
    sequences, action_mask, attention_mask = padded_batch(layout)
    coef = torch.randn(action_mask.shape, generator=torch.Generator().manual_seed(8)) * action_mask
    width = action_mask.shape[1]
    scores = actor_logprobs(actor, sequences, action_mask, attention_mask, return_entropy=True)
    (scores.output.entropy[:, -width:] * coef).sum().backward()
    ours = {name: p.grad.clone() for name, p in actor.named_parameters()}
    actor.zero_grad()
    _, output = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True, return_entropy=True)
    (output.entropy[:, -width:] * coef).sum().backward()
    for name, p in actor.named_parameters():
        scale = p.grad.abs().max()
        assert scale > 0, name
        torch.testing.assert_close(ours[name] / scale, p.grad / scale, rtol=1e-4, atol=1e-5, msg=name)


QUESTIONS = ["1+1=", "22+3=", "7*8=?", "What is 3*33?"]
RESPONSES = ["2", "25 and", "56!", "99"]


@pytest.mark.parametrize("layout", ["left", "right"])
def test_the_stand_ins_are_openrlhf_own(openrlhf_models, tiny_path, layout):
    """What the tests take in OpenRLHF's place where it is absent is its own code where it is installed:
    StandInActor's weights, logits and action log-probs are Actor's (fp32 and bf16 weights, padded either way), and
    `chat_prompts` are PromptDataset's `preprocess_data` texts."""
    from openrlhf.datasets.prompts_dataset import preprocess_data
    sequences, action_mask, attention_mask = padded_batch(layout)
    for dtype in (torch.float32, torch.bfloat16):
        actor, stand_in = openrlhf_actor(openrlhf_models, tiny_path, dtype), StandInActor(tiny_path).to(dtype)
        for name, weight in actor.model.state_dict().items():
            assert torch.equal(stand_in.model.state_dict()[name], weight), name
        with torch.no_grad():
            theirs, their_output = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True)
            ours, our_output = stand_in(sequences, action_mask, attention_mask=attention_mask, return_output=True)
        torch.testing.assert_close(our_output["logits"], their_output["logits"], rtol=0, atol=0)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    tokenizer = build_tokenizer()
    assert chat_prompts(tokenizer) == [preprocess_data({"input": q}, input_key="input",
                                                       apply_chat_template=tokenizer.apply_chat_template)[0]
                                       for q in QUESTIONS]


def chat_prompts(tokenizer, questions=QUESTIONS):
    """The prompt texts of OpenRLHF's PromptDataset with the chat template, as its trainer hands them to the agent
    executor: its `preprocess_data` renders a question without an <image> tag as
    `apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)`
    (`test_the_stand_ins_are_openrlhf_own`)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]


def step_batch(tokenizer, prompts, responses=RESPONSES):
    """OpenRLHF 0.11's micro-batch of these prompt texts + responses: sequences from column 0, right-padded, the
    action_mask over the T - 1 scored positions."""
    from erpo.integrations.openrlhf_reference import prompt_token_ids
    ids = prompt_token_ids(tokenizer, prompts)
    answers = [tokenizer(text=r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(len(p) + len(r) for p, r in zip(ids, answers))
    sequences = torch.tensor([p + r + [0] * (width - len(p) - len(r)) for p, r in zip(ids, answers)])
    attention_mask = torch.tensor([[1] * (len(p) + len(r)) + [0] * (width - len(p) - len(r))
                                   for p, r in zip(ids, answers)])
    action_mask = torch.tensor([([0] * len(p) + [1] * len(r) + [0] * (width - len(p) - len(r)))[1:]
                                for p, r in zip(ids, answers)], dtype=torch.bool)
    return sequences, action_mask, attention_mask


def test_a_training_step_at_theta0_is_policy_loss_with_static_weights(make_actor, policy_loss, tiny_path, tmp_path):
    """The drop-in at theta0: the cache scored by the actor's own forward gives a Query-KL of 0 (to fp32 rounding)
    on the training step's prompt + response batch, and every parameter's gradient of ERPOPolicyLoss on
    actor_logprobs equals the oracle's (`policy_loss`: PolicyLoss, or the formula) on the actor's own forward with
    each advantage times the cached w(q). A second load reads the cache without scoring."""
    from erpo.integrations import openrlhf_reference
    tokenizer = build_tokenizer()
    actor = make_actor(torch.float32)
    prompts = chat_prompts(tokenizer)
    path = str(tmp_path / "cache.json")
    reference = openrlhf_reference.load_or_build_query_reference(actor, tokenizer, prompts, path=path,
                                                                 model_path=tiny_path, batch_size=3)
    sequences, action_mask, attention_mask = step_batch(tokenizer, prompts)
    num = len(prompts)
    old = torch.full(action_mask.shape, -3.0) * action_mask
    advantages = (torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * action_mask).contiguous()

    scores = actor_logprobs(actor, sequences, action_mask, attention_mask)
    ref_query_logp, query_weight = reference.lookup(scores.prompt_ids)
    assert not torch.allclose(query_weight, torch.ones(num))
    info = {}
    loss, *_ = ERPOPolicyLoss(qkl_coef=0.01)(scores.action_log_probs, old, advantages, action_mask=action_mask,
                                             query_logp=scores.query_logp, ref_query_logp=ref_query_logp,
                                             query_weight=query_weight, info=info, **GLOBAL)
    loss.backward()
    ours = {name: p.grad.clone() for name, p in actor.named_parameters()}
    actor.zero_grad()
    assert info["qkl"].abs().max() < 1e-10
    torch.testing.assert_close(ref_query_logp, scores.query_logp.detach(), rtol=1e-6, atol=1e-5)

    action_log_probs = actor(sequences, action_mask, attention_mask=attention_mask)
    theirs, *_ = policy_loss(action_log_probs, old, advantages * query_weight[:, None], action_mask=action_mask,
                             **GLOBAL)
    theirs.backward()
    torch.testing.assert_close(loss.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
    for name, p in actor.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)

    def no_scoring(*args, **kwargs):
        raise AssertionError("the cache was scored again instead of read")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(openrlhf_reference, "score_prompts", no_scoring)
        again = openrlhf_reference.load_or_build_query_reference(actor, tokenizer, prompts, path=path,
                                                                 model_path=tiny_path)
    assert again.entries == reference.entries


class EngineStandIn(torch.nn.Module):
    """What OpenRLHF 0.11.2's DeepSpeed strategy leaves in the Actor's `model` (`strategy.prepare`: `model.model =
    engine`): a DeepSpeedEngine, whose `module` is the Hugging Face model and whose `config` is DeepSpeed's config
    dict (deepspeed/runtime/engine.py: `self.config = config`), its forward the module's."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
        self.global_steps = 0   # its optimizer steps: 0 at a fresh start, the checkpoint's after load_checkpoint

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_the_cache_reads_the_model_inside_deepspeeds_engine(make_actor, tiny_path, tmp_path):
    """In OpenRLHF's trainer the Actor's model is DeepSpeed's engine, where the recipe builds the cache: the cache
    records the Hugging Face model's precision, as before the wrapping, scores the same ell_theta0(q) through the
    engine, and a cache built without the engine is read with it."""
    from erpo.integrations.openrlhf_reference import actor_precision, load_or_build_query_reference
    tokenizer = build_tokenizer()
    actor = make_actor(torch.float32)
    prompts = chat_prompts(tokenizer)
    bare = load_or_build_query_reference(actor, tokenizer, prompts, path=str(tmp_path / "bare.json"),
                                         model_path=tiny_path)
    precision = actor_precision(actor)
    actor.model = EngineStandIn(actor.model)
    assert actor_precision(actor) == precision and "dtype=float32" in precision and "attention=sdpa" in precision
    read = load_or_build_query_reference(actor, tokenizer, prompts, path=str(tmp_path / "bare.json"),
                                         model_path=tiny_path)
    scored = load_or_build_query_reference(actor, tokenizer, prompts, path=str(tmp_path / "engine.json"),
                                           model_path=tiny_path)
    assert read.entries == bare.entries == scored.entries


def test_a_mismatched_cache_is_a_one_line_error(make_actor, tiny_path, tmp_path):
    """Another chat template, a prompt the cache lacks, another tokenizer, another precision, a truncated prompt:
    each refused in one line naming what differs, never a wrong ell_theta0(q). A prompt a step misses once the cache
    held every prompt it was given is not blamed on the cache: the remedy is to give it OpenRLHF's prompts and
    truncation, not to rebuild it."""
    from erpo.integrations.openrlhf_reference import load_or_build_query_reference, prompt_token_ids
    tokenizer = build_tokenizer()
    actor = make_actor(torch.float32)
    path = str(tmp_path / "cache.json")
    reference = load_or_build_query_reference(actor, tokenizer, chat_prompts(tokenizer), path=path,
                                              model_path=tiny_path)
    other_template = build_tokenizer()
    other_template.chat_template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    plain = [f"Question: {q}" for q in QUESTIONS]
    cases = [
        (lambda: reference.lookup(prompt_token_ids(tokenizer, chat_prompts(other_template))),
         r"^prompt .* has no ell_theta0\(q\) in the reference cache .* \(4 of 4 prompts missing\)"),
        (lambda: reference.lookup(prompt_token_ids(tokenizer, chat_prompts(tokenizer) + ["never seen"])),
         r"^prompt 'never seen' has no ell_theta0\(q\) .*\(1 of 5 prompts missing\) \(it held every prompt given to "
         r"load_or_build_query_reference, .*rebuilding the cache would not add it\)\. Pass it the PromptDataset's "
         r"prompts \(dataset.prompts\) and max_prompt_length=data.max_len - \(rollout.max_new_tokens or 1\)"),
        # OpenRLHF truncated the prompts the cache was given whole (max_prompt_length left out): not the cache's fault
        (lambda: reference.lookup(prompt_token_ids(tokenizer, chat_prompts(tokenizer), max_prompt_length=8)),
         r"\(4 of 4 prompts missing\) \(it held every prompt given to load_or_build_query_reference, tokenized as "
         r"OpenRLHF's agent executors tokenize them, left-truncated to its max_prompt_length;"),
        (lambda: load_or_build_query_reference(actor, tokenizer, plain, path=path, model_path=tiny_path),
         r"^prompt .* has no ell_theta0\(q\) in the reference cache"),
        (lambda: load_or_build_query_reference(actor, tokenizer, chat_prompts(tokenizer), path=path,
                                               model_path=tiny_path, max_prompt_length=8),
         r"^prompt .* has no ell_theta0\(q\) in the reference cache"),
        (lambda: load_or_build_query_reference(actor, other_template, chat_prompts(tokenizer), path=path,
                                               model_path=tiny_path), r"does not match this run: tokenizer: "),
        (lambda: load_or_build_query_reference(make_actor(torch.bfloat16), tokenizer,
                                               chat_prompts(tokenizer), path=path, model_path=tiny_path),
         r"does not match this run: precision: cache built with dtype=float32.*training scores with "
         r"dtype=bfloat16"),
        (lambda: load_or_build_query_reference(actor, tokenizer, [], path=path, model_path=tiny_path),
         r"^prompts is empty"),
        (lambda: load_or_build_query_reference(actor, tokenizer, chat_prompts(tokenizer), path=str(tmp_path / "none"),
                                               model_path=tiny_path, resumed_step=7),
         r"^no reference cache at .*none, and the run resumes at step 7: ell_theta0\(q\) is scored with the "
         r"initial weights, which the actor no longer holds; put the cache of the run's start there \(or pass its "
         r"path to load_or_build_query_reference\), or start afresh$"),
        (lambda: load_or_build_query_reference(actor, other_template, chat_prompts(tokenizer), path=path,
                                               model_path=tiny_path, resumed_step=7),
         r"tokenizer: .* resume with the cache and the settings of the run's start"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            make()
        assert "\n" not in str(error.value)


def test_ring_attention_is_refused_in_one_line(make_actor, tiny_path, tmp_path, monkeypatch):
    """OpenRLHF's ring attention (ds.ring_attn_size > 1) is refused in one line, by the step's `actor_logprobs` (the
    group it passes) and by the cache (which no step passes a group: OpenRLHF's own record of it, set by its
    strategy, `ring_attn_utils.get_ring_attn_group`), never scored: the cache's forward would run the substituted
    ring kernel without its slicing, and the step would gather every rank's logits [B, T, V]."""
    from erpo.integrations.openrlhf_reference import load_or_build_query_reference
    tokenizer = build_tokenizer()
    actor = make_actor(torch.float32)
    prompts = chat_prompts(tokenizer)
    sequences, action_mask, attention_mask = step_batch(tokenizer, prompts)
    message = r"^ring attention \(ds.ring_attn_size > 1\) is not supported by erpo.integrations.openrlhf"
    with pytest.raises(ValueError, match=message) as error:
        actor_logprobs(actor, sequences, action_mask, attention_mask, ring_attn_group=object())
    assert "\n" not in str(error.value)
    ring = types.ModuleType("openrlhf.models.ring_attn_utils")
    ring.get_ring_attn_group = lambda: object()   # what OpenRLHF's strategy leaves set under ring attention
    monkeypatch.setitem(sys.modules, ring.__name__, ring)
    path = tmp_path / "cache.json"
    with pytest.raises(ValueError, match=message):
        load_or_build_query_reference(actor, tokenizer, prompts, path=str(path), model_path=tiny_path)
    assert not path.exists()
    ring.get_ring_attn_group = lambda: None   # OpenRLHF without ring attention
    load_or_build_query_reference(actor, tokenizer, prompts, path=str(path), model_path=tiny_path)


def test_a_keyword_that_cannot_be_a_multimodal_input_is_refused(make_actor):
    """`actor_logprobs` / `actor_row_logprobs` pass their other keywords on to the model (a VLM's processor inputs),
    whose transformers `**kwargs` dropped a misspelled option: `fused_liner=True` scored on the logits path,
    `return_entropie=True` gave no entropy, silently. Now a TypeError in one line naming the keyword, as Python's own:
    every keyword on a text-only actor; on a VLM actor (OpenRLHF's `is_vlm`) a near miss of the functions' own
    options and Actor.forward's own parameters, while a processor's inputs pass."""
    tokenizer = build_tokenizer()
    actor = make_actor(torch.float32)
    batch = step_batch(tokenizer, chat_prompts(tokenizer))
    cases = [
        (actor_logprobs, dict(fused_liner=True), r"^actor_logprobs\(\) got an unexpected keyword argument "
                                                 r"'fused_liner' \(did you mean 'fused_linear'\?\)$"),
        (actor_logprobs, dict(return_entropie=True), r"'return_entropie' \(did you mean 'return_entropy'\?\)$"),
        (integration.actor_row_logprobs, dict(fused_liner=True),
         r"^actor_row_logprobs\(\) got an unexpected keyword argument 'fused_liner'"),
        (actor_logprobs, dict(pixel_values=torch.zeros(1)), r"'pixel_values' \(the actor is not a vision-language "
                                                            r"model \(OpenRLHF's is_vlm\), so it takes no"),
        (actor_logprobs, dict(return_output=True), r"'return_output' \(the actor is not a vision-language model"),
    ]
    for function, keywords, message in cases:
        with pytest.raises(TypeError, match=message) as error:
            function(actor, *batch, **keywords)
        assert "\n" not in str(error.value)
    actor.is_vlm = True   # as OpenRLHF's Actor marks a vision-language model
    for keywords, message in [(dict(fused_liner=True), r"'fused_liner' \(did you mean 'fused_linear'\?\)$"),
                              (dict(ring_attn_grop=None), r"'ring_attn_grop' \(did you mean 'ring_attn_group'\?\)$"),
                              (dict(return_output=True), r"'return_output' \(actor_logprobs sets Actor.forward's "
                                                         r"return_output itself\)$")]:
        with pytest.raises(TypeError, match=message):
            actor_logprobs(actor, *batch, **keywords)
    processor_inputs = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                        "second_per_grid_ts", "image_sizes", "token_type_ids", "mm_token_type_ids",
                        "pixel_attention_mask", "image_attention_mask", "aspect_ratio_ids", "cross_attention_mask")
    integration.check_multimodal_inputs(actor, dict.fromkeys(processor_inputs), "actor_logprobs")   # no error


def run_actor_step(actor_step, actor, loss_fn, sequences, action_mask, attention_mask, old, advantages):
    """OpenRLHF's training_step on one micro-batch with `loss_fn` as its actor_loss_fn, on a stand-in trainer whose
    strategy backpropagates and never steps (no Ray, no DeepSpeed): (the status it returns, every parameter's
    gradient)."""
    training_step, experience_class = actor_step
    args = types.SimpleNamespace(
        actor=types.SimpleNamespace(entropy_coef=None, aux_loss_coef=0.0),
        algo=types.SimpleNamespace(kl=types.SimpleNamespace(use_loss=False)),
        train=types.SimpleNamespace(dynamic_batch_enable=False))
    strategy = types.SimpleNamespace(ring_attn_group=None, backward=lambda loss, model, optim: loss.backward(),
                                     optimizer_step=lambda *a, **k: None, get_grad_norm=lambda model: 0.0)
    trainer = types.SimpleNamespace(actor=actor, actor_loss_fn=loss_fn, args=args, strategy=strategy, aux_loss=False,
                                    ema_model=None, actor_optim=None,
                                    actor_scheduler=types.SimpleNamespace(get_last_lr=lambda: [0.0]))
    experience = experience_class(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                                  action_log_probs=old, advantages=advantages, info={})
    actor.zero_grad()
    status = training_step(trainer, experience, 0.0, 0, dict(GLOBAL))
    return status, {name: p.grad.clone() for name, p in actor.named_parameters()}


def test_erpo_policy_loss_runs_in_openrlhf_own_training_step(openrlhf_models, actor_step, tiny_path):
    """ERPOPolicyLoss with qkl_coef=0 in place of PolicyLoss inside OpenRLHF's unmodified training_step: the same
    status (policy_loss, ppo_clip_ratio, ppo_kl) and every parameter's gradient."""
    tokenizer = build_tokenizer()
    actor = openrlhf_actor(openrlhf_models, tiny_path, torch.float32)
    sequences, action_mask, attention_mask = step_batch(tokenizer, chat_prompts(tokenizer))
    with torch.no_grad():
        old = actor(sequences, action_mask, attention_mask=attention_mask) - 0.3 * action_mask
    advantages = (torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * action_mask).contiguous()
    batch = (sequences, action_mask, attention_mask, old, advantages)
    theirs, their_grads = run_actor_step(actor_step, actor, openrlhf_models.PolicyLoss(dual_clip=3.0), *batch)
    ours, our_grads = run_actor_step(actor_step, actor, ERPOPolicyLoss(dual_clip=3.0, qkl_coef=0.0), *batch)
    for name in ("policy_loss", "ppo_clip_ratio", "ppo_kl"):
        torch.testing.assert_close(ours["metrics"][name], theirs["metrics"][name], rtol=1e-6, atol=1e-7, msg=name)
    assert theirs["metrics"]["ppo_clip_ratio"] > 0
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def recipe_lines(heading: str = "## OpenRLHF: one loss, two calls") -> tuple[list[str], list[str]]:
    """The first diff under `heading` in docs/integrations.md (by default the recipe's; "### The lean path" the one
    that turns fused_linear on): (the lines it removes, the lines it adds), each without its leading -/+."""
    text = (Path(__file__).parents[2] / "docs" / "integrations.md").read_text()
    section = text[text.index(heading):]
    block = section[section.index("```diff\n") + len("```diff\n"):]
    lines = block[:block.index("```")].splitlines()
    return [line[1:] for line in lines if line.startswith("-")], [line[1:] for line in lines if line.startswith("+")]


def recipe_source(source: str, *, fused_linear: bool = False) -> str:
    """OpenRLHF 0.11.2's ppo_actor.py with the recipe's diff applied, hunk by hunk at the places the diff shows; each
    place must be found exactly once (the diff names 0.11.2's lines). `fused_linear`: with the page's way to turn the
    lean path on, `fused_linear=True` added to the diff's `load_or_build_query_reference` and `actor_logprobs`
    calls."""
    removed, added = recipe_lines()
    assert len(removed) == 4 and len(added) == 19, "the recipe's diff changed: update its hunks here"

    def replace(old, new):
        assert source.count(old) == 1, f"the recipe's line is not 0.11.2's: {old!r}"
        return source.replace(old, new)

    source = replace(removed[0] + "\n", "\n".join(added[:4]) + "\n")                    # the imports
    source = replace(removed[1] + "\n", added[4] + "\n")                                 # PolicyLoss -> ERPOPolicyLoss
    closing = "            is_correction_threshold=self.args.algo.advantage.is_correction_threshold,\n        )\n"
    source = replace(closing, closing.replace("        )\n", "\n".join([added[5], "        )"] + added[6:12]) + "\n"))
    call = source[source.index(removed[2]):]
    source = replace(call[:call.index("\n        )\n") + len("\n        )\n")], "\n".join(added[12:17]) + "\n")
    loss_call = "            **loss_batch_info,\n        )\n"
    source = replace(loss_call, loss_call.replace("        )\n", "\n".join(added[17:] + ["        )"]) + "\n"))
    if fused_linear:   # the lean path's diff: fused_linear=True in both calls, PolicyModelActor.forward's old log-probs
        removed, added = recipe_lines("### The lean path")
        assert len(removed) == 9 and len(added) == 5, "the lean path's diff changed: update its hunks here"
        source = replace(removed[0], added[0])
        source = replace(removed[1], added[1])
        source = replace("\n".join(removed[2:]), "\n".join(added[2:]))
    return source


@pytest.mark.parametrize("fused_linear", [False, True], ids=["logits", "fused-linear"])
def test_the_recipe_runs_on_openrlhf_own_actor_trainer(openrlhf_models, actor_step, tiny_path, tmp_path, monkeypatch,
                                                       fused_linear):
    """docs/integrations.md's diff applied to OpenRLHF 0.11.2's own ppo_actor.py: ActorPPOTrainer.__init__ builds the
    cache (the Actor's model DeepSpeed's engine, as OpenRLHF's strategy leaves it; `prepare_datasets` 0.11.2's
    PromptDataset with the chat template, without its file reading), and its training_step at theta0 has a Query-KL
    of 0, ERPO's metrics weighed per sample, and the status and every parameter's gradient of the unmodified step with
    PolicyLoss on the advantages times the cached w(q). A run resumed from a checkpoint (the engine's global_steps
    restored) without its cache is refused in one line, not scored afresh. The same with the lean path turned on by the
    page's second diff (`fused_linear=True` in both calls: the cache records it; PolicyModelActor.forward's old
    log-probs on the lean path, as actor_logprobs scores them). No Ray, no vLLM: a stand-in strategy that
    backpropagates."""
    import openrlhf.trainer
    from openrlhf.datasets import PromptDataset
    folder = Path(openrlhf.trainer.__file__).parent
    assert "\ndef prepare_datasets(strategy, tokenizer):" in (folder / "ppo_trainer.py").read_text()
    tokenizer = build_tokenizer()
    NS = types.SimpleNamespace
    args = NS(train=NS(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False),
              actor=NS(eps_clip_low_high=(0.2, 0.2), dual_clip=3.0, loss_agg_mode="token-mean",
                       policy_loss_type="ppo", aux_loss_coef=0.0, entropy_coef=None, model_name_or_path=tiny_path),
              algo=NS(advantage=NS(is_correction_level="off", is_correction_mode="mask", is_correction_gating="ratio",
                                   is_correction_threshold=(0.5, 5.0)), kl=NS(use_loss=False)),
              ds=NS(packing_samples=False), vllm=NS(), ckpt=NS(path=str(tmp_path)),
              data=NS(max_len=64, input_key="input", label_key=None, apply_chat_template=True),
              rollout=NS(max_new_tokens=None))
    strategy = NS(args=args, ring_attn_group=None, is_rank_0=lambda: True,
                  backward=lambda loss, model, optim: loss.backward(), optimizer_step=lambda *a, **k: None,
                  get_grad_norm=lambda model: 0.0)

    def prepare_datasets(strategy, tokenizer):   # 0.11.2's PromptDataset, in its dataloader (no files, no sampler)
        dataset = PromptDataset([{"input": q} for q in QUESTIONS], tokenizer, strategy)
        return torch.utils.data.DataLoader(dataset, 1, collate_fn=dataset.collate_fn), None, 1

    trainer_module = types.ModuleType("openrlhf.trainer.ppo_trainer")   # 0.11.2's imports vLLM (absent here)
    trainer_module.prepare_datasets = prepare_datasets
    package = types.ModuleType("openrlhf.trainer.ray")
    package.__path__ = [str(folder / "ray")]
    module = types.ModuleType("erpo_recipe_ppo_actor")
    module.__package__, module.__file__ = package.__name__, str(folder / "ray" / "ppo_actor.py")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, trainer_module.__name__, trainer_module)
        patch.setitem(sys.modules, package.__name__, package)
        exec(compile(recipe_source(Path(module.__file__).read_text(), fused_linear=fused_linear), module.__file__,
                     "exec"), module.__dict__)
    module.torch_dist_barrier_and_cuda_sync = lambda: None   # no process group here
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)   # NaiveReplayBuffer names cuda:N (a name only)

    actor = openrlhf_actor(openrlhf_models, tiny_path, torch.float32)
    actor.model = EngineStandIn(actor.model)
    trainer = module.ActorPPOTrainer(strategy, actor, None, None, NS(get_last_lr=lambda: [0.0]), tokenizer=tokenizer)
    cache_text = (tmp_path / "erpo_reference_cache.json").read_text()   # scored on the path the step takes
    assert ("path=openrlhf-fused-linear," if fused_linear else "path=openrlhf-actor,") in cache_text
    sequences, action_mask, attention_mask = step_batch(tokenizer, chat_prompts(tokenizer))
    with torch.no_grad():
        old = actor(sequences, action_mask, attention_mask=attention_mask) - 0.3 * action_mask
    advantages = (torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * action_mask).contiguous()
    _, training_step_class = actor_step
    experience = training_step_class(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                                     action_log_probs=old, advantages=advantages, info={})
    actor.zero_grad()
    ours = trainer.training_step(experience, 0.0, 0, dict(GLOBAL))
    our_grads = {name: p.grad.clone() for name, p in actor.named_parameters()}
    metrics = ours["metrics"]
    assert metrics["qkl"].abs().max() < 1e-10
    assert {ours["weights"][name] for name in ("qkl", "query_logp", "query_weight_mean")} == {"sample"}
    weight = metrics["query_weight_mean"]
    assert not torch.allclose(weight, torch.ones(len(QUESTIONS)))
    theirs, their_grads = run_actor_step(actor_step, actor, openrlhf_models.PolicyLoss(dual_clip=3.0), sequences,
                                         action_mask, attention_mask, old, advantages * weight[:, None])
    for name in ("policy_loss", "ppo_clip_ratio", "ppo_kl"):
        torch.testing.assert_close(metrics[name], theirs["metrics"][name], rtol=1e-6, atol=1e-7, msg=name)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)

    if fused_linear:   # PolicyModelActor.forward (the old log-probs, with the page's change; Ray's wrapper left out)
        old_forward = module.PolicyModelActor.__ray_metadata__.modified_class.forward
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
        old = old_forward(NS(actor=actor, strategy=strategy), sequences, action_mask, attention_mask)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        assert actor.training   # put back in train mode, as OpenRLHF's
        actor.eval()
        with torch.no_grad():
            lean = actor_logprobs(actor, sequences, action_mask, attention_mask, fused_linear=True).action_log_probs
        actor.train()
        torch.testing.assert_close(old, lean, rtol=0, atol=0)

    actor.model.global_steps = 7   # as DeepSpeed's load_checkpoint leaves a resumed run's engine
    args.ckpt.path = str(tmp_path / "resumed")
    with pytest.raises(ValueError, match=r"^no reference cache at .*resumed.*, and the run resumes at step 7: "):
        module.ActorPPOTrainer(strategy, actor, None, None, NS(get_last_lr=lambda: [0.0]), tokenizer=tokenizer)


def test_host_reads_per_micro_batch(make_actor, tiny_path, tmp_path):
    """What ERPO adds to OpenRLHF's step in host reads (LaunchCounter, as on CUDA): actor_logprobs reads what the
    actor's forward reads plus 2 (sample_sums' index check, the prompt tokens for the cache's key; plus 1 on the lean
    path, fused_linear=True: the scored rows' positions), the lookup none
    (its values go up without a wait), the loss 1 (the one-advantage-per-sample check), where PolicyLoss reads
    none."""
    from erpo.integrations.openrlhf_reference import load_or_build_query_reference
    tokenizer = build_tokenizer()
    actor = make_actor(torch.float32)
    prompts = chat_prompts(tokenizer)
    reference = load_or_build_query_reference(actor, tokenizer, prompts, path=str(tmp_path / "cache.json"),
                                              model_path=tiny_path)
    sequences, action_mask, attention_mask = step_batch(tokenizer, prompts)
    old = torch.full(action_mask.shape, -3.0) * action_mask
    advantages = (torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * action_mask).contiguous()
    with LaunchCounter() as forward:
        actor(sequences, action_mask, attention_mask=attention_mask)
    with LaunchCounter() as scoring:
        scores = actor_logprobs(actor, sequences, action_mask, attention_mask)
    with LaunchCounter() as lookup:
        ref_query_logp, query_weight = reference.lookup(scores.prompt_ids, device=sequences.device)
    with LaunchCounter() as loss_reads:
        loss, *_ = ERPOPolicyLoss()(scores.action_log_probs, old, advantages, action_mask=action_mask,
                                    query_logp=scores.query_logp, ref_query_logp=ref_query_logp,
                                    query_weight=query_weight, info={}, **GLOBAL)
        loss.backward()
    assert (scoring.syncs - forward.syncs, lookup.syncs, loss_reads.syncs) == (2, 0, 1)
    with LaunchCounter() as lean:   # the lean path: one more, the scored rows' positions (its forward reads as Actor's)
        actor_logprobs(actor, sequences, action_mask, attention_mask, fused_linear=True)
    assert lean.syncs - forward.syncs == 3


@pytest.mark.parametrize("installed", ["0.11.2", "0.12.0", None], ids=["tested", "another", "absent"])
def test_another_openrlhf_release_is_warned_of(monkeypatch, installed):
    """The tested release (OPENRLHF_VERSION) builds the loss silently, and so does a machine without OpenRLHF (the
    loss does not import it); another release is warned of, naming both. The installed release is what
    importlib.metadata reports, set here."""
    def version(name):
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed if name == "openrlhf" else real_version(name)

    real_version = importlib.metadata.version
    monkeypatch.setattr(integration.importlib.metadata, "version", version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ERPOPolicyLoss()
    release_warnings = [str(w.message) for w in caught if "tested against OpenRLHF" in str(w.message)]
    if installed == "0.12.0":
        assert release_warnings == ["erpo.integrations.openrlhf is tested against OpenRLHF 0.11.2, this is OpenRLHF "
                                    "0.12.0: run tests/integrations/test_openrlhf_integration.py with it before "
                                    "trusting the parity"]
    else:
        assert release_warnings == []
