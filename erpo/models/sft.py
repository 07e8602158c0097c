"""Supervised warm start that turns the freshly built tiny model into theta0 (the pre-RL model), cached on disk.

The SFT data are arithmetic problems in the training prompt format with the response
`\\boxed{c}`; the loss covers the prompt tokens too (theta0 models queries, as a pretrained
LM does). Training is short on purpose, so that theta0 is only partly accurate and RL has room to improve it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from pathlib import Path

import torch

from erpo.atomic import publish
from erpo.errors import stopped_at_once_is
from erpo.models.tiny import build_model, build_tokenizer
from erpo.progress import progress as progress_display
from erpo.tasks.data import arithmetic_dataset, build_prompt

log = logging.getLogger("erpo")
SFT_FORMAT_VERSION = 2


def worked_response(answer: str, eos_token: str) -> str:
    """The SFT target for an arithmetic problem: `\\boxed{answer}` + EOS (short, so CPU rollouts stay cheap)."""
    return f"\\boxed{{{answer}}}{eos_token}"


def sft_warm_start(model, tokenizer, examples: list[tuple[str, str]], *, steps: int, batch_size: int, lr: float,
                   seed: int, progress: bool = False) -> list[float]:
    """Train `model` in place on (prompt, response) text pairs with next-token cross-entropy over every token
    but the first, AdamW + cosine decay. Returns the loss per step (nats per token). `progress`: show it
    (erpo.progress)."""
    if steps <= 0 or batch_size <= 0 or not examples:
        raise ValueError(f"need steps > 0, batch_size > 0 and examples; got {steps}, {batch_size}, {len(examples)}")
    rng = random.Random(seed)
    encoded = [tokenizer(p + r, add_special_tokens=False)["input_ids"] for p, r in examples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    pad = tokenizer.pad_token_id
    model.train()
    losses = []
    with torch.random.fork_rng(devices=[]), progress_display(steps, "tiny theta0 SFT", "step",
                                                             enabled=progress) as shown:
        torch.manual_seed(seed)
        for _ in range(steps):
            rows = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
            width = max(map(len, rows))
            ids = torch.full((batch_size, width), pad, dtype=torch.long)
            labels = torch.full((batch_size, width), -100, dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, :len(row)] = torch.tensor(row)
                labels[i, :len(row)] = torch.tensor(row)
            loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            shown.set_postfix(loss=f"{losses[-1]:.3f}")
            shown.update(1)
    model.eval()
    return losses


def tiny_theta0(cfg) -> str:
    """Path of the cached SFT-warm-started tiny model (+ tokenizer) for this config; built on first use."""

    t, d = cfg.tiny, cfg.data
    key = {"version": SFT_FORMAT_VERSION, "tiny": vars(t), "template": d.template,
           "use_chat_template": d.use_chat_template, "max_operand": d.arithmetic_max_operand, "seed": cfg.trainer.seed}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cfg.model.cache_dir).expanduser() / f"tiny-theta0-{digest}"
    if is_complete_model_dir(path):
        log.info("tiny theta0: using cached SFT warm start %s", path)
        return str(path)
    log.info("tiny theta0: building the tiny model and running %d SFT steps (cached in %s)", t.sft_steps, path)
    # stopped at once (Ctrl-C, SIGTERM), it leaves nothing: publish removes its temporary copy
    with stopped_at_once_is("the tiny model's SFT warm start; nothing was cached (the same command runs it "
                            "again)"):
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, cfg.trainer.seed, hidden_size=t.hidden_size, num_layers=t.num_layers,
                            num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, intermediate_size=t.intermediate_size)
        records = arithmetic_dataset(t.sft_examples, seed=cfg.trainer.seed + 1, max_operand=d.arithmetic_max_operand)
        examples = [(build_prompt(tokenizer, r["problem"], d.template, d.use_chat_template),
                     worked_response(r["answer"], tokenizer.eos_token)) for r in records]
        losses = sft_warm_start(model, tokenizer, examples, steps=t.sft_steps, batch_size=t.sft_batch_size, lr=t.sft_lr,
                                seed=cfg.trainer.seed, progress=cfg.logging.progress_bar)
        log.info("tiny theta0: SFT loss %.3f -> %.3f", losses[0], losses[-1])

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        # Runs started side by side (a seed sweep, ERPO vs GRPO) may all build it: the first one published is used by
        # every run, the others discard their own copy (the same weights: same config, same seed).
        if not publish(path, write, keep=is_complete_model_dir):
            log.info("tiny theta0: another run published %s first; using it", path)
    return str(path)


def is_complete_model_dir(path: Path) -> bool:
    """Whether `path` holds what `from_pretrained` needs of a tiny theta0: config, weights and tokenizer."""
    return all((path / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer_config.json"))
