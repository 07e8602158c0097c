"""erpo.reference.cache: ell_theta0(q) through the fused-linear path, w(q), identity checks, persistence."""
import json
import os
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

import erpo.models.fingerprint as fingerprints
import erpo.reference.cache as rc
import erpo.reference.setup as reference_setup
from erpo.cli.commands import stop_line
from erpo.config import Config, apply_overrides, resolve
from erpo.errors import Terminated, UserError
from erpo.models.fingerprint import fingerprint_cache_path, model_fingerprint, tokenizer_fingerprint
from erpo.models.tiny import build_model, build_tokenizer
from erpo.reference.cache import ReferenceCache, build_reference_cache, compute_query_logp, prompt_hash
from erpo.reference.cache_path import reference_cache_path
from erpo.tasks.data import PromptSet
from erpo_kernels import query_weights


@pytest.fixture(autouse=True)
def _private_caches(tmp_path, monkeypatch):
    """Each test starts with no weight digests (in memory or on disk) and an empty Hugging Face cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(fingerprints, "_digests", {})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.fixture(scope="module")
def setup():
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_layers=1).eval()
    texts = ["<|im_start|>user\n1+1=?<|im_end|>\n", "12+30=?", "7-2=? and some more text here"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return model, tokenizer, prompts


def manual_query_logp(model, ids, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double() / temperature
    return float(logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None]).sum())


def test_query_logp_is_the_sum_over_prompt_tokens_after_the_first(setup):
    model, tokenizer, prompts = setup
    for batch_size in (1, 2, 3):
        got = compute_query_logp(model, prompts, pad_id=tokenizer.pad_token_id, batch_size=batch_size)
        expected = torch.tensor([manual_query_logp(model, p) for p in prompts], dtype=torch.float64)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    hot = compute_query_logp(model, prompts, pad_id=tokenizer.pad_token_id, batch_size=3, temperature=2.0)
    torch.testing.assert_close(hot[1], torch.tensor(manual_query_logp(model, prompts[1], 2.0), dtype=torch.float64),
                               atol=1e-4, rtol=1e-5)


def test_build_cache_weights_and_lookup(setup, tmp_path):
    model, tokenizer, prompts = setup
    model.save_pretrained(tmp_path / "m")
    cache = build_reference_cache(model, tokenizer, prompts + prompts[:1], model_id=str(tmp_path / "m"),
                                  template="plain|chat=True", batch_size=2)
    assert len(cache.entries) == 3  # duplicates share one entry
    ell, w = cache.lookup(prompts)
    torch.testing.assert_close(w, query_weights(ell.double()), atol=1e-6, rtol=1e-6)
    assert bool((ell < 0).all()) and bool((w >= 0).all()) and bool((w <= 2).all())
    path = cache.save(str(tmp_path / "c" / "ref.json"))
    loaded = ReferenceCache.load(path)
    assert loaded == cache and loaded.cache_id == cache.cache_id
    assert json.loads((tmp_path / "c" / "ref.json").read_text())["model_id"] == str(tmp_path / "m")
    with pytest.raises(ValueError, match=r"prompt with token ids \[5, 6, 7\] has no ell_theta0.*1 of 1 prompts "
                                         r"missing.*precompute-ref"):
        cache.lookup([[5, 6, 7]])


def test_holds_is_the_lookup_s_membership():
    """`ReferenceCache.holds(ids)`: whether a lookup of that prompt finds it (the prompt's token ids, by
    `prompt_hash`), the one membership test of the TRL trainer's cache and `load_or_build_reference`'s."""
    cache = ReferenceCache("m", "fp", "t", "tfp", "plain", "fp32", {prompt_hash([1, 2, 3]): (-2.0, 1.0)})
    assert cache.holds([1, 2, 3]) and cache.holds(torch.tensor([1, 2, 3]).tolist()) and cache.holds((1, 2, 3))
    assert not cache.holds([1, 2]) and not cache.holds([3, 2, 1])
    for ids in ([1, 2, 3], [1, 2]):
        try:
            cache.lookup([ids])
            found = True
        except ValueError:
            found = False
        assert found == cache.holds(ids)


def test_incompatible_cache_is_refused_with_a_clear_message(setup, tmp_path):
    model, tokenizer, prompts = setup
    model.save_pretrained(tmp_path / "m")
    cache = build_reference_cache(model, tokenizer, prompts, model_id=str(tmp_path / "m"), template="paper|chat=True",
                                  batch_size=4)
    same = {"model_id": str(tmp_path / "m"), "model_fp": model_fingerprint(str(tmp_path / "m")),
            "tokenizer_id": "t", "tokenizer_fp": tokenizer_fingerprint(tokenizer), "template": "paper|chat=True"}
    cache.check_compatible(**same)
    other = build_model(tokenizer, seed=1, hidden_size=32, intermediate_size=64, num_layers=1)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"model: cache built with .*/m .*training uses .*/other.*precompute-ref"):
        cache.check_compatible(**{**same, "model_id": str(tmp_path / "other"),
                                  "model_fp": model_fingerprint(str(tmp_path / "other"))})
    with pytest.raises(ValueError, match="prompt template: cache built with 'paper|chat=True'"):
        cache.check_compatible(**{**same, "template": "plain|chat=True"})
    other_tok = build_tokenizer()
    other_tok.chat_template = "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="tokenizer: cache built with"):
        cache.check_compatible(**{**same, "tokenizer_fp": tokenizer_fingerprint(other_tok)})


def test_fingerprints_and_hashes(setup, tmp_path):
    _, tokenizer, prompts = setup
    assert prompt_hash(prompts[0]) == prompt_hash(list(prompts[0])) != prompt_hash(prompts[0][1:])
    assert model_fingerprint("Qwen/Qwen2.5-Math-7B") == "name:Qwen/Qwen2.5-Math-7B"
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(build_tokenizer())
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"format_version": 0}))
    with pytest.raises(ValueError, match="format version 0"):
        ReferenceCache.load(str(bad))


@pytest.mark.parametrize("content, what", [("not json", "Expecting value"), ("[1, 2]", "a JSON list, not an object"),
                                           (b"\xff\xfe\x00", "can't decode")])
def test_a_file_that_is_not_a_cache_is_one_line_naming_it(setup, tmp_path, content, what):
    """Another file at the cache path (a run pointed at the wrong file) is refused in one line naming it: it was
    the JSON parser's message alone, without the file (a one-line UserError in `erpo train`, a traceback in the
    integrations), or an AttributeError traceback for JSON that is not an object."""
    model, tokenizer, prompts = setup
    path = tmp_path / "run" / "reference_cache.json"
    path.parent.mkdir()
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=f"^{path} is not a reference cache \\(.*{what}.*\\); delete or move it"):
        ReferenceCache.load(str(path))
    model.save_pretrained(tmp_path / "m")
    cfg = resolve(apply_overrides(Config(), [f"output_dir={tmp_path / 'run'}"]))
    with pytest.raises(UserError, match=f"^{path} is not a reference cache") as refused:
        reference_setup.precompute_reference(cfg, model=model, model_path=str(tmp_path / "m"), tokenizer=tokenizer,
                                             prompt_set=PromptSet([{}] * 3, ["p"] * 3, prompts, ["a"] * 3))
    assert "\n" not in str(refused.value)


def rewrite(file, data: bytes, mtime_ns: int) -> None:
    """Write `data` with an explicit mtime (a coarse filesystem clock must not hide the change)."""
    file.write_bytes(data)
    os.utime(file, ns=(mtime_ns, mtime_ns))


def flip_byte(file, offset: int, mtime_ns: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 1
    rewrite(file, bytes(data), mtime_ns)


def test_an_adapter_is_identified_by_its_config_and_its_base_model(tmp_path):
    """A LoRA adapter's fingerprint (the `erpo eval` sample cache's model identity, and a reference cache's) covers its
    adapter_config.json and its base model besides its weights: equal weights with another lora_alpha are another
    model, as is the same adapter on a base changed in place; the same directory, or a copy, is the same model."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen2"}')
    rewrite(base / "model.safetensors", b"theta0", 1)
    config = {"peft_type": "LORA", "base_model_name_or_path": str(base), "r": 4, "lora_alpha": 8,
              "target_modules": ["q_proj", "v_proj"]}
    adapters = {}
    for name, alpha in (("a", 8), ("copy", 8), ("alpha16", 16)):
        adapters[name] = tmp_path / name
        adapters[name].mkdir()
        (adapters[name] / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": alpha}))
        rewrite(adapters[name] / "adapter_model.safetensors", b"lora weights", 1)
    a = model_fingerprint(str(adapters["a"]))
    assert a.startswith("sha256:") and a == model_fingerprint(str(adapters["a"])) == model_fingerprint(
        str(adapters["copy"]))
    assert model_fingerprint(str(adapters["alpha16"])) != a
    flip_byte(base / "model.safetensors", 0, 2)   # the base fine-tuned in place: the adapter now adapts another model
    assert model_fingerprint(str(adapters["a"])) != a
    (adapters["a"] / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(ValueError, match="adapter_config.json names no base_model_name_or_path"):
        model_fingerprint(str(adapters["a"]))


def test_model_fingerprint_hashes_every_byte_of_every_weight_file(tmp_path):
    model = tmp_path / "m"
    (model / "shards").mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    rewrite(model / "model.safetensors", bytes(3 << 20), 1)   # 3 MiB: its middle is past the first/last MiB
    rewrite(model / "shards" / "part-1.safetensors", b"shard", 1)
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "shards/part-1.safetensors"}}))
    fingerprints = [model_fingerprint(str(model))]
    flip_byte(model / "model.safetensors", 3 << 19, 2)   # fine-tuned: same name, size, head and tail
    fingerprints.append(model_fingerprint(str(model)))
    flip_byte(model / "shards" / "part-1.safetensors", 2, 2)   # a shard in a sub-folder, named by the index
    fingerprints.append(model_fingerprint(str(model)))
    index.write_text(json.dumps({"metadata": {"total_size": 5}, "weight_map": {"w": "shards/part-1.safetensors"}}))
    fingerprints.append(model_fingerprint(str(model)))
    (model / "config.json").write_text('{"model_type": "llama"}')
    fingerprints.append(model_fingerprint(str(model)))
    assert len(set(fingerprints)) == len(fingerprints) and all(f.startswith("sha256:") for f in fingerprints)
    flip_byte(model / "model.safetensors", 3 << 19, 3)   # back to the original bytes
    assert model_fingerprint(str(model)) != fingerprints[0]   # (config and index still differ)
    (model / "shards" / "part-1.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="part-1.safetensors"):
        model_fingerprint(str(model))


def test_weight_digests_are_memoized_and_persisted(tmp_path, monkeypatch):
    hashed = []
    real_sha256 = fingerprints.file_sha256
    monkeypatch.setattr(fingerprints, "file_sha256", lambda path: hashed.append(path.name) or real_sha256(path))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    rewrite(weights, b"weights", 1)
    fingerprint = model_fingerprint(str(model))
    assert model_fingerprint(str(model)) == fingerprint and hashed == ["model.safetensors"]   # memoized
    side = json.loads(fingerprint_cache_path().read_text())
    assert side == {str(weights.resolve()): [7, 1, real_sha256(weights)]}
    monkeypatch.setattr(fingerprints, "_digests", {})   # a new process reads the persisted digest
    assert model_fingerprint(str(model)) == fingerprint and hashed == ["model.safetensors"]
    os.utime(weights, ns=(2, 2))   # touched: hashed again, same content, same fingerprint
    assert model_fingerprint(str(model)) == fingerprint and hashed == ["model.safetensors"] * 2
    other = tmp_path / "other"
    other.mkdir()
    rewrite(other / "model.safetensors", b"other", 1)
    model_fingerprint(str(other))
    weights.unlink()
    rewrite(other / "model.safetensors", b"other!", 2)
    model_fingerprint(str(other))   # entries of deleted or changed files are dropped when the side cache is written
    assert json.loads(fingerprint_cache_path().read_text()) == {
        str((other / "model.safetensors").resolve()): [6, 2, real_sha256(other / "model.safetensors")]}


def test_fingerprint_without_a_writable_or_valid_side_cache(tmp_path, monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    rewrite(model / "model.safetensors", b"weights", 1)
    expected = model_fingerprint(str(model))
    monkeypatch.setattr(fingerprints, "_digests", {})
    fingerprint_cache_path().write_text("not json")
    assert model_fingerprint(str(model)) == expected
    assert json.loads(fingerprint_cache_path().read_text())   # rewritten
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a_file"))   # no directory can be made there
    monkeypatch.setattr(fingerprints, "_digests", {})
    assert model_fingerprint(str(model)) == expected and not fingerprint_cache_path().parent.exists()


def test_hub_name_fingerprint_records_the_revision_cached_offline(tmp_path):
    assert model_fingerprint("org/model") == "name:org/model"
    assert model_fingerprint("not/a/repo id") == "name:not/a/repo id"
    repo, commit = tmp_path / "hub" / "models--org--model", "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert model_fingerprint("org/model") == "name:org/model"   # config.json not downloaded: revision unknown
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    assert model_fingerprint("org/model") == f"name:org/model@{commit}"


def test_build_cache_takes_precomputed_fingerprints(setup, monkeypatch):
    model, tokenizer, prompts = setup

    def recomputed(*args):
        raise AssertionError("fingerprint recomputed")

    monkeypatch.setattr(rc, "model_fingerprint", recomputed)
    monkeypatch.setattr(rc, "tokenizer_fingerprint", recomputed)
    cache = build_reference_cache(model, tokenizer, prompts, model_id="m", template="t", batch_size=4,
                                  model_fp="sha256:m", tokenizer_fp="sha256:t")
    assert (cache.model_fingerprint, cache.tokenizer_fingerprint) == ("sha256:m", "sha256:t")


def test_precompute_reference_fingerprints_and_looks_up_once(setup, tmp_path, monkeypatch):
    """Built or loaded: the model is fingerprinted once, the prompts looked up once, and the values returned."""
    model, tokenizer, prompts = setup
    model.save_pretrained(tmp_path / "m")
    cfg = resolve(apply_overrides(Config(), [f"output_dir={tmp_path / 'run'}"]))
    prompt_set = PromptSet([{}] * len(prompts), ["p"] * len(prompts), prompts, ["a"] * len(prompts))
    calls = []
    real_fingerprint, real_lookup = fingerprints.model_fingerprint, ReferenceCache.lookup

    def counted_fingerprint(name):
        return calls.append("fingerprint") or real_fingerprint(name)

    monkeypatch.setattr(rc, "model_fingerprint", counted_fingerprint)
    monkeypatch.setattr(reference_setup, "model_fingerprint", counted_fingerprint)
    monkeypatch.setattr(ReferenceCache, "lookup", lambda self, ids, path="", **kwargs: calls.append("lookup") or
                        real_lookup(self, ids, path, **kwargs))
    for _ in ("build", "load"):
        calls.clear()
        cache, path, (ell, w) = reference_setup.precompute_reference(
            cfg, model=model, model_path=str(tmp_path / "m"), tokenizer=tokenizer, prompt_set=prompt_set)
        assert sorted(calls) == ["fingerprint", "lookup"] and path == str(tmp_path / "run" / "reference_cache.json")
        expected = real_lookup(cache, prompts)
        torch.testing.assert_close(ell, expected[0], rtol=0, atol=0)
        torch.testing.assert_close(w, expected[1], rtol=0, atol=0)


def test_precompute_reference_scores_at_the_rollout_temperature(setup, tmp_path):
    """`erpo precompute-ref` scores ell_theta0(q) at rollout.temperature, the loss's temperature (logits / T), and
    records it: at T = 0.7 the values are the manual log-likelihood at 0.7, not at 1."""
    model, tokenizer, prompts = setup
    model.save_pretrained(tmp_path / "m")
    cfg = resolve(apply_overrides(Config(), [f"output_dir={tmp_path / 'run'}", "rollout.temperature=0.7"]))
    prompt_set = PromptSet([{}] * len(prompts), ["p"] * len(prompts), prompts, ["a"] * len(prompts))
    cache, _, (ell, _) = reference_setup.precompute_reference(
        cfg, model=model, model_path=str(tmp_path / "m"), tokenizer=tokenizer, prompt_set=prompt_set)
    at = {t: torch.tensor([manual_query_logp(model, p, t) for p in prompts]) for t in (0.7, 1.0)}
    torch.testing.assert_close(ell, at[0.7].float(), atol=1e-3, rtol=1e-5)
    assert (ell - at[1.0]).abs().min() > 0.1 and cache.template.endswith("|temperature=0.7")


def test_a_cache_that_serves_every_prompt_hashes_no_dataset_rows(setup, tmp_path, monkeypatch):
    """The digest of the dataset's rows is written once, when the cache is built, and read back only to say why a
    prompt is missing: a start whose prompts are all there does not hash the dataset again."""
    model, tokenizer, prompts = setup
    model.save_pretrained(tmp_path / "m")
    cfg = resolve(apply_overrides(Config(), [f"output_dir={tmp_path / 'run'}"]))
    prompt_set = PromptSet([{}] * len(prompts), ["p"] * len(prompts), prompts, ["a"] * len(prompts))
    digests = []
    real_digest = reference_setup.dataset_rows_digest
    monkeypatch.setattr(reference_setup, "dataset_rows_digest", lambda ps: digests.append(1) or real_digest(ps))

    def precompute():
        return reference_setup.precompute_reference(cfg, model=model, model_path=str(tmp_path / "m"),
                                                    tokenizer=tokenizer, prompt_set=prompt_set)
    built = precompute()[0]
    assert len(digests) == 1 and built.dataset == real_digest(prompt_set)   # the build records it
    precompute()
    assert len(digests) == 1   # the read served every prompt: nothing hashed


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated])
def test_a_stop_while_scoring_names_the_reference_cache_and_writes_nothing(setup, tmp_path, monkeypatch, stop):
    """Ctrl-C or SIGTERM (erpo.cli raises Terminated) while ell_theta0(q) is computed stops at once: the `erpo`
    command's one line names the reference cache (`stop_line`), and no cache file is left for a rerun to trust."""
    model, tokenizer, prompts = setup
    model.save_pretrained(tmp_path / "m")
    cfg = resolve(apply_overrides(Config(), [f"output_dir={tmp_path / 'run'}"]))
    prompt_set = PromptSet([{}] * len(prompts), ["p"] * len(prompts), prompts, ["a"] * len(prompts))

    def stopped(*args, **kwargs):
        raise stop()
    monkeypatch.setattr(reference_setup, "build_reference_cache", stopped)
    with pytest.raises(stop) as stopped_here:
        reference_setup.precompute_reference(cfg, model=model, model_path=str(tmp_path / "m"), tokenizer=tokenizer,
                                             prompt_set=prompt_set)
    path = reference_cache_path(cfg)
    how = "stopped (SIGTERM)" if stop is Terminated else "interrupted (Ctrl-C)"
    assert stop_line("train", stopped_here.value) == (
        f"erpo train: {how} during the reference cache's ell_theta0(q); nothing was written to {path} (the same "
        "command computes it again)")
    assert not os.path.exists(path)


def test_a_cache_of_more_prompts_gives_the_training_sets_weights(setup, tmp_path):
    """w(q) = clip(mean(s) / s_q, 0, 2) with mean(s) over the training set (appendix C). A cache built with more
    prompts (a larger data set, or prompts a later data.max_prompt_length drops) stores w relative to all of them:
    training on two of its three prompts takes the two's own weights, not the stored ones (which differed)."""
    model, tokenizer, prompts = setup
    model.save_pretrained(tmp_path / "m")
    cfg = resolve(apply_overrides(Config(), [f"output_dir={tmp_path / 'run'}"]))

    def run(ids):
        prompt_set = PromptSet([{}] * len(ids), ["p"] * len(ids), ids, ["a"] * len(ids))
        return reference_setup.precompute_reference(cfg, model=model, model_path=str(tmp_path / "m"),
                                                    tokenizer=tokenizer, prompt_set=prompt_set)
    cache, _, _ = run(prompts)
    subset = [prompts[1], prompts[2], prompts[1]]     # a repeated prompt counts once in mean(s)
    _, _, (ell, w) = run(subset)
    distinct = ell[:2].double()
    torch.testing.assert_close(w, query_weights(ell.double(), mean_surprisal=float(-distinct.mean())))
    assert (w - cache.lookup(subset)[1]).abs().max() > 0.01


@pytest.mark.parametrize("change, why", [
    ("prompts", "the dataset's rows are the ones it was built from, but these prompts' text and token ids are not"),
    ("dataset", "the dataset changed since it was built"),
    ("prompts of a cache recording no rows", "the dataset, or how erpo builds a prompt from a row, changed since")])
def test_a_cache_missing_the_run_s_prompts_says_whether_the_dataset_or_the_prompts_changed(setup, tmp_path, change,
                                                                                         why):
    """Prompts built another way from the same rows (audit3's instruction stripping) are not "the dataset changed":
    the one-line refusal names which changed, the first missing prompt's text, and the remedy."""
    model, tokenizer, prompts = setup
    model.save_pretrained(tmp_path / "m")
    cfg = resolve(apply_overrides(Config(), [f"output_dir={tmp_path / 'run'}"]))
    rows = [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(len(prompts))]

    def precompute(rows, ids):
        prompt_set = PromptSet(rows, ["p"] * len(ids), ids, ["a"] * len(ids))
        return reference_setup.precompute_reference(cfg, model=model, model_path=str(tmp_path / "m"),
                                                    tokenizer=tokenizer, prompt_set=prompt_set)
    _, path, _ = precompute(rows, prompts)
    if change.endswith("recording no rows"):   # a cache built before the rows' digest was recorded
        Path(path).write_text(json.dumps({k: v for k, v in json.loads(Path(path).read_text()).items()
                                          if k != "dataset"}))
    reformatted = [tokenizer("Solve: ", add_special_tokens=False)["input_ids"] + ids for ids in prompts]
    with pytest.raises(UserError) as refused:
        precompute([{**row, "problem": row["problem"] + "?"} for row in rows] if change == "dataset" else rows,
                   reformatted)
    message = str(refused.value)
    assert message.startswith(f"prompt {tokenizer.decode(reformatted[0])[:300]!r} has no ell_theta0(q) in the "
                              f"reference cache {path} ({len(prompts)} of {len(prompts)} prompts missing) ({why}")
    assert message.endswith("Rebuild it with `erpo precompute-ref --overwrite`.") and "\n" not in message


def test_a_cache_of_another_problem_field_names_it(setup, tmp_path):
    """`erpo precompute-ref` with one data.problem_field, then a run reading another column of the same rows as the
    problem: the rows' digest matches, so the refusal is not "the dataset changed", and it names data.problem_field
    (it named erpo's own prompt format alone, which had not changed)."""
    model, tokenizer, _ = setup
    model.save_pretrained(tmp_path / "m")
    source = tmp_path / "rows.jsonl"
    rows = [{"problem": f"{i}+1", "question": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(3)]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def precompute(field):
        cfg = resolve(apply_overrides(Config(), [f"output_dir={tmp_path / 'run'}", f"data.source={source}",
                                                 f"data.problem_field={field}"]))
        return reference_setup.precompute_reference(cfg, model=model, model_path=str(tmp_path / "m"),
                                                    tokenizer=tokenizer)
    precompute("problem")
    with pytest.raises(UserError, match=r"\(3 of 3 prompts missing\) \(the dataset's rows are the ones it was built "
                                        r"from, but these prompts' text and token ids are not: the column read as the "
                                        r"problem, data.problem_field, or how erpo builds a prompt"):
        precompute("question")


def test_a_cache_recording_no_rows_serves_a_resume_that_has_every_prompt(setup, tmp_path):
    """A cache built before `erpo precompute-ref` recorded the rows' digest is read as it is when it holds every
    prompt, with the same values and the same id (what a checkpoint records and `--resume` compares), so an older
    run resumes with it."""
    model, tokenizer, prompts = setup
    model.save_pretrained(tmp_path / "m")
    cfg = resolve(apply_overrides(Config(), [f"output_dir={tmp_path / 'run'}"]))
    rows = [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(len(prompts))]

    def precompute():
        return reference_setup.precompute_reference(cfg, model=model, model_path=str(tmp_path / "m"),
                                                    tokenizer=tokenizer,
                                                    prompt_set=PromptSet(rows, ["p"] * 3, prompts, ["a"] * 3))
    cache, path, (ell, w) = precompute()
    Path(path).write_text(json.dumps({k: v for k, v in json.loads(Path(path).read_text()).items() if k != "dataset"}))
    older, _, (ell_again, w_again) = precompute()
    assert older.dataset is None and older.cache_id == cache.cache_id
    assert torch.equal(ell_again, ell) and torch.equal(w_again, w)


def test_only_rank_zero_reads_the_weights_for_the_fingerprint(monkeypatch, tmp_path):
    """Every rank needs the run's identity, but hashing a 15 GB model on each of 8 ranks at once would stall the
    start: rank 0 hashes and the others receive its fingerprint."""
    from erpo import distributed
    from erpo.config import Config

    def must_not_hash(path):
        raise AssertionError("a rank other than 0 hashed the weights")

    class Tokenizer:
        name_or_path = "tok"
        chat_template = None

    monkeypatch.setattr(distributed, "is_main", lambda: False)
    monkeypatch.setattr(distributed, "all_gather_object", lambda obj: ["sha256:from-rank-0", obj])
    monkeypatch.setattr(reference_setup, "model_fingerprint", must_not_hash)
    monkeypatch.setattr(reference_setup, "run_precision", lambda cfg, path, model: "p")   # no model in tmp_path
    identity = reference_setup.reference_identity(Config(), str(tmp_path), Tokenizer())
    assert identity["model_fp"] == "sha256:from-rank-0"
