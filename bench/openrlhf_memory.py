"""Peak host memory of one OpenRLHF actor step's scoring on the CPU, on each path of `actor_logprobs`.

    python -m bench.openrlhf_memory [--lengths 512,2048] [--vocab 152064]

For each sequence length T and each path (`fused_linear=False`: Actor.forward's fp32 logits [1, T, V] scored by
`token_logprobs`; `fused_linear=True`: the backbone's final hidden states x the lm_head in the kernels, the logits
never built), a fresh process builds OpenRLHF 0.11.2's `Actor` around a one-layer Qwen2 of hidden size 64 and
vocabulary `--vocab` (Qwen2.5's by default) in bf16 (OpenRLHF's param_dtype), runs `actor_logprobs` on one sequence
of T tokens (half prompt, half action, with the entropy, as OpenRLHF's entropy loss asks) and the backward of
ell_theta(q) + the action log-probs + the entropy. Reported per process, from the kernel's own counters: the peak
resident set before the step (imports, model; `ru_maxrss`), the peak after it, and their difference, what the step
added on top (MB = 10^6 bytes). The torch backend of the kernels (the CPU's), which forms a chunk's logits
[LOGITS_ROWS, V] at a time. OpenRLHF must be installed (`pip install --no-deps openrlhf==0.11.2`); its
ring-attention module, which imports flash-attn at its top, is replaced by `ring_attention_stand_in` (no packing
here).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import types

HIDDEN = 64


def ring_attention_stand_in() -> types.ModuleType:
    """A stand-in for `openrlhf.models.ring_attn_utils`, which imports flash_attn at its top (absent on a CPU
    machine). Its helpers serve the packed path only (packing_samples, ring attention), which is then refused; its
    record of the ring group says none, as OpenRLHF's without ring attention. Stubbing that module rather than
    flash_attn keeps flash_attn absent for transformers, which probes it."""
    def packed_path_only(*args, **kwargs):
        raise RuntimeError("the packed path needs flash-attn, absent here")

    stand_in = types.ModuleType("openrlhf.models.ring_attn_utils")
    for name in ("gather_and_pad_tensor", "unpad_and_slice_tensor", "set_ring_attn_group"):
        setattr(stand_in, name, packed_path_only)
    stand_in.get_ring_attn_group = lambda: None
    return stand_in


def peak_mb() -> float:
    """The process's peak resident set so far, MB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def one_step(fused_linear: bool, length: int, vocab: int) -> dict:
    """{"before", "after", "added"}: peak resident MB before and after one scoring step and its backward (module
    docstring)."""
    import torch
    import transformers

    sys.modules["openrlhf.models.ring_attn_utils"] = ring_attention_stand_in()
    from openrlhf.models import Actor

    from erpo.integrations.openrlhf import actor_logprobs

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      use_cache=False, attn_implementation="sdpa")
    actor = Actor(transformers.Qwen2ForCausalLM(config).to(torch.bfloat16))
    actor.packing_samples = False   # Actor(model) leaves it unset (a pretrain path sets it)
    sequences = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(1, length, dtype=torch.long)
    action_mask = torch.zeros(1, length - 1, dtype=torch.bool)
    action_mask[:, length // 2:] = True
    before = peak_mb()
    scores = actor_logprobs(actor, sequences, action_mask, attention_mask, return_entropy=True,
                            fused_linear=fused_linear)
    entropy = scores.output.entropy[:, -action_mask.shape[1]:] * action_mask
    (scores.query_logp.sum() + scores.action_log_probs.sum() + entropy.sum()).backward()
    after = peak_mb()
    return {"before": round(before), "after": round(after), "added": round(after - before)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.openrlhf_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048", help="sequence lengths T, comma-separated")
    parser.add_argument("--vocab", type=int, default=152064, help="vocabulary size V")
    parser.add_argument("--one", nargs=2, metavar=("PATH", "T"), help=argparse.SUPPRESS)   # a child process's run
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_step(args.one[0] == "fused-linear", int(args.one[1]), args.vocab)))
        return
    print(f"V = {args.vocab}, D = {HIDDEN}, bf16 weights, one sequence; peak resident MB of a fresh process")
    print("| T | path | [T, V] fp32 logits (MB) | peak before the step | peak after | added by the step |")
    print("|---|---|---|---|---|---|")
    for length in (int(t) for t in args.lengths.split(",")):
        for path in ("logits", "fused-linear"):
            run = subprocess.run([sys.executable, "-m", "bench.openrlhf_memory", "--vocab", str(args.vocab), "--one",
                                  path, str(length)], capture_output=True, text=True, check=True)
            row = json.loads(run.stdout.strip().splitlines()[-1])
            logits_mb = round(length * args.vocab * 4 / 1e6)
            print(f"| {length} | {path} | {logits_mb} | {row['before']} | {row['after']} | {row['added']} |")


if __name__ == "__main__":
    main()
