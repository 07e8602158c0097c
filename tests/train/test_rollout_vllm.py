"""erpo.rollout.vllm.VLLMRollout against a recording fake `vllm` (vLLM itself needs CUDA)."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fake_vllm
from erpo import distributed as D
from erpo.cli.eval import OPTION_NAMES
from erpo.models.tiny import build_model, build_tokenizer
from erpo.rollout import vllm as rollout_vllm
from erpo.rollout.engine import RolloutEngine
from erpo.rollout.vllm import VLLMRollout, sampled_logprobs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_launcher_variables(no_launcher_variables):
    """VLLMRollout fills the launcher variables for vLLM: each test starts without them and they are put back."""


@pytest.fixture
def vllm(monkeypatch):
    return fake_vllm.install(monkeypatch)


def fake_world(monkeypatch, rank, world):
    monkeypatch.setattr(D, "is_initialized", lambda: True)
    monkeypatch.setattr(D, "rank", lambda: rank)
    monkeypatch.setattr(D, "world_size", lambda: world)


def test_importing_erpo_does_not_import_vllm(tmp_path):
    """vLLM is imported only when a VLLMRollout is created: a `vllm` that fails on import is harmless."""
    (tmp_path / "vllm.py").write_text("raise RuntimeError('vllm imported eagerly')\n")
    code = "import erpo.distributed, erpo.train.checkpoint, erpo.rollout.hf, erpo.rollout.vllm"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-c", "import vllm"], env=env, capture_output=True, text=True)
    assert "imported eagerly" in proc.stderr          # the trap works


def test_missing_vllm_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"erpo\[vllm\]"):
        VLLMRollout("some/model")


def test_single_process_engine_arguments(vllm):
    engine = VLLMRollout("path/to/model", gpu_memory_utilization=0.3, seed=7, llm_kwargs={"max_model_len": 512})
    assert isinstance(engine, RolloutEngine)
    kwargs = engine.llm.kwargs
    assert kwargs["model"] == "path/to/model" and kwargs["gpu_memory_utilization"] == 0.3
    assert kwargs["seed"] == 7 and kwargs["tensor_parallel_size"] == 1 and kwargs["max_model_len"] == 512
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["enable_prefix_caching"]
    assert kwargs["distributed_executor_backend"] == "external_launcher"   # in-process engine, world of 1
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    assert int(os.environ["MASTER_PORT"]) > 0


def test_colocated_engine_per_rank_uses_external_launcher(vllm, monkeypatch):
    monkeypatch.setenv("RANK", "3")      # as torchrun sets it; kept
    fake_world(monkeypatch, rank=3, world=4)
    engine = VLLMRollout("m", seed=10)
    assert engine.llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert engine.llm.kwargs["seed"] == 13                       # one stream per data-parallel rank
    assert os.environ["RANK"] == "3"
    tp = VLLMRollout("m", seed=10, tensor_parallel_size=2)
    assert tp.llm.kwargs["seed"] == 11 and tp.llm.kwargs["tensor_parallel_size"] == 2  # same within a TP group


def test_evaluation_engine_lets_vllm_start_its_tensor_parallel_workers(vllm, monkeypatch):
    """colocated=False (erpo eval --tensor-parallel-size): one process, vLLM's own executor, no group gather."""
    engine = VLLMRollout("m", tensor_parallel_size=4, colocated=False)   # world of 1: no divisibility check
    assert "distributed_executor_backend" not in engine.llm.kwargs and engine.llm.kwargs["tensor_parallel_size"] == 4
    assert "RANK" not in os.environ                                       # the launcher env is left alone
    monkeypatch.setattr(rollout_vllm, "tp_all_gather_object", lambda obj: pytest.fail("gathered"))
    batch = engine.generate([[1, 2]], n=2, temperature=1.0, max_new_tokens=3, seed=5)
    assert batch.prompt_index == [0, 0]


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(tensor_parallel_size=3), "divide the world size"),
    (dict(sleep_level=3), "sleep_level"),
])
def test_bad_engine_arguments(vllm, monkeypatch, kwargs, match):
    fake_world(monkeypatch, rank=0, world=4)
    with pytest.raises(ValueError, match=match):
        VLLMRollout("m", **kwargs)


def test_generate_builds_grouped_batch(vllm):
    engine = VLLMRollout("m")
    batch = engine.generate([[1, 2, 3], [4, 5]], n=3, temperature=0.7, top_p=0.9, max_new_tokens=4, seed=100)
    _, prompts, params = engine.llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]
    seeds = [rollout_vllm.request_seed(100, 0, prompt) for prompt in (0, 1)]
    assert [p.kwargs for p in params] == [
        dict(n=3, temperature=0.7, top_p=0.9, max_tokens=4, logprobs=0, seed=seeds[0]),
        dict(n=3, temperature=0.7, top_p=0.9, max_tokens=4, logprobs=0, seed=seeds[1])]
    assert batch.prompt_index == [0, 0, 0, 1, 1, 1]
    assert batch.prompt_ids == [[1, 2, 3]] * 3 + [[4, 5]] * 3
    # fake: sample j of prompt with last token L emits (L + j + 1 + t) % 50, length min(2 + (j + seed) % 4, 4):
    # three consecutive j give a length-capped ("length": truncated) sample and one that stops
    lengths = [min(2 + (j + seeds[0]) % 4, 4) for j in range(3)]
    assert batch.response_ids[:3] == [[(4 + j + t) % 50 for t in range(length)] for j, length in enumerate(lengths)]
    assert batch.truncated[:3] == [length == 4 for length in lengths] and len(set(batch.truncated[:3])) == 2
    assert batch.response_logp[0] == pytest.approx([-(t + 1) / 10 for t in range(lengths[0])])
    assert len(batch.response_ids[3]) == min(2 + seeds[1] % 4, 4)
    unseeded = engine.generate([[1]], n=1, temperature=1.0, max_new_tokens=3)
    assert engine.llm.calls[-1][2][0].kwargs["seed"] is None and len(unseeded.response_ids) == 1


def test_a_response_whose_eos_is_its_last_allowed_token_is_not_truncated(vllm, monkeypatch):
    """vLLM 0.10 reports finish_reason "length" for a response whose EOS is its max_tokens-th token (it checks the
    length before the EOS): that response ended and is not truncated, as HFRollout and TRL's
    mask_truncated_completions count it, so algorithm.mask_truncated keeps its loss and truncated_frac leaves it
    out. Only the responses that ran out without EOS are."""
    monkeypatch.setattr(fake_vllm.LLM, "eos_token_id", 9)
    engine = VLLMRollout("m")
    batch = engine.generate([[3], [20]], n=4, temperature=1.0, max_new_tokens=4)   # unseeded: lengths 2, 3, 4, 4
    assert batch.response_ids[:4] == [[4, 5], [5, 6, 7], [6, 7, 8, 9], [7, 8, 9]]    # 9: the EOS
    assert batch.truncated == [False] * 6 + [True] * 2
    assert rollout_vllm.ran_out(SimpleNamespace(token_ids=(6, 7, 8, 9), finish_reason="length"), None)


def sample_seeds(engine, seed: int, prompts: int, n: int) -> set[int]:
    """The seed of every sample of a `generate` of `prompts` prompts x n under `seed`: vLLM seeds sample j of a
    request of seed s with s + j (vllm/v1/engine/parallel_sampling.py)."""
    params = [engine.sampling_params(i, n, 1.0, 1.0, 8, seed) for i in range(prompts)]
    return {p.seed + j for p in params for j in range(n)}


def test_no_two_samples_share_a_seed_across_rollout_steps_and_ranks(vllm, monkeypatch):
    """erpo train seeds rollout step s on rank r with trainer.seed * 1_000_003 + s * 1009 + r: the request seeds of
    512 prompts x 8 were that seed + prompt * 8 (+ sample), so 3087 of step s + 1's samples reused a seed of step
    s (the same random draws on other prompts). No seed is shared between any two samples of 3 steps on 2
    data-parallel ranks, and the same call gives the same seeds (reproducible)."""
    per_call = []
    for rank in (0, 1):
        fake_world(monkeypatch, rank=rank, world=2)
        engine = VLLMRollout("m")
        per_call += [sample_seeds(engine, 42 * 1_000_003 + step * 1009 + rank, 512, 8) for step in range(3)]
    assert all(len(seeds) == 512 * 8 for seeds in per_call)
    assert len(set().union(*per_call)) == 6 * 512 * 8
    assert sample_seeds(engine, 7, 3, 2) == sample_seeds(VLLMRollout("m"), 7, 3, 2)
    assert all(0 <= seed < 2**63 for seed in per_call[0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_ids=[], n=1), "prompt_ids"), (dict(prompt_ids=[[]], n=1), "prompt_ids"),
    (dict(prompt_ids=[[1]], n=0), "n > 0"), (dict(prompt_ids=[[1]], n=1, temperature=0.0), "temperature"),
    (dict(prompt_ids=[[1]], n=1, top_p=0.0), "top_p"),
    (dict(prompt_ids=[[1]], n=1, temperature=2.5), r"outside \[0.01, 2.0\]"),      # vLLM rejects it mid-run
    (dict(prompt_ids=[[1]], n=1, temperature=0.005), r"outside \[0.01, 2.0\]"),    # vLLM samples at 0.01
])
def test_generate_rejects_bad_input(vllm, kwargs, match):
    engine = VLLMRollout("m")
    args = dict(temperature=1.0, max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        engine.generate(args.pop("prompt_ids"), **args)


def test_tensor_parallel_group_generates_all_and_keeps_own_share(vllm, monkeypatch):
    fake_world(monkeypatch, rank=1, world=2)
    engine = VLLMRollout("m", tensor_parallel_size=2)
    monkeypatch.setattr(rollout_vllm, "tp_all_gather_object", lambda obj: [([[7, 8]], 50), obj])
    batch = engine.generate([[1, 2], [3]], n=2, temperature=1.0, max_new_tokens=5, seed=61)
    _, prompts, params = engine.llm.calls[-1]
    assert [p["prompt_token_ids"] for p in prompts] == [[7, 8], [1, 2], [3]]   # the whole group's requests
    # member 0's seed, at the group's data-parallel rank: identical requests on both members
    assert [p.seed for p in params] == [rollout_vllm.request_seed(50, 0, prompt) for prompt in range(3)]
    assert batch.prompt_index == [0, 0, 1, 1] and batch.prompt_ids == [[1, 2], [1, 2], [3], [3]]
    assert batch.response_ids[0][0] == 3 and batch.response_ids[2][0] == 4


def test_fake_vllm_is_as_strict_as_vllm(vllm):
    """The fake rejects what real vLLM rejects, so the tests above would catch such calls."""
    with pytest.raises(TypeError, match="unexpected keyword"):
        vllm.SamplingParams(n=1, max_new_tokens=4)
    assert vllm.SamplingParams(temperature=0.001).temperature == 0.01      # silently raised, as vLLM does
    llm = vllm.LLM(model="m")
    params = vllm.SamplingParams(n=1, max_tokens=2, logprobs=0)
    with pytest.raises(ValueError, match="lengths of prompts and sampling_params"):
        llm.generate([{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}], sampling_params=[params])
    out = llm.generate([{"prompt_token_ids": [1]}], sampling_params=[params])
    assert all(len(entry) == 1 for entry in out[0].outputs[0].logprobs)  # logprobs=0: the sampled token only
    with pytest.raises(ValueError, match="sleep mode"):
        llm.sleep(level=1)
    sleepy = vllm.LLM(model="m", enable_sleep_mode=True)
    sleepy.sleep(level=1)
    with pytest.raises(RuntimeError, match="sleeps"):
        sleepy.generate([{"prompt_token_ids": [1]}], sampling_params=[params])


def test_sampled_logprobs_checks_vllm_output():
    entry = {5: fake_vllm.Logprob(-0.5)}
    assert sampled_logprobs([5], [entry]) == [-0.5]
    with pytest.raises(RuntimeError, match="one log-prob entry per generated token"):
        sampled_logprobs([5, 6], [entry])
    with pytest.raises(RuntimeError, match="sampled token 6"):
        sampled_logprobs([6], [entry])


def tiny_model():
    return build_model(build_tokenizer(), seed=0, hidden_size=16, intermediate_size=32, num_layers=1)


def test_sync_weights_loads_every_parameter_then_resets_cache(vllm):
    engine = VLLMRollout("m")
    model = tiny_model()
    engine.sync_weights(model)
    names = [name for name, _ in model.named_parameters()]
    loads = [call[1] for call in engine.llm.calls if call[0] == "load_weights"]
    assert loads == [[name] for name in names]                   # one parameter per call, HF names
    assert "lm_head.weight" not in names                         # tied: vLLM ties it itself
    assert engine.llm.call_names()[-1] == "reset_prefix_cache"
    for name, param in model.named_parameters():
        assert torch.equal(engine.llm.model.loaded[name], param)


def test_sync_weights_gathers_zero3_parameters_one_by_one(vllm, monkeypatch):
    engine = VLLMRollout("m")
    model = tiny_model()
    events = []

    @contextlib.contextmanager
    def recording_gather(params):
        events.append(("gather", [p.shape for p in params]))
        yield
        events.append(("release",))

    monkeypatch.setattr(D, "gathered", recording_gather)
    engine.llm.model.load_weights = lambda w: events.append(("load", [n for n, _ in w]))
    engine.sync_weights(model)
    params = list(model.named_parameters())
    assert events == [e for name, p in params for e in (("gather", [p.shape]), ("load", [name]), ("release",))]


def test_sync_weights_fails_when_prefix_cache_is_not_reset(vllm):
    engine = VLLMRollout("m")
    engine.llm.prefix_cache_resets = False           # vLLM returns False while requests hold cached blocks
    with pytest.raises(RuntimeError, match="prefix cache"):
        engine.sync_weights(tiny_model())


def test_apply_model_is_preferred_over_the_attribute_chain(monkeypatch):
    class BothLLM(fake_vllm.ApplyModelLLM):          # a vLLM with the public API and the executor chain
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.llm_engine = fake_vllm.LLM(model="other").llm_engine

    fake_vllm.install(monkeypatch, llm_cls=BothLLM)
    engine = VLLMRollout("m")
    engine.sync_weights(tiny_model())
    assert "apply_model" in engine.llm.call_names() and engine.llm.model.loaded


def test_engine_refuses_when_gpu_memory_is_taken(vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (30 * 2**30, 80 * 2**30))
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization=0.5 asks vLLM .* set gpu_memory_utilization "
                                         r"<= 0.37$"):   # from Python: the keyword
        VLLMRollout("m", gpu_memory_utilization=0.5)
    from erpo.rollout import CONFIG_NAMES
    with pytest.raises(ValueError, match=r"set rollout.gpu_memory_utilization <= 0.37$"):   # a training run's
        VLLMRollout("m", gpu_memory_utilization=0.5, names=CONFIG_NAMES)
    with pytest.raises(ValueError, match=r"^--gpu-memory-utilization=0.5 asks vLLM .* set --gpu-memory-utilization "
                                         r"<= 0.37$"):   # erpo eval's engine: its user's option
        VLLMRollout("m", gpu_memory_utilization=0.5, colocated=False, names=OPTION_NAMES)
    assert VLLMRollout("m", gpu_memory_utilization=0.3).llm.kwargs["gpu_memory_utilization"] == 0.3


def test_sync_weights_through_apply_model(monkeypatch):
    fake_vllm.install(monkeypatch, llm_cls=fake_vllm.ApplyModelLLM)
    engine = VLLMRollout("m")
    model = tiny_model()
    engine.sync_weights(model)
    assert engine.llm.call_names().count("apply_model") == len(list(model.parameters()))
    assert set(engine.llm.model.loaded) == {name for name, _ in model.named_parameters()}


def test_sleep_and_wake_up(vllm):
    off = VLLMRollout("m")
    off.sleep()
    assert "sleep" not in off.llm.call_names()                   # sleep mode disabled: no-op
    engine = VLLMRollout("m", enable_sleep_mode=True, sleep_level=1)
    assert engine.llm.kwargs["enable_sleep_mode"]
    engine.sleep()
    engine.sleep()                                               # idempotent
    engine.generate([[1]], n=1, temperature=1.0, max_new_tokens=2)
    names = engine.llm.call_names()
    assert names.count("sleep") == 1 and ("sleep", 1) in engine.llm.calls
    assert names.index("wake_up") < names.index("generate")
    assert ("wake_up", ["kv_cache", "weights"]) in engine.llm.calls


def test_level2_sleep_requires_sync_before_generate(vllm):
    engine = VLLMRollout("m", enable_sleep_mode=True)      # level 2 by default: weights are overwritten anyway
    engine.sleep()
    assert ("sleep", 2) in engine.llm.calls
    with pytest.raises(RuntimeError, match="sync_weights"):
        engine.generate([[1]], n=1, temperature=1.0, max_new_tokens=2)
    engine.sync_weights(tiny_model())
    assert ("wake_up", ["weights"]) in engine.llm.calls
    engine.generate([[1]], n=1, temperature=1.0, max_new_tokens=2)
    assert engine.llm.calls[-2] == ("wake_up", ["kv_cache"])     # then the KV cache, right before generating
