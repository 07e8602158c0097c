"""`HFRollout`: sampling with transformers `generate` on the training model itself (CPU, tests, small runs)."""
from __future__ import annotations

import torch

from erpo import distributed as D
from erpo.rollout.engine import RolloutBatch, RolloutEngine

# The model's generation_config (generation_config.json) fills every `generate` setting left unset, and many
# checkpoints ship sampling defaults (Qwen2.5-Instruct: repetition_penalty 1.05). Each setting that would reshape
# the next-token distribution, stop a response early or search over beams is set to its neutral value here, so
# the engine samples from the policy at the run's temperature / top_p (the distribution the loss's log-probs and
# vLLM's SamplingParams assume), whatever the checkpoint's defaults.
POLICY_SAMPLING = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None,
                   "min_length": 0, "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                   "exponential_decay_length_penalty": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                   "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
                   "guidance_scale": None, "watermarking_config": None, "num_beams": 1, "num_return_sequences": 1,
                   "stop_strings": None, "max_time": None}


class HFRollout(RolloutEngine):
    """Sampling with `model.generate` on the training model itself (colocated, so `sync_weights` is a no-op).

    `batch_size` bounds how many prompts go through one `generate` call. Returns the sampling log-probs
    (after temperature and top-p) of the generated tokens.
    """

    seeding = "hf-1"   # torch.manual_seed(seed) at each generate call, its chunks of prompts drawn in order

    def __init__(self, model, tokenizer, *, batch_size: int = 64):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        if not eos:
            raise ValueError("HFRollout: neither the model's generation_config nor the tokenizer defines an EOS token")
        self.eos_ids = sorted(set(eos))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    def sync_weights(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def generate(self, prompt_ids, *, n, temperature, top_p=1.0, max_new_tokens, seed=None) -> RolloutBatch:
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("prompt_ids must be a non-empty list of non-empty token lists")
        if n <= 0 or max_new_tokens <= 0 or temperature <= 0:
            raise ValueError(f"need n > 0, max_new_tokens > 0, temperature > 0; got {n}, {max_new_tokens}, "
                             f"{temperature}")
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        batch = RolloutBatch([], [], [], [], [])
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                if seed is not None:
                    torch.manual_seed(seed)
                for start in range(0, len(prompt_ids), self.batch_size):
                    self._generate_chunk(prompt_ids[start:start + self.batch_size], start, n, temperature, top_p,
                                         max_new_tokens, device, batch)
        finally:
            self.model.train(was_training)
        return batch

    def _zero3_partitioned(self) -> bool:
        """True when DeepSpeed ZeRO-3 shards the weights over several ranks: every rank must then run the same
        number of forward passes (`generate(synced_gpus=True)`) and call `generate` equally often."""
        return D.world_size() > 1 and any(D.is_zero3_param(p) for p in self.model.parameters())

    def _generate_chunk(self, prompts, offset, n, temperature, top_p, max_new_tokens, device, batch):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):                      # left padding for generation
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.repeat_interleave(n, 0).to(device), mask.repeat_interleave(n, 0).to(device)
        out = self.model.generate(input_ids=ids, attention_mask=mask, **POLICY_SAMPLING, do_sample=True,
                                  temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_new_tokens,
                                  eos_token_id=self.eos_ids, pad_token_id=self.pad_id, output_scores=True,
                                  return_dict_in_generate=True, synced_gpus=self._zero3_partitioned())
        new_tokens = out.sequences[:, width:].cpu()
        scores = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu()   # [B*n, T, V] sampling log-probs
        logp = scores.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        eos = torch.tensor(self.eos_ids)
        for row in range(new_tokens.shape[0]):
            tokens = new_tokens[row].tolist()
            hits = torch.isin(new_tokens[row], eos).nonzero()
            end = int(hits[0]) + 1 if len(hits) else len(tokens)
            batch.prompt_index.append(offset + row // n)
            batch.prompt_ids.append(list(prompts[row // n]))
            batch.response_ids.append(tokens[:end])
            batch.response_logp.append(logp[row, :end].tolist())
            batch.truncated.append(not len(hits))
