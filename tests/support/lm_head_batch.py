"""The per-rank batch of the lm_head workers (tests/workers/zero3_worker.py, tests/workers/fsdp2_worker.py):
ROWS_PER_RANK token rows of SAMPLES_PER_RANK samples (3 query + 2 response rows each, row 0 unscored) over a
VOCAB-token vocabulary."""
import torch

VOCAB, DIM, ROWS_PER_RANK, SAMPLES_PER_RANK = 96, 16, 20, 4


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
