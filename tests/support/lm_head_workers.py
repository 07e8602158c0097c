"""What the lm_head workers (tests/workers/zero3_worker.py, tests/workers/fsdp2_worker.py) share: the per-rank batch,
ROWS_PER_RANK token rows of SAMPLES_PER_RANK samples (3 query + 2 response rows each, row 0 unscored) over a
VOCAB-token vocabulary; the tiny LM's embedding and lm_head, untied or tied; and the fused-linear loss on the batch."""
import torch

from erpo_kernels.fused_linear import fused_linear_erpo_loss

VOCAB, DIM, ROWS_PER_RANK, SAMPLES_PER_RANK = 96, 16, 20, 4
# the loss options of the steps the workers check (the Query-KL and the entropy bonus on, the torch reference)
GRADED_OPTIONS = dict(qkl_coef=0.5, entropy_coef=0.1, backend="torch")


def rank_batch(rank: int) -> dict:
    """`ids` [ROWS_PER_RANK + 1] (row t is scored on ids[t + 1]), `kind`, `sample_index` [ROWS_PER_RANK],
    `advantages`, `ref_query_logp` [SAMPLES_PER_RANK]; the same on every call for one rank."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (ROWS_PER_RANK + 1,), generator=g)
    kind = torch.tensor([1, 1, 1, 2, 2] * (ROWS_PER_RANK // 5))
    kind[0] = 0
    return dict(ids=ids, kind=kind, sample_index=torch.arange(ROWS_PER_RANK) // 5,
                advantages=torch.randn(SAMPLES_PER_RANK, generator=g),
                ref_query_logp=-torch.rand(SAMPLES_PER_RANK, generator=g) * 10 - 10)


def batch_loss(hidden: torch.Tensor, weight: torch.Tensor, batch: dict, **options):
    """`fused_linear_erpo_loss` of hidden [ROWS_PER_RANK, DIM] through weight [VOCAB, DIM] on `batch` (`rank_batch`'s:
    its next tokens, kinds, samples, advantages and reference Query log-probs), `options` (bias, qkl_coef, backend,
    ...) passed on; its LossOutput."""
    return fused_linear_erpo_loss(hidden, weight, batch["ids"][1:], batch["kind"], batch["sample_index"],
                                  advantages=batch["advantages"], ref_query_logp=batch["ref_query_logp"], **options)


class TinyLM(torch.nn.Module):
    """`embed` (VOCAB x DIM, scaled by 0.5) -> the subclass's body (`add_body`) -> hidden states [N, DIM], and
    `lm_head` DIM -> VOCAB: untied with a bias, or tied to the embedding without one. The fused loss reads the head's
    weight; the subclass's `forward` says whether it runs the head."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.add_body()  # the subclass's, made here: its parameters drawn after the embedding's, before the head's
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=not tied)
        with torch.no_grad():
            self.embed.weight.mul_(0.5)
        if tied:
            self.lm_head.weight = self.embed.weight

    def get_output_embeddings(self):
        return self.lm_head
