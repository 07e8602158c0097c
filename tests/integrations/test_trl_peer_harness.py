"""The peer check's own parts (peer/trl), without TRL's test file: the offline stand-ins for the Hub's tiny models and
data sets load by their Hub ids from the cache they are written to, generate, and have what TRL's tests use; the
plugin's outcome bookkeeping and the runner's table are right."""
import json

import pytest
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from peer.trl import plugin, run, standins

# One of each kind: plain, tied/untied, BOS-adding with soft-capping, MoE, harmony template, remote code, classifier.
CAUSAL = ["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5", "trl-internal-testing/tiny-Gemma2ForCausalLM",
          "trl-internal-testing/tiny-Qwen3MoeForCausalLM", "trl-internal-testing/tiny-GptOssForCausalLM"]
REWARD = "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5"
REMOTE = "trl-internal-testing/tiny-RemoteForCausalLM"
CONVERSATION = [{"role": "user", "content": "Héllo,\n  what is 2+2?"}]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Offline mode, as the peer runs set it (HF_HUB_OFFLINE=1): without it a local load still tries the Hub and
    waits for each request to time out."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def load_offline(auto, cache, repo_id, **kwargs):
    """`auto.from_pretrained(repo_id)` resolved from the stand-in hub cache only, as HF_HOME + offline mode do."""
    return auto.from_pretrained(repo_id, cache_dir=standins.hub_home(cache) / "hub", local_files_only=True, **kwargs)


@pytest.mark.parametrize("repo_id", CAUSAL)
def test_causal_standin_loads_offline_by_hub_id_and_generates(tmp_path, repo_id):
    standins.write_model(tmp_path, repo_id, standins.HUB_MODELS[repo_id])
    tokenizer = load_offline(AutoTokenizer, tmp_path, repo_id)
    model = load_offline(AutoModelForCausalLM, tmp_path, repo_id)
    assert type(model).__name__ in repo_id  # the Hub repository's architecture class
    assert tokenizer.pad_token is not None and tokenizer.eos_token_id is not None
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert "Héllo,\n  what is 2+2?" in text
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text  # byte-level: any text round-trips
    for token in standins.template_special_tokens(standins.chat_template(standins.HUB_MODELS[repo_id].tokenizer
                                                                         .template)):
        assert len(tokenizer(token, add_special_tokens=False).input_ids) == 1, token
    prompt = tokenizer(text, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**prompt, max_new_tokens=4, do_sample=True)
    assert out.shape == (1, prompt.input_ids.shape[1] + 4) or tokenizer.eos_token_id in out[0].tolist()
    eos = model.generation_config.eos_token_id
    assert tokenizer.eos_token_id in (eos if isinstance(eos, list) else [eos])


def test_standins_keep_what_the_trainers_must_handle(tmp_path):
    """Gemma-2 soft-caps its logits and adds BOS; Qwen3-MoE has a router aux loss on by default, as the real ones."""
    gemma = standins.build_config(standins.HUB_MODELS[CAUSAL[1]], standins.build_tokenizer(standins.GEMMA, "g"))
    assert gemma.final_logit_softcapping == 30.0
    tokenizer = standins.build_tokenizer(standins.GEMMA, "g")
    assert tokenizer("hi").input_ids[0] == tokenizer.bos_token_id
    moe = standins.build_config(standins.HUB_MODELS[CAUSAL[2]], standins.build_tokenizer(standins.QWEN3, "q"))
    assert moe.router_aux_loss_coef > 0 and hasattr(moe, "output_router_logits")


def test_reward_standin_scores_a_batch(tmp_path):
    standins.write_model(tmp_path, REWARD, standins.HUB_MODELS[REWARD])
    tokenizer = load_offline(AutoTokenizer, tmp_path, REWARD)
    model = load_offline(AutoModelForSequenceClassification, tmp_path, REWARD)
    batch = tokenizer(["a short one", "a longer completion"], return_tensors="pt", padding=True)
    assert model(**batch).logits.shape == (2, 1)


def test_remote_code_standin_needs_trust_remote_code(tmp_path):
    standins.write_model(tmp_path, REMOTE, standins.HUB_MODELS[REMOTE])
    with pytest.raises(ValueError, match="custom code"):
        load_offline(AutoModelForCausalLM, tmp_path, REMOTE, trust_remote_code=False)
    model = load_offline(AutoModelForCausalLM, tmp_path, REMOTE, trust_remote_code=True)
    assert type(model).__name__ == "RemoteForCausalLM"


def test_zen_standin_has_both_formats_and_splits(tmp_path):
    folder = standins.write_dataset(tmp_path, "trl-internal-testing/zen")
    load = plugin.local_load_dataset(tmp_path, load_dataset)  # the plugin's Hub-id mapping
    cache = str(tmp_path / "datasets_cache")  # not the user's: pytest reuses tmp paths, the default cache is stale
    standard = load("trl-internal-testing/zen", "standard_prompt_only", split="train", cache_dir=cache)
    conversational = load("trl-internal-testing/zen", "conversational_prompt_only", split="test", cache_dir=cache)
    assert standard["prompt"] == standins.ZEN_TRAIN
    assert conversational[0]["prompt"] == [{"role": "user", "content": standins.ZEN_TEST[0]}]
    streamed = load_dataset(str(folder), "standard_prompt_only", split="train", streaming=True, cache_dir=cache)
    assert next(iter(streamed)) == {"prompt": standins.ZEN_TRAIN[0]}


def test_table_puts_erpo_only_failures_first_and_the_worst_report_wins(tmp_path):
    def report(trainer, *entries):
        (tmp_path / f"{trainer}.jsonl").write_text("".join(
            json.dumps({"nodeid": f"t.py::{n}", "outcome": o, "message": m}) + "\n" for n, o, m in entries))

    report("grpo", ("a", "passed", ""), ("b", "passed", ""), ("c", "failed", "E: both"), ("d", "failed", "E: GRPO"))
    report("erpo", ("a", "passed", ""), ("b", "passed", ""), ("b", "error", "E: teardown"), ("c", "failed", "E: x"),
           ("d", "failed", "E: ERPO"))
    text, erpo_only = run.table(tmp_path, ["# header"])
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert erpo_only == 1
    assert rows[0].startswith("| `b` | passed | error **(ERPO only)** | E: teardown")
    assert rows[1].startswith("| `c` | failed | failed **(other cause)** | E: x")
    assert rows[3].startswith("| `d` | failed | failed | E: ERPO")  # the same failure, only the class name differs
    assert "- GRPOTrainer: 2 passed, 2 failed" in text and "- ERPOTrainer: 1 passed, 2 failed, 1 error" in text


def test_on_cpu_config_defaults_use_cpu_and_pickles():
    import pickle

    from erpo.integrations.trl import ERPOConfig

    config_class = plugin.on_cpu(ERPOConfig)
    args = config_class(output_dir="unused", report_to="none")
    assert isinstance(args, ERPOConfig) and args.use_cpu and args.qkl_coef == ERPOConfig.qkl_coef
    assert type(pickle.loads(pickle.dumps(args))) is config_class
