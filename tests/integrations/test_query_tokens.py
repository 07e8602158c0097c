"""The query the reference cache scored is the query the training step scores, in each trainer: at theta0 the
step's prompt rows are the tokens the cache was keyed and scored by, as the trainer's own code builds them, and
ell_theta(q) of the step equals the cached ell_theta0(q) (a Query-KL of 0 before any update).

The prompts are built by each peer's own code path, not by ours: TRL's GRPOTrainer (`_generate`, its chat template
with `chat_template_kwargs`) in a real `train()` step; verl's `RLHFDataset` (its overlong-prompt filter) and its
single-turn agent loop (the Continuous Token builder, its left truncation to `rollout.prompt_length`); OpenRLHF's
`preprocess_data`, its agent executors (single- and multi-turn, with their truncation) and its own experience
batching. The tokenizer is the hard case: a chat template that writes a BOS, a tokenizer that adds one to bare text
too, a BOS that is also the pad token (so the first real token of a left-padded prompt has the pad id), a system
prompt and an `enable_thinking` switch. A prompt of fewer than 2 tokens, which has no ell_theta0(q), is refused in one
line (its static w(q) was 0 before: its policy gradient dropped, and every other weight lowered). `erpo train`'s own
case: tests/train/test_trainer.py::test_the_first_step_scores_the_prompts_the_cache_scored."""
import asyncio
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from erpo.models.tiny import build_tokenizer
from erpo.reference.cache import CACHE_FILE, ReferenceCache, prompt_hash
from test_openrlhf_integration import StandInActor, openrlhf_actor, openrlhf_models  # noqa: F401 (its fixture)
from tiny_models import bos_chat_tokenizer, save_tiny_model

THINKING_OFF = {"enable_thinking": False}
SYSTEM = {"role": "system", "content": "Be brief."}
QUESTIONS = ["1+1=", "22+3=", "7*8=", "3*33="]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(model directory of the tiny Qwen2 with `bos_chat_tokenizer`, the tokenizer, theta0: its HF model, eager)."""
    tokenizer = bos_chat_tokenizer()
    path = save_tiny_model(tmp_path_factory.mktemp("chat"), tokenizer)
    return path, tokenizer, AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")


def plain_query_logp(model, ids: list[int]) -> float:
    """ell(q) of one prompt alone, by a plain log_softmax-gather of the HF model's logits: tokens 2..P (nats)."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return logits[0, :-1].log_softmax(-1).gather(1, tokens[0, 1:, None]).sum().item()


def starts_with_one_bos(ids: list[int], bos: int) -> bool:
    return ids[0] == bos and ids[1] != bos


# --- TRL -------------------------------------------------------------------------------------------------------------

def trl_rows(conversational: bool) -> list[dict]:
    """Five rows, one with a system prompt, and the same prompt twice with different columns."""
    prompts = [[SYSTEM, {"role": "user", "content": QUESTIONS[0]}]] + [
        [{"role": "user", "content": q}] for q in QUESTIONS[1:]] + [[{"role": "user", "content": QUESTIONS[1]}]]
    if not conversational:
        prompts = [prompt[-1]["content"] for prompt in prompts]
    return [{"prompt": prompt, "tag": tag} for prompt, tag in zip(prompts, "abcde")]


def trl_trainer(path, tokenizer, rows, output_dir, eval_rows=None, **overrides):
    datasets = pytest.importorskip("datasets", exc_type=ModuleNotFoundError)
    from erpo.integrations.trl import ERPOConfig, ERPOTrainer
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=10, num_generations=2,
                    max_completion_length=4, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", seed=0,
                    disable_dropout=True, bf16=False, max_steps=1, qkl_coef=0.5, query_weight="static",
                    chat_template_kwargs=THINKING_OFF, model_init_kwargs={"attn_implementation": "eager"})
    return ERPOTrainer(model=path, reward_funcs=lambda completions, **kwargs: [float(len(str(c))) for c in completions],
                       args=ERPOConfig(**{**settings, **overrides}), processing_class=tokenizer,
                       train_dataset=datasets.Dataset.from_list(rows),
                       eval_dataset=None if eval_rows is None else datasets.Dataset.from_list(eval_rows))


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "plain-text"])
def test_trl_step_scores_the_cached_query(chat_model, tmp_path, conversational):
    """A real GRPOTrainer step: each micro-batch's prompt rows (TRL's left-padded prompt_ids under prompt_mask) are
    the cache's key (PROMPT_TOKEN_IDS) and TRL's own prompt as recomputed by hand (the chat template rendered with
    the generation prompt and `chat_template_kwargs`, then tokenized without special tokens; bare text through the
    tokenizer, its BOS included), with one BOS; the cache holds exactly the distinct prompts, each at the plain
    ell(q) of the untrained model; and the first step, made to read ell_theta0(q) from the cache instead of its own
    forward, logs a Query-KL of 0."""
    pytest.importorskip("trl", exc_type=ModuleNotFoundError)
    from erpo.integrations.trl.reference import PROMPT_TOKEN_IDS, device_prompt_ids
    path, tokenizer, model = chat_model
    rows = trl_rows(conversational)
    trainer = trl_trainer(path, tokenizer, rows, tmp_path)

    def by_hand(prompt):
        if not conversational:
            return tokenizer(prompt)["input_ids"]
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **THINKING_OFF)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    expected = {prompt_hash(ids): ids for ids in map(by_hand, [row["prompt"] for row in rows])}
    assert len(expected) == 4 and all(starts_with_one_bos(ids, tokenizer.bos_token_id) for ids in expected.values())
    if conversational:   # chat_template_kwargs reached the template
        thought = tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
        assert all(ids[-len(thought):] == thought for ids in expected.values())
    cache = ReferenceCache.load(str(tmp_path / CACHE_FILE))
    assert set(cache.entries) == set(expected)
    for key, ids in expected.items():
        assert cache.entries[key][0] == pytest.approx(plain_query_logp(model, ids), rel=1e-5, abs=0)

    seen, compute_loss = [], trainer._compute_loss

    def from_the_cache(model, inputs):   # theta0 still: no optimizer step yet, but ell_theta0(q) read from the cache
        trainer.at_theta0 = False
        seen.append(inputs)
        return compute_loss(model, inputs)

    trainer._compute_loss = from_the_cache
    trainer.train()
    keys = [ids for inputs in seen for ids in inputs[PROMPT_TOKEN_IDS]]
    assert keys == [ids for inputs in seen for ids in device_prompt_ids(inputs)]
    assert {prompt_hash(ids) for ids in keys} == set(expected)   # every row drawn: a batch of 5 prompts x 2
    assert all(ids == expected[prompt_hash(ids)] for ids in keys)
    assert any(inputs["prompt_mask"][:, 0].eq(0).any() for inputs in seen)   # left padding, then a pad-id BOS
    logged = [entry for entry in trainer.state.log_history if "qkl" in entry]
    assert len(logged) == 1 and abs(logged[0]["qkl"]) < 1e-9 and logged[0]["query_weight_mean"] > 0


@pytest.mark.parametrize("where", ["train", "eval", "at theta0"])
def test_trl_a_one_token_prompt_is_refused(chat_model, tmp_path, where):
    """A prompt of one token (bare text under a tokenizer that adds no BOS) has no ell_theta0(q): refused in one line
    naming it, whether a training prompt, an eval prompt scored at start, or one the cache lacks at theta0; its static
    w(q) was 0 before (a sum over no rows is +0, its surprisal -0, mean(s) / -0 clipped to 0) and it halved the
    other prompts' weights."""
    pytest.importorskip("trl", exc_type=ModuleNotFoundError)
    path = chat_model[0]
    tokenizer = build_tokenizer()   # no BOS
    rows = [{"prompt": text} for text in ["7", "1+1=", "22+3="]]
    message = r"^prompt '7' has 1 token\(s\) \(1 of \d prompts have fewer than 2\): ell_theta0\(q\) sums"
    with pytest.raises(ValueError, match=message) as error:
        if where == "train":
            trl_trainer(path, tokenizer, rows, tmp_path, chat_template_kwargs=None)
        elif where == "eval":
            trl_trainer(path, tokenizer, rows[1:], tmp_path, eval_rows=rows, chat_template_kwargs=None)
        else:
            trainer = trl_trainer(path, tokenizer, rows[1:], tmp_path, chat_template_kwargs=None)
            trainer._add_at_theta0([tokenizer("7")["input_ids"]], torch.zeros(1, dtype=torch.float64))
    assert "\n" not in str(error.value)


# --- verl ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verl_engine():
    """bench.verl_engine, which sets verl's CPU platform before verl is imported (skipped without verl)."""
    module = pytest.importorskip("bench.verl_engine", exc_type=ModuleNotFoundError)
    pytest.importorskip("transfer_queue", exc_type=ModuleNotFoundError)   # erpo.integrations.verl_trainer's verl
    return module


VERL_PROMPTS = [[SYSTEM, {"role": "user", "content": QUESTIONS[0]}],   # 62 tokens: left-truncated to 50
                [{"role": "user", "content": QUESTIONS[1]}],          # 44: whole
                [{"role": "user", "content": "x" * 30}],              # 69: left-truncated
                [{"role": "user", "content": "y" * 80}],              # 120 > data.max_prompt_length: filtered
                [{"role": "user", "content": QUESTIONS[1]}]]          # the second again, another row


def verl_dataset(tokenizer, tmp_path):
    """verl's RLHFDataset of VERL_PROMPTS (parquet), its overlong-prompt filter at 100 tokens."""
    import pandas as pd
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset
    pd.DataFrame({"prompt": VERL_PROMPTS, "data_source": ["audit"] * 5,
                  "reward_model": [{"ground_truth": str(i)} for i in range(5)]}).to_parquet(tmp_path / "train.parquet")
    config = OmegaConf.create({"max_prompt_length": 100, "filter_overlong_prompts": True,
                               "filter_overlong_prompts_workers": 1, "apply_chat_template_kwargs": THINKING_OFF,
                               "cache_dir": str(tmp_path / "cache")})
    return RLHFDataset([str(tmp_path / "train.parquet")], tokenizer, config), config


def agent_loop_prompts(dataset, data_config, tokenizer, prompt_length: int) -> list[list[int]]:
    """The prompt_ids verl's own SingleTurnAgentLoop returns for each item of `dataset` (its Continuous Token build,
    its left truncation, the prompt it keeps after merging the response), the response from a stand-in server."""
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.replica import TokenOutput

    class Server:
        async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
            return TokenOutput(token_ids=[40, 41, tokenizer.eos_token_id])

    rollout = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": prompt_length,
                                                                  "response_length": 8}}})
    loop = SingleTurnAgentLoop(trainer_config=types.SimpleNamespace(config=rollout), server_manager=Server(),
                               tokenizer=tokenizer, processor=None, dataset_cls=RLHFDataset,
                               data_config=types.SimpleNamespace(config=data_config), hf_model_type="qwen2")
    return [list(loop.loop.run_until_complete(loop.run({}, **dataset[i])).prompt_ids) for i in range(len(dataset))]


def test_verl_agent_loop_prompts_are_the_cached_keys_and_scores(verl_engine, chat_model, tmp_path):
    """erpo's `training_prompt_ids` of verl's own RLHFDataset are, row for row, the prompt_ids verl's single-turn
    agent loop hands the actor (a system prompt, `apply_chat_template_kwargs`, one BOS that is the pad id, prompts
    left-truncated to rollout.prompt_length, one dropped by the dataset's filter, one twice); scored by the actor's
    engine into the cache and looked up by the loss on an update batch of those prompts (left-padded with the pad id,
    which is also their first real token), the Query-KL at theta0 is 0 and each ell_theta(q) is the cached value."""
    from erpo.integrations.verl import ERPOSettings, erpo_loss_fn
    from erpo.integrations.verl_trainer import training_prompt_ids
    from test_verl_integration import actor_config, engine_reference, metric_values
    path, tokenizer, model = chat_model
    dataset, data_config = verl_dataset(tokenizer, tmp_path)
    assert len(dataset) == 4
    ours = training_prompt_ids(dataset, tokenizer, hf_model_type="qwen2", chat_template_kwargs=THINKING_OFF,
                               prompt_length=50)
    assert ours == agent_loop_prompts(dataset, data_config, tokenizer, prompt_length=50)
    assert [len(ids) for ids in ours] == [50, 44, 50, 44] and ours[1] == ours[3]
    assert starts_with_one_bos(ours[1], tokenizer.bos_token_id) and ours[0][0] != tokenizer.bos_token_id

    engine = verl_engine.build_engine(path, micro_batch_size=1)
    reference, _ = engine_reference((path, tokenizer), engine, ours, tmp_path / "cache.json")
    data = verl_engine.set_engine_keys(engine, verl_engine.actor_batch(
        model, ours, [[5, 6, 7], [8, 9], [4], [3, 5]], pad_id=tokenizer.pad_token_id), calculate_entropy=False)
    pad = tokenizer.pad_token_id   # the second prompt: 6 pads, then its BOS, the same id
    assert data["prompts"][1, :7].tolist() == [pad] * 7 and data["attention_mask"][1, :7].tolist() == [0] * 6 + [1]
    config = actor_config(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, use_kl_loss=False, entropy_coeff=0.0)
    metrics = metric_values(verl_engine.loss_and_grads(
        engine, data, erpo_loss_fn(config, ERPOSettings(qkl_coef=1.0, query_weight="static"), reference))[0])
    assert metrics["actor/qkl"] == [0.0] * 4
    assert metrics["actor/query_logp"] == reference.lookup(ours)[0].tolist()


def test_verl_a_one_token_prompt_is_refused(verl_engine, chat_model, tmp_path):
    """A training prompt of one token (rollout.prompt_length=1 keeps one) is refused in one line before anything is
    scored; its static w(q) was 0 before."""
    from erpo.integrations.query_reference import load_or_build_reference

    def no_scoring(prompts):
        raise AssertionError("scored")

    tokenizer = build_tokenizer()
    prompts = [tokenizer("ab")["input_ids"], tokenizer("a")["input_ids"]]
    with pytest.raises(ValueError, match=r"^prompt 'a' has 1 token\(s\) \(1 of 2 prompts") as error:
        load_or_build_reference(chat_model[0], tokenizer, prompts, path=str(tmp_path / "cache.json"),
                                temperature=1.0, precision="p", score=no_scoring, trainer="verl", remedy="")
    assert "\n" not in str(error.value) and not (tmp_path / "cache.json").exists()


# --- OpenRLHF --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def openrlhf_rollout(request):
    """OpenRLHF's models (`test_openrlhf_integration.openrlhf_models`) and its own rollout code: its agent executors,
    `preprocess_data`, and the samples generator's `_process_response_into_experience` with the replay buffer's
    batching. `samples_generator` imports vLLM and the vLLM engine module (absent here; the functions used do not
    touch them): imported under stand-ins, with `openrlhf.trainer.ray`'s folder mounted under a stand-in package (its
    __init__ imports vLLM)."""
    models = request.getfixturevalue("openrlhf_models")   # skips without OpenRLHF
    import openrlhf.trainer
    stand_ins = {name: types.ModuleType(name) for name in ("vllm", "openrlhf.trainer.ray",
                                                           "openrlhf.trainer.ray.vllm_engine")}
    stand_ins["vllm"].SamplingParams = object
    stand_ins["openrlhf.trainer.ray"].__path__ = [str(Path(openrlhf.trainer.__file__).parent / "ray")]
    stand_ins["openrlhf.trainer.ray.vllm_engine"].batch_vllm_engine_call = None
    with pytest.MonkeyPatch.context() as patch:
        for name, module in stand_ins.items():
            patch.setitem(sys.modules, name, module)
        from openrlhf.datasets.prompts_dataset import preprocess_data
        from openrlhf.trainer.ppo_utils.experience import (
            make_experience_batch,
            remove_padding_in_sequences,
            split_experience_batch,
        )
        from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
        from openrlhf.utils import agent

    def batch_of(responses, max_len):
        """The actor's micro-batch of executor responses, as OpenRLHF builds it (one Experience each, into the
        replay buffer, batched back)."""
        experiences = [SamplesGenerator._process_response_into_experience(None, r, max_len=max_len)
                       for r in responses]
        items = remove_padding_in_sequences([item for e in experiences for item in split_experience_batch(e)])
        return make_experience_batch(items)

    return types.SimpleNamespace(models=models, agent=agent, preprocess_data=preprocess_data, batch_of=batch_of)


class StandInEngine:
    """vLLM's engine as the agent executors call it: three tokens (fewer when the budget is smaller)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, prompt_ids, params, multi_modal_data=None):
        ids = [40, 41, 42][:params.max_tokens]
        output = types.SimpleNamespace(token_ids=ids, text=self.tokenizer.decode(ids), finish_reason="stop",
                                       logprobs=None)
        return types.SimpleNamespace(outputs=[output])


@pytest.mark.parametrize("executor", ["single-turn", "single-turn-dynamic", "multi-turn"])
def test_openrlhf_executor_prompts_are_the_cached_keys_and_scores(openrlhf_rollout, chat_model, tmp_path, executor):
    """OpenRLHF's own path from a PromptDataset row to the actor's micro-batch (`preprocess_data` with the chat
    template and a system prompt, its agent executor's tokenization and left truncation at max_len minus the
    generation budget, max_new_tokens set or dynamic, one environment turn after the first action in multi-turn,
    its experience batching): `actor_logprobs`' prompt_ids are the keys `load_or_build_query_reference` made of the
    prompt texts with max_prompt_length = max_len - (max_new_tokens or 1), as its STEP_MISS advises, and at theta0
    ell_theta(q) is the cached ell_theta0(q)."""
    from erpo.integrations.openrlhf import actor_logprobs
    from erpo.integrations.openrlhf_reference import load_or_build_query_reference
    path, tokenizer, _ = chat_model
    rows = [[SYSTEM, {"role": "user", "content": QUESTIONS[0]}], [{"role": "user", "content": "z" * 50}],
            [{"role": "user", "content": QUESTIONS[2]}]]
    texts = [openrlhf_rollout.preprocess_data({"input": messages}, input_key="input",
                                              apply_chat_template=tokenizer.apply_chat_template)[0]
             for messages in rows]
    max_len, max_new_tokens = 60, None if executor == "single-turn-dynamic" else 4
    agent, engine = openrlhf_rollout.agent, StandInEngine(tokenizer)

    class OneFeedback(agent.AgentInstanceBase):   # one environment turn, then a second action
        def __init__(self):
            self.turns = 0

        async def step(self, states, **kwargs):
            self.turns += 1
            return {"rewards": torch.tensor(0.0), "environment_feedback": "\nok\n", "done": self.turns == 2}

    executor_of = {"multi-turn": lambda: agent.MultiTurnAgentExecutor(OneFeedback)}.get(
        executor, agent.SingleTurnAgentExecutor)
    # each prompt's own sampling params, as each of OpenRLHF's remote calls gets a copy (the multi-turn executor
    # writes its budget into them)
    responses = [asyncio.run(executor_of().execute(text, "", types.SimpleNamespace(max_tokens=max_new_tokens,
                                                                                   logprobs=None),
                                                   max_len, tokenizer, engine)) for text in texts]
    batch = openrlhf_rollout.batch_of(responses, max_len)
    if executor == "multi-turn":
        assert any(len(r["action_ranges"]) == 2 for r in responses)   # feedback tokens after the first action

    actor = openrlhf_actor(openrlhf_rollout.models, path, torch.float32)
    reference = load_or_build_query_reference(actor, tokenizer, texts, path=str(tmp_path / "cache.json"),
                                              model_path=path, max_prompt_length=max_len - (max_new_tokens or 1))
    with torch.no_grad():
        scores = actor_logprobs(actor, batch.sequences, batch.action_mask, batch.attention_mask)
    whole = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    budget = max_len - (max_new_tokens or 1)
    assert [len(ids) for ids in scores.prompt_ids] == [min(n, budget) for n in whole] and max(whole) > budget
    assert all(starts_with_one_bos(ids, tokenizer.bos_token_id) for ids, n in zip(scores.prompt_ids, whole)
               if n <= budget)
    assert scores.prompt_ids == [r["observation_tokens"][:r["action_ranges"][0][0]] for r in responses]
    ell0, _ = reference.lookup(scores.prompt_ids)
    torch.testing.assert_close(ell0, scores.query_logp, rtol=1e-6, atol=1e-5)


def test_openrlhf_a_reset_that_rewrites_the_prompt_is_refused(openrlhf_rollout, chat_model, tmp_path):
    """A multi-turn agent whose reset() rewrites the observation sends the actor a prompt the cache never scored:
    the lookup is a one-line error naming it (never another prompt's ell_theta0(q))."""
    from erpo.integrations.openrlhf import actor_logprobs
    from erpo.integrations.openrlhf_reference import load_or_build_query_reference
    path, tokenizer, _ = chat_model
    agent = openrlhf_rollout.agent

    class Rewrites(agent.AgentInstanceBase):
        def __init__(self):
            pass

        async def reset(self, states, **kwargs):
            return {"observation": "Hint: add.\n" + states["observation"]}

        async def step(self, states, **kwargs):
            return {"rewards": torch.tensor(0.0), "environment_feedback": "", "done": True}

    text = "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    params = types.SimpleNamespace(max_tokens=4, logprobs=None)
    response = asyncio.run(agent.MultiTurnAgentExecutor(Rewrites).execute(text, "", params, 60, tokenizer,
                                                                          StandInEngine(tokenizer)))
    batch = openrlhf_rollout.batch_of([response], 60)
    actor = openrlhf_actor(openrlhf_rollout.models, path, torch.float32)
    reference = load_or_build_query_reference(actor, tokenizer, [text], path=str(tmp_path / "cache.json"),
                                              model_path=path, max_prompt_length=56)
    with torch.no_grad():
        scores = actor_logprobs(actor, batch.sequences, batch.action_mask, batch.attention_mask)
    with pytest.raises(ValueError, match=r"^prompt 'Hint: add.\\n<\|im_start\|>user.* has no ell_theta0\(q\) in the "
                                         r"reference cache .* this one reached the loss otherwise") as error:
        reference.lookup(scores.prompt_ids)
    assert "\n" not in str(error.value)


def test_openrlhf_a_one_token_prompt_is_refused(chat_model, tmp_path):
    """A PromptDataset prompt of one token is refused in one line before anything is scored (as before this check
    moved into `load_or_build_reference`, which verl's cache shares)."""
    from erpo.integrations.openrlhf_reference import load_or_build_query_reference
    path = chat_model[0]
    with pytest.raises(ValueError, match=r"^prompt 'a' has 1 token\(s\) \(1 of 2 prompts") as error:
        load_or_build_query_reference(StandInActor(path), build_tokenizer(), ["ab", "a"],
                                      path=str(tmp_path / "cache.json"), model_path=path)
    assert "\n" not in str(error.value) and not (tmp_path / "cache.json").exists()
