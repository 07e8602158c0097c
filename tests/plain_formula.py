"""API.md's math, written sample by sample in float64 with plain autograd: the oracle of the oracle."""
import torch


def k_estimator(r, name):
    return {"k1": -r, "k2": r * r / 2, "k3": torch.exp(r) - r - 1}[name]


def plain_erpo_loss(logits, targets, token_kind, sample_index, *, advantages, ref_query_logp=None, query_weight=None,
                    old_logp=None, ref_logp=None, token_weight=None, rollout_logp=None, rollout_is_cap=2.0,
                    qkl_coef=0.01, qkl_estimator="k3", policy_kl_coef=0.0,
                    clip_low=0.2, clip_high=0.2, dual_clip=None, ratio_level="token", temperature=1.0,
                    entropy_coef=0.0, loss_agg="token-mean", log_ratio_clamp=20.0, num_items=None, num_seqs=None,
                    policy_kl_bias_correction=False, kl_clamp=None, pg_log_ratio_clamp=None, entropy_agg="loss-agg"):
    z = logits.double() / temperature
    log_probs = torch.log_softmax(z, -1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(-1)
    logp = log_probs.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    c = log_ratio_clamp

    def kl(r, name):
        value = k_estimator(r.clamp(-c, c), name)
        return value if kl_clamp is None else value.clamp(-kl_clamp, kl_clamp)
    terms_by_sample, qkl_by_sample = {}, {}
    resp_log_ratio = {}
    response_entropy = []
    for s in range(len(advantages)):
        rows = (sample_index == s) & (token_kind == 2)
        if old_logp is not None:
            resp_log_ratio[s] = (logp[rows] - old_logp[rows].double())
        else:
            resp_log_ratio[s] = logp[rows] - logp[rows].detach()
    for s in range(len(advantages)):
        a = advantages[s].double()
        w = 1.0 if query_weight is None else query_weight[s].double()
        rows = ((sample_index == s) & (token_kind == 2)).nonzero().flatten()
        qrows = ((sample_index == s) & (token_kind == 1)).nonzero().flatten()
        terms = []
        for i, row in enumerate(rows):
            lr = resp_log_ratio[s][i] if ratio_level == "token" else resp_log_ratio[s].mean()
            if pg_log_ratio_clamp is not None:
                lr = lr.clamp(-pg_log_ratio_clamp, pg_log_ratio_clamp)
            ratio = torch.exp(lr)
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high))
            if dual_clip is not None and a < 0:
                pg = torch.minimum(pg, -a * dual_clip)
            term = w * pg if token_weight is None else w * token_weight[row].double() * pg
            if rollout_logp is not None:
                old = logp[row].detach() if old_logp is None else old_logp[row].double()
                term = term * torch.exp(old - rollout_logp[row].double()).clamp(max=rollout_is_cap)
            if policy_kl_coef:
                policy_kl = kl(ref_logp[row].double() - logp[row], "k3")
                term = term + policy_kl_coef * (ratio * policy_kl if policy_kl_bias_correction else policy_kl)
            if entropy_agg == "loss-agg":
                term = term - entropy_coef * entropy[row]
            response_entropy.append(entropy[row])
            terms.append(term)
        if terms:
            terms_by_sample[s] = torch.stack(terms)
        if len(qrows):
            if qkl_estimator == "k3-token":
                qkl_by_sample[s] = kl(ref_logp[qrows].double() - logp[qrows], "k3").mean()
            elif ref_query_logp is not None:
                qkl_by_sample[s] = kl(ref_query_logp[s].double() - logp[qrows].sum(), qkl_estimator)
    if not terms_by_sample:
        pg_part = torch.zeros((), dtype=torch.float64)
    elif loss_agg == "token-mean":
        all_terms = torch.cat(list(terms_by_sample.values()))
        pg_part = all_terms.sum() / (num_items if num_items is not None else len(all_terms))
    else:
        per = [t.mean() if loss_agg == "seq-mean-token-mean" else t.sum() for t in terms_by_sample.values()]
        pg_part = torch.stack(per).sum() / (num_seqs if num_seqs is not None else len(per))
    loss = pg_part
    if entropy_agg == "token-mean" and response_entropy:  # TRL: mean over the response tokens, whatever loss_agg
        loss = loss - entropy_coef * torch.stack(response_entropy).mean()
    if qkl_coef and qkl_by_sample:
        divisor = num_seqs if num_seqs is not None else len(qkl_by_sample)
        qkl = torch.stack(list(qkl_by_sample.values())).sum() / divisor
        loss = loss + qkl_coef * qkl
    return loss
