"""A stand-in `vllm` package that records every call, for testing erpo.rollout.vllm without a GPU.

It mirrors the public surface erpo uses: `LLM(**kwargs)`, `SamplingParams(**kwargs)`, `LLM.generate`
returning RequestOutput-like objects (`.outputs[j]` with `index`, `token_ids`, `logprobs` as
{token_id: Logprob}, `finish_reason`), `reset_prefix_cache`, `sleep(level)`, `wake_up(tags)`, the
in-process model at `llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights`
(`LLM`, as vLLM versions without `apply_model`) or through `LLM.apply_model` (`ApplyModelLLM`),
and `vllm.distributed.parallel_state.get_tp_group`.

It rejects what real vLLM (0.10.2 .. 0.33, vllm/sampling_params.py and vllm/entrypoints/llm.py) rejects:
SamplingParams keywords outside the real signature (TypeError), a top_p outside (0, 1], a temperature
below 0, a params list whose length differs from the prompts', a temperature above 2 at generate
(0.33's check), and generation while any part of the engine sleeps or after a level-2 sleep discarded the
weights without a reload. Like real SamplingParams it raises 0 < temperature < 0.01 to 0.01 silently; with
logprobs=0 each position holds the sampled token's entry only.

Generation is deterministic: sample j of a prompt emits tokens (last prompt token + j + 1 + t) % 50 for
t < length, length = 2 + (j + seed) % max_tokens capped at max_tokens, cut right after `LLM.eos_token_id` when it
is set and comes earlier (finish "length" when max_tokens tokens came out, even if the last is the EOS, as vLLM
0.10 reports it; else "stop"), each with log-prob -(t + 1) / 10.
"""
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace


@dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str | None = None


# Keyword arguments of vllm.SamplingParams present in both 0.10.2 and 0.33.0 (read from their sampling_params.py).
SAMPLING_PARAMS_KEYWORDS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "bad_words", "include_stop_str_in_output", "ignore_eos", "max_tokens",
    "min_tokens", "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "output_kind", "logit_bias", "allowed_token_ids", "extra_args",
})
MIN_TEMPERATURE = 0.01   # vLLM's _MAX_TEMP: smaller positive temperatures are raised to it
MAX_TEMPERATURE = 2.0    # vLLM 0.33 rejects larger temperatures when the request is processed


class SamplingParams:
    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - SAMPLING_PARAMS_KEYWORDS)
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {unknown}")
        self.kwargs = kwargs
        defaults = dict(n=1, temperature=1.0, top_p=1.0, max_tokens=16, logprobs=None, seed=None)
        for key, value in {**defaults, **kwargs}.items():
            setattr(self, key, value)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE  # silently, as vLLM does (it only logs a warning)


class FakeModel:
    def __init__(self, calls):
        self.calls = calls
        self.loaded = {}

    def load_weights(self, weights):
        weights = list(weights)
        self.calls.append(("load_weights", [name for name, _ in weights]))
        for name, tensor in weights:
            self.loaded[name] = tensor.detach().clone()
        return {name for name, _ in weights}


class LLM:
    instances = []
    eos_token_id = None   # the tokenizer's EOS (`get_tokenizer`); a test sets it to have samples stop on it

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = [("init", kwargs)]
        self.model = FakeModel(self.calls)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=self.model))))
        self.asleep: set[str] = set()        # released parts: "weights", "kv_cache"
        self.weights_discarded = False       # level-2 sleep: weights must be loaded again
        self.prefix_cache_resets = True      # what reset_prefix_cache returns (False: requests hold blocks)
        LLM.instances.append(self)

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        if self.asleep:
            raise RuntimeError(f"generate while the engine sleeps ({sorted(self.asleep)} released)")
        if self.weights_discarded and not self.model.loaded:
            raise RuntimeError("generate after a level-2 sleep without loading weights")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError("The lengths of prompts and sampling_params must be the same.")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        for sp in params:
            if sp.temperature > MAX_TEMPERATURE:
                raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {sp.temperature}")
        self.calls.append(("generate", prompts, params))
        outputs = []
        for prompt, sp in zip(prompts, params):
            last = prompt["prompt_token_ids"][-1]
            completions = []
            for j in reversed(range(sp.n)):  # out of order on purpose: callers must sort by index
                length = min(2 + (j + (sp.seed or 0)) % sp.max_tokens, sp.max_tokens)
                tokens = [(last + j + 1 + t) % 50 for t in range(length)]
                if self.eos_token_id in tokens[:-1]:   # vLLM stops at EOS (and keeps it)
                    tokens = tokens[:tokens.index(self.eos_token_id) + 1]
                # logprobs=k: the sampled token plus the k most likely others (here a fixed token 99)
                logprobs = None if sp.logprobs is None else [
                    {tok: Logprob(-(t + 1) / 10), **({99: Logprob(-9.0, rank=2)} if sp.logprobs > 0 else {})}
                    for t, tok in enumerate(tokens)]
                # vLLM 0.10 checks the length first: an EOS as the last allowed token still finishes "length"
                completions.append(SimpleNamespace(index=j, token_ids=tuple(tokens), logprobs=logprobs,
                                                   finish_reason="length" if len(tokens) == sp.max_tokens else "stop"))
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=completions))
        return outputs

    def get_tokenizer(self):
        return SimpleNamespace(eos_token_id=self.eos_token_id)

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return self.prefix_cache_resets

    def sleep(self, level=1):
        if not self.kwargs.get("enable_sleep_mode"):
            raise ValueError("sleep mode is not enabled (LLM(enable_sleep_mode=True))")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}
        if level == 2:
            self.weights_discarded = True
            self.model.loaded.clear()

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags or ("weights", "kv_cache"))

    def call_names(self):
        return [call[0] for call in self.calls]


class ApplyModelLLM(LLM):
    """A newer-vLLM-like engine without the in-process executor attribute chain, only `apply_model`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.llm_engine = SimpleNamespace()

    def apply_model(self, func):
        self.calls.append(("apply_model",))
        return [func(self.model)]


def install(monkeypatch=None, llm_cls=LLM):
    """Put the fake `vllm` (and `vllm.distributed.parallel_state`) into sys.modules: for one test with
    pytest's `monkeypatch`, or for the rest of the process without it (worker scripts)."""
    LLM.instances.clear()
    vllm = types.ModuleType("vllm")
    vllm.LLM = llm_cls
    vllm.SamplingParams = SamplingParams
    distributed = types.ModuleType("vllm.distributed")
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.get_tp_group = lambda: SimpleNamespace(world_size=1, device_group=None, rank_in_group=0)
    distributed.parallel_state = parallel_state
    vllm.distributed = distributed
    modules = {"vllm": vllm, "vllm.distributed": distributed, "vllm.distributed.parallel_state": parallel_state}
    for name, module in modules.items():
        if monkeypatch is None:
            sys.modules[name] = module
        else:
            monkeypatch.setitem(sys.modules, name, module)
    return vllm
