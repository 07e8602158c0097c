"""The multi-rank ERPO update's parts that tests/workers/multirank_worker.py runs on each rank and
tests/distributed/test_multirank.py runs in one process to compare: a rank's share of the loss, and the optimizer."""
import torch

from erpo import distributed as D
from erpo.train.advantages import compute_advantages
from erpo_kernels import erpo_loss, from_padded


def rank_loss(model, batch, sample_ids, loss_agg):
    """This rank's share of the global ERPO loss on samples `sample_ids` (whole groups): group advantages
    computed locally, normalizers all-reduced. The shares of all ranks sum to the single-process loss."""
    n = batch["group_size"]
    ids = batch["input_ids"][sample_ids]
    mask = batch["attention_mask"][sample_ids]
    response = batch["response_mask"][sample_ids]
    rows = from_padded(ids, mask, response)
    advantages = compute_advantages(batch["rewards"][sample_ids], n)
    logits = model(input_ids=ids, attention_mask=mask).logits
    num_items = D.all_reduce_sum(int((rows.token_kind == 2).sum()))
    num_seqs = D.all_reduce_sum(len(sample_ids))
    out = erpo_loss(logits.reshape(-1, logits.shape[-1]), rows.targets, rows.token_kind, rows.sample_index,
                    advantages=advantages, ref_query_logp=batch["ref_query_logp"][sample_ids],
                    query_weight=batch["query_weight"][sample_ids], ref_logp=batch["ref_logp"][sample_ids].reshape(-1),
                    qkl_coef=0.5, policy_kl_coef=0.1, loss_agg=loss_agg, num_items=num_items, num_seqs=num_seqs,
                    backend="torch")
    return out.loss


def make_optimizer(model):
    """SGD (its update is proportional to the gradient, so a wrong loss scale shows) with momentum and a
    decaying LR, so that a resume that lost optimizer or scheduler state would diverge."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
