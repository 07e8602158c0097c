"""API.md's math, written sample by sample in float64 with plain autograd: the oracle of the oracle."""
import math

import torch


def k_estimator(r, name):
    return {"k1": -r, "k2": r * r / 2, "k3": torch.exp(r) - r - 1}[name]


def k_slope(r, name):
    return {"k1": -torch.ones_like(r), "k2": r, "k3": torch.exp(r) - 1}[name]


def sequence_k_estimator(r, name, limit):
    """The sequence-level Query-KL: the estimator inside [-limit, limit], its tangent line at the edge beyond."""
    if abs(float(r.detach())) <= limit:
        return k_estimator(r, name)
    edge = torch.tensor(limit if float(r.detach()) > 0 else -limit, dtype=torch.float64)
    return k_estimator(edge, name) + k_slope(edge, name) * (r - edge)


def plain_erpo_loss(logits, targets, token_kind, sample_index, *, advantages, ref_query_logp=None, query_weight=None,
                    old_logp=None, ref_logp=None, token_weight=None, rollout_logp=None, rollout_is_cap=2.0,
                    qkl_coef=0.01, qkl_estimator="k3", policy_kl_coef=0.0,
                    clip_low=0.2, clip_high=0.2, dual_clip=None, ratio_level="token", temperature=1.0,
                    entropy_coef=0.0, loss_agg="token-mean", log_ratio_clamp=20.0, num_items=None, num_seqs=None,
                    policy_kl_bias_correction=False, kl_clamp=None, pg_log_ratio_clamp=None, entropy_agg="loss-agg",
                    qkl_linear_beyond=5.0, pg_objective="ppo-clip", cispo_clip_max=5.0, sapo_temperature_pos=1.0,
                    sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                    vespo_lambda_neg=2.0, off_policy_mask_threshold=None, top_entropy_quantile=1.0):
    z = logits.double() / temperature
    log_probs = torch.log_softmax(z, -1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(-1)
    logp = log_probs.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    c = log_ratio_clamp

    def kl_clamped(value):
        return value if kl_clamp is None else value.clamp(-kl_clamp, kl_clamp)

    def kl(r, name):  # per token: r clamped to [-c, c]
        return kl_clamped(k_estimator(r.clamp(-c, c), name))
    terms_by_sample, qkl_by_sample = {}, {}
    resp_log_ratio = {}
    response_entropy = []
    response = token_kind == 2
    kept_by_entropy = torch.ones_like(response)   # the entropy filter: rows at or above the (1 - rho)-quantile
    if top_entropy_quantile < 1 and response.any():
        kept_by_entropy = entropy >= torch.quantile(entropy[response], 1 - top_entropy_quantile)
    for s in range(len(advantages)):
        rows = (sample_index == s) & (token_kind == 2)
        if old_logp is not None:
            resp_log_ratio[s] = (logp[rows] - old_logp[rows].double())
        else:
            resp_log_ratio[s] = logp[rows] - logp[rows].detach()
    def old_of(row):
        return logp[row].detach() if old_logp is None else old_logp[row].double()

    def clamped(x, c):
        return x if c is None else x.clamp(-c, c)
    for s in range(len(advantages)):
        a = advantages[s].double()
        w = 1.0 if query_weight is None else query_weight[s].double()
        rows = ((sample_index == s) & (token_kind == 2)).nonzero().flatten()
        qrows = ((sample_index == s) & (token_kind == 1)).nonzero().flatten()
        if pg_objective == "vespo":  # phi(w_s), w_s = prod_t ratio_t (x the rollout correction), logs clamped
            log_w = sum((clamped(resp_log_ratio[s][i], pg_log_ratio_clamp).clamp(-20, 20) for i in range(len(rows))),
                        torch.zeros((), dtype=torch.float64)).detach()
            if rollout_logp is not None and rollout_is_cap is not None:
                for row in rows:
                    log_is = (old_of(row) - rollout_logp[row].double()).clamp(max=math.log(rollout_is_cap))
                    log_w = log_w + log_is.clamp(math.log(1e-8), 20)
            log_w = log_w.clamp(math.log(1e-8), 20)
            k, lam = (vespo_k_pos, vespo_lambda_pos) if a >= 0 else (vespo_k_neg, vespo_lambda_neg)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        keep_sample = True
        if off_policy_mask_threshold is not None and len(rows):  # drop A < 0 samples that drifted off-policy
            behaviour = [old_of(row) if rollout_logp is None else rollout_logp[row].double() for row in rows]
            drift = torch.stack([b - logp[row].detach() for b, row in zip(behaviour, rows)]).mean()
            keep_sample = bool(a >= 0) or bool(drift <= off_policy_mask_threshold)
        terms = []
        for i, row in enumerate(rows):
            lr = resp_log_ratio[s][i] if ratio_level == "token" else resp_log_ratio[s].mean()
            ratio = torch.exp(clamped(lr, pg_log_ratio_clamp))
            if pg_objective == "ppo-clip":
                pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high))
                if dual_clip is not None and a < 0:
                    pg = torch.minimum(pg, -a * dual_clip)
            elif pg_objective == "cispo":
                pg = -ratio.detach().clamp(max=cispo_clip_max) * a * logp[row]
            elif pg_objective == "sapo":
                tau = sapo_temperature_pos if a > 0 else sapo_temperature_neg
                pg = -a * 4 / tau * torch.sigmoid(tau * (ratio - 1))
            else:
                pg = -phi * a * logp[row]
            if not keep_sample or not kept_by_entropy[row]:
                pg = 0 * pg
            term = w * pg if token_weight is None else w * token_weight[row].double() * pg
            if rollout_logp is not None and rollout_is_cap is not None and pg_objective != "vespo":
                term = term * torch.exp(old_of(row) - rollout_logp[row].double()).clamp(max=rollout_is_cap)
            if policy_kl_coef:
                policy_kl = kl(ref_logp[row].double() - logp[row], "k3")
                term = term + policy_kl_coef * (ratio * policy_kl if policy_kl_bias_correction else policy_kl)
            if kept_by_entropy[row]:  # the entropy bonus acts on the rows the entropy filter keeps
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
                r = ref_query_logp[s].double() - logp[qrows].sum()
                qkl_by_sample[s] = kl_clamped(sequence_k_estimator(r, qkl_estimator, qkl_linear_beyond))
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
