"""`python -m bench.padded_rows`: what keeping every position as a row costs `padded_erpo_loss` on logits, timed.

Since issue 32 item 1 the logits path of `padded_erpo_loss` runs the loss on all B * T positions (kind 0 where
nothing is scored): no host read, no [R, V] copy of the logits, no scatter of its gradient, but the log-prob kernel's
forward reads the unscored rows' logits too (docs/API.md, "What one call costs on the Triton path"). This times its
fwd+bwd against the scored rows selected first (`logits.reshape(B * T, V)[rows]`, the boolean selection it made
before; its mask checks aside) on the same bf16 batch in TRL's layout, at a few fractions of scored positions.
Prompts are left-padded to P (half of them real), completions right-padded to C; the scored fraction sets the
completions' lengths. Both run with validate=False on the Triton backend.
"""
from __future__ import annotations

import argparse

import torch

from bench.timing import time_callable
from erpo_kernels import completion_layout, erpo_loss, padded_erpo_loss


def trl_batch(batch: int, prompt: int, completion: int, vocab: int, scored: float, device: torch.device):
    """A [B, T] batch in TRL's layout whose scored rows are about `scored` of the B * T positions, bf16 logits
    [B, T, V] N(0, 2^2), and the completion-aligned old log-probs."""
    g = torch.Generator().manual_seed(0)
    width = prompt + completion
    real_prompt = max(prompt // 2, 1)
    length = min(max(round(scored * width) - real_prompt, 1), completion)
    prompt_mask = torch.zeros(batch, prompt, dtype=torch.long)
    prompt_mask[:, prompt - real_prompt:] = 1
    completion_mask = torch.zeros(batch, completion, dtype=torch.long)
    completion_mask[:, :length] = 1
    inputs = dict(prompt_ids=torch.randint(0, vocab, (batch, prompt), generator=g), prompt_mask=prompt_mask,
                  completion_ids=torch.randint(0, vocab, (batch, completion), generator=g),
                  completion_mask=completion_mask, advantages=torch.randn(batch, generator=g),
                  ref_query_logp=-torch.rand(batch, generator=g) * 20 - 10,
                  old_logp=-torch.rand(batch, completion, generator=g) * 4)
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    # drawn on the device: [B, T, V] on the CPU would take most of a GPU lease to fill and copy
    on_device = torch.Generator(device).manual_seed(0)
    logits = torch.randn(batch, width, vocab, generator=on_device, device=device, dtype=torch.bfloat16)
    logits = logits.mul_(2).requires_grad_()
    return logits, inputs


def every_position(logits, inputs, options):
    """padded_erpo_loss as it is: all B * T positions as rows."""
    padded_erpo_loss(logits=logits, **inputs, **options).loss.backward()


def scored_rows_selected(logits, inputs, options):
    """The same loss on the scored rows selected first (a boolean index), the per-row results placed back."""
    masks = {k: inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    layout = completion_layout(**masks, validate=False)
    scored = layout.scored()
    rows = logits.reshape(-1, logits.shape[-1])[layout.rows]
    out = erpo_loss(rows, scored.targets, scored.token_kind, scored.sample_index, advantages=inputs["advantages"],
                    ref_query_logp=inputs["ref_query_logp"], old_logp=scored.scatter(inputs["old_logp"]), **options)
    scored.gather(out.token_logp)
    out.loss.backward()


def run(*, batch: int, prompt: int, completion: int, vocab: int, fractions, reps: int, warmup: int,
        device: torch.device) -> list[dict]:
    """One row per scored fraction: milliseconds (median) of fwd+bwd of both pipelines, and the scored rows R."""
    options = dict(backend="triton", validate=False, qkl_coef=0.01)
    results = []
    for fraction in fractions:
        logits, inputs = trl_batch(batch, prompt, completion, vocab, fraction, device)
        scored = int(completion_layout(**{k: inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                  "completion_mask")}).rows.sum())
        row = dict(fraction=fraction, positions=logits.shape[0] * logits.shape[1], scored=scored)
        for name, pipeline in (("every_position", every_position), ("selected", scored_rows_selected)):
            def step(pipeline=pipeline, logits=logits, inputs=inputs):
                logits.grad = None
                pipeline(logits, inputs, options)
            row[f"{name}_ms"] = time_callable(step, device=device, warmup=warmup, reps=reps).median_ms
        results.append(row)
    return results


def markdown(results: list[dict]) -> str:
    lines = ["| scored / positions | R | every position (now), ms | scored rows selected (as before), ms |",
             "|---|---|---|---|"]
    for row in results:
        lines.append(f"| {row['scored'] / row['positions']:.2f} | {row['scored']} | {row['every_position_ms']:.3f} | "
                     f"{row['selected_ms']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.padded_rows", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="B")
    parser.add_argument("--prompt", type=int, default=256, help="P, prompt columns (half of them real)")
    parser.add_argument("--completion", type=int, default=1792, help="C, completion columns")
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--fractions", default="0.9,0.5,0.15", help="scored fractions of the B * T positions")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = run(batch=args.batch, prompt=args.prompt, completion=args.completion, vocab=args.vocab,
                  fractions=[float(f) for f in args.fractions.split(",")], reps=args.reps, warmup=args.warmup,
                  device=device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, B={args.batch}, P={args.prompt}, C={args.completion}, "
          f"V={args.vocab}, bf16, fwd+bwd median of {args.reps}\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
