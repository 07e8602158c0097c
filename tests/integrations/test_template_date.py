"""A chat template that writes today's date (Llama 3.x's, with transformers' `strftime_now`, local time), in the
trainers that render the prompts at each step (TRL, verl's agent loop): when the date changes during a run every
prompt's token ids change and none is in the reference cache. At start the trainer says so in one line with the fix
(`date_string`, where the template reads it, as Llama 3's does; else a template without the date), and the miss
names the date. OpenRLHF renders them once per start (its PromptDataset): its start says so, and a cache read on a
later day names the day it was built. The clock is moved where the template reads it: `datetime` of transformers'
chat_template_utils.

Also: TRL's query_weight='current' without a cache (qkl_coef=0) refuses a prompt of fewer than 2 tokens, as the
cache does (`check_scored_tokens`). `erpo train` tokenizes its prompts once, at start: no date to move there."""
import logging
import os
import re
from datetime import datetime, timedelta

import pytest
from transformers import TrainerCallback
from transformers.utils import chat_template_utils

from erpo.integrations import template_date
from erpo.integrations.template_date import DATE_STRING_FORMAT
from erpo.models.tiny import CHAT_TEMPLATE, build_tokenizer
from erpo.reference.cache import CACHE_FILE
from test_query_tokens import (
    QUESTIONS,
    THINKING_OFF,
    agent_loop_prompts,
    chat_model,  # noqa: F401 (its fixture)
    trl_rows,
    trl_trainer,
    verl_dataset,
)

# Llama 3.x's way: `date_string` when given, else today's date
TAKES_DATE_STRING = ("{% if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
                     "Today: {{ date_string }}\n" + CHAT_TEMPLATE)
CLOCK_ONLY = "Today: {{ strftime_now('%d %b %Y') }}\n" + CHAT_TEMPLATE   # no way to pin it but another template
TEMPLATES = {"date_string": TAKES_DATE_STRING, "clock-only": CLOCK_ONLY}
# what a changed chat template asks of the cache (`DatedTemplate.fix`): the tokenizer's fingerprint records it
DELETE_THE_CACHE = (r"delete the reference cache \(it records the chat template, and a cache built with another one is "
                    r"refused\) and ")


def fixed_template(template: str, day: str) -> str:
    """What the date's fix in the template gives: `template` with the date fixed to `day` where it reads
    date_string (Llama 3's), else without the date."""
    return f"{{% set date_string = {day!r} %}}" + template if template == TAKES_DATE_STRING else CHAT_TEMPLATE


@pytest.fixture(scope="module")
def model_dir(request) -> str:
    """The tiny Qwen2's model directory of test_query_tokens' `chat_model` (build_tokenizer's vocabulary)."""
    return request.getfixturevalue("chat_model")[0]


def dated_tokenizer(template: str):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def today() -> str:
    return datetime.now().strftime(DATE_STRING_FORMAT)


def moved(days: int) -> type:
    """A `datetime` whose now() is `days` from now."""
    class Moved(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + timedelta(days=days)

    return Moved


def move_the_clock(monkeypatch, days: int = 1) -> None:
    """transformers' `strftime_now` reads the date `days` from now."""
    monkeypatch.setattr(chat_template_utils, "datetime", moved(days))


def move_the_machines_clock(monkeypatch, days: int) -> None:
    """The machine's date `days` from now: transformers' `strftime_now` and erpo's date check (template_date) read
    it, as a run started on a later day does."""
    move_the_clock(monkeypatch, days)
    monkeypatch.setattr(template_date, "datetime", moved(days))


class MoveTheClockAfterStep(TrainerCallback):
    """The date changes after the first optimizer step (the audit's reproduction)."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            move_the_clock(self.monkeypatch)


def date_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "writes today's date" in r.getMessage()]


# --- TRL -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template", TEMPLATES)
def test_trl_a_template_that_writes_the_date_is_named(model_dir, tmp_path, monkeypatch, caplog, template):
    """At construction one line warns that the prompts carry today's date and names the fix; when the date changes
    after the first optimizer step, the next step's miss names the date and the same fix (before: only 'did not
    read at construction')."""
    pytest.importorskip("trl", exc_type=ModuleNotFoundError)
    fix = (rf"set ERPOConfig\(chat_template_kwargs=\{{\.\.\., 'date_string': '{today()}'\}}\) \(the date the cache's "
           r"prompts hold\) and start or resume" if template == "date_string" else
           r"give the tokenizer \(processing_class\) a chat template that writes no date \(it does not read "
           rf"date_string\), {DELETE_THE_CACHE}start or resume: the cache is built again from the model as passed")
    with caplog.at_level(logging.WARNING):
        trainer = trl_trainer(model_dir, dated_tokenizer(TEMPLATES[template]), trl_rows(True), tmp_path,
                              max_steps=2, chat_template_kwargs=None)
    warned = date_warnings(caplog)
    assert len(warned) == 1 and "\n" not in warned[0]
    assert re.fullmatch(rf"ERPOTrainer: the chat template writes today's date \({today()}\) into every prompt, which "
                        rf"TRL renders at each step: .* and the run stops; {fix}", warned[0]), warned[0]
    trainer.add_callback(MoveTheClockAfterStep(monkeypatch))
    with pytest.raises(ValueError, match=r"^prompt '.*' has no ell_theta0\(q\) in the reference cache .*did not read "
                                         r"at construction .* Or the date changed since the cache was built: the chat "
                                         rf"template writes today's date into the prompts; {fix}\.$"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_trl_date_string_pins_the_prompts(model_dir, tmp_path, monkeypatch, caplog):
    """With the fix (chat_template_kwargs' date_string) nothing is said, and two steps on either side of a date
    change read the cache."""
    pytest.importorskip("trl", exc_type=ModuleNotFoundError)
    with caplog.at_level(logging.WARNING):
        trainer = trl_trainer(model_dir, dated_tokenizer(TAKES_DATE_STRING), trl_rows(True), tmp_path,
                              max_steps=2, chat_template_kwargs={"date_string": today()})
    assert date_warnings(caplog) == []
    trainer.add_callback(MoveTheClockAfterStep(monkeypatch))
    trainer.train()
    assert [entry["step"] for entry in trainer.state.log_history if "qkl" in entry] == [1, 2]


@pytest.mark.parametrize("template", TEMPLATES)
def test_trl_a_cache_built_on_an_earlier_day_names_that_day(model_dir, tmp_path, monkeypatch, caplog, template):
    """A cache built by a template that writes the date, read on a later day (a run resumed, a cache reused): every
    prompt misses, and the message blamed the dataset ("the dataset, tokenization or chat template changed"). Now it
    names the day the cache was built and the start warning's fix for that day, in one line, and following it
    resumes the run from its checkpoint: date_string, where the template reads it, with the cache as it is; else a
    template without the date, the cache deleted (kept, it is refused: its tokenizer fingerprint records the
    template, which the advice "change the template and resume" missed) and built again, read as it is a day later."""
    pytest.importorskip("trl", exc_type=ModuleNotFoundError)
    built_on, tokenizer = today(), dated_tokenizer(TEMPLATES[template])
    saving = dict(save_strategy="steps", save_steps=1)
    with caplog.at_level(logging.WARNING):
        trl_trainer(model_dir, tokenizer, trl_rows(True), tmp_path, chat_template_kwargs=None, **saving).train()
    cache = tmp_path / CACHE_FILE
    saved = cache.read_bytes()
    move_the_machines_clock(monkeypatch, days=3)
    fix = (rf"set ERPOConfig\(chat_template_kwargs=\{{\.\.\., 'date_string': '{built_on}'\}}\) \(the date the "
           r"cache's prompts hold\) and start or resume" if template == "date_string" else
           r"give the tokenizer \(processing_class\) a chat template that writes no date \(it does not read "
           rf"date_string\), {DELETE_THE_CACHE}start or resume: the cache is built again from the model as passed")
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as error:
        trl_trainer(model_dir, tokenizer, trl_rows(True), tmp_path, chat_template_kwargs=None)
    assert re.fullmatch(rf"prompt '.*' has no ell_theta0\(q\) in the reference cache \S+ \(\d+ of \d+ prompts "
                        rf"missing\) \(the chat template writes today's date into the prompts, and the cache was built "
                        rf"on {built_on}\): {fix}\.", str(error.value)), str(error.value)

    def resume(**kwargs) -> int:   # the run's step 2, resumed from its checkpoint by a new trainer
        trainer = trl_trainer(model_dir, tokenizer, trl_rows(True), tmp_path, max_steps=2, **saving, **kwargs)
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
        return trainer.state.global_step

    if template == "date_string":
        assert resume(chat_template_kwargs={"date_string": built_on}) == 2
        assert cache.read_bytes() == saved   # read, not rebuilt
        return
    tokenizer.chat_template = fixed_template(TEMPLATES[template], built_on)
    with pytest.raises(ValueError, match=r"does not match this run: tokenizer: cache built with"):
        trl_trainer(model_dir, tokenizer, trl_rows(True), tmp_path, chat_template_kwargs=None)
    cache.unlink()
    assert resume(chat_template_kwargs=None) == 2
    rebuilt = cache.read_bytes()
    move_the_machines_clock(monkeypatch, days=4)
    trl_trainer(model_dir, tokenizer, trl_rows(True), tmp_path, chat_template_kwargs=None)
    assert cache.read_bytes() == rebuilt != saved


def test_trl_current_weights_refuse_a_one_token_prompt(model_dir, tmp_path):
    """query_weight='current' with qkl_coef=0 builds no cache: a one-token prompt got w(q) = 0 from its empty
    ell_theta(q) (its policy term dropped) and lowered the others' weights. Refused in one line at its step."""
    pytest.importorskip("trl", exc_type=ModuleNotFoundError)
    rows = [{"prompt": text} for text in ["7", "1+1=", "22+3="]]
    trainer = trl_trainer(model_dir, build_tokenizer(), rows, tmp_path, qkl_coef=0.0, query_weight="current",
                          per_device_train_batch_size=6, chat_template_kwargs=None)
    assert trainer.reference_cache is None
    message = r"^prompt '7' has 1 token\(s\) \(\d of 6 prompts have fewer than 2\)"
    with pytest.raises(ValueError, match=message) as error:
        trainer.train()
    assert "\n" not in str(error.value)


# --- verl ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verl_loop():
    """verl's modules for the agent loop (skipped without verl); bench.verl_engine first sets verl's CPU platform."""
    pytest.importorskip("bench.verl_engine", exc_type=ModuleNotFoundError)
    pytest.importorskip("transfer_queue", exc_type=ModuleNotFoundError)   # erpo.integrations.verl_trainer's verl
    from erpo.integrations import verl_trainer
    return verl_trainer


@pytest.mark.parametrize("template", TEMPLATES)
def test_verl_agent_loop_renders_the_date_each_step(verl_loop, tmp_path, monkeypatch, template):
    """verl's single-turn agent loop renders each prompt when it runs: a day later its prompt_ids are not the ones
    the cache was keyed by at start. `template_date` finds it from the first prompt as `training_prompt_ids` builds
    it, whether the template reads date_string; a date the left truncation cuts off does not count."""
    from omegaconf import OmegaConf
    tokenizer = dated_tokenizer(TEMPLATES[template])
    dataset, data_config = verl_dataset(tokenizer, tmp_path)
    rendering = dict(hf_model_type="qwen2", chat_template_kwargs=THINKING_OFF, prompt_length=100)
    ours = verl_loop.training_prompt_ids(dataset, tokenizer, **rendering)
    dated = verl_loop.template_date(dataset, tokenizer, ours, **rendering)
    assert dated is not None and (dated.today, dated.takes_date_string) == (today(), template == "date_string")
    cut = dict(rendering, prompt_length=40)   # the date is in the first tokens, cut off
    assert verl_loop.template_date(dataset, tokenizer, verl_loop.training_prompt_ids(dataset, tokenizer, **cut),
                                   **cut) is None

    move_the_clock(monkeypatch)
    assert agent_loop_prompts(dataset, data_config, tokenizer, prompt_length=100) != ours
    if template == "date_string":   # the fix: the loop's prompts a day later are the start's
        pinned = dict(rendering, chat_template_kwargs={**THINKING_OFF, "date_string": today()})
        monkeypatch.undo()
        at_start = verl_loop.training_prompt_ids(dataset, tokenizer, **pinned)
        assert at_start == ours and verl_loop.template_date(dataset, tokenizer, at_start, **pinned) is None
        move_the_clock(monkeypatch)
        config = OmegaConf.merge(data_config, {"apply_chat_template_kwargs": pinned["chat_template_kwargs"]})
        assert agent_loop_prompts(dataset, config, tokenizer, prompt_length=100) == ours


def test_verl_trainer_mode_names_the_date(verl_loop, model_dir, tmp_path, monkeypatch, caplog):
    """The `erpo` trainer mode's start (verl's setup stood in for as in test_verl_integration) warns in one line
    with verl's setting; a day later the agent loop's prompts miss the cache, and the miss names the date."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from bench import verl_engine
    from erpo.integrations.verl import ERPOSettings
    from test_verl_integration import PROMPTS, run_config
    tokenizer = dated_tokenizer(TAKES_DATE_STRING)
    dataset = [{"raw_prompt": [{"role": "user", "content": p}]} for p in PROMPTS]
    engine = verl_engine.build_engine(model_dir, param_dtype="bf16")

    def verl_setup(self):   # what PPOTrainer._setup leaves behind that the ERPO trainer reads
        self.tokenizer, self.processor, self.train_dataset, self.global_steps = tokenizer, None, dataset, 0
        self.actor_rollout_wg = verl_engine.EngineWorkerGroup(engine, world_size=1)

    monkeypatch.setattr(PPOTrainerSync, "_setup", verl_setup)
    trainer = object.__new__(verl_loop.ERPOTrainer)
    trainer.config = OmegaConf.merge(run_config((model_dir,), tmp_path, qkl_coef=0.02), OmegaConf.from_dotlist([
        "trainer.device=cpu", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.model.override_config.attn_implementation=sdpa"]))
    trainer.erpo_settings = ERPOSettings(qkl_coef=0.02)
    with caplog.at_level(logging.WARNING):
        trainer._setup()
    fix = (rf"set \+data.apply_chat_template_kwargs.date_string='{today()}' \(the date the cache's prompts hold\) and "
           r"start or resume")
    (warned,) = date_warnings(caplog)
    assert re.fullmatch(rf"ERPO: the chat template writes today's date \({today()}\) into every prompt, which "
                        rf"verl's agent loop renders at each step: .*; {fix}", warned)
    reference = trainer.actor_rollout_wg.loss_fns[0].keywords["reference"]
    rendering = dict(hf_model_type="qwen2", chat_template_kwargs={},
                     prompt_length=trainer.config.actor_rollout_ref.rollout.prompt_length)
    reference.lookup(verl_loop.training_prompt_ids(dataset, tokenizer, **rendering))
    move_the_clock(monkeypatch)
    with pytest.raises(ValueError, match=r"has no ell_theta0\(q\) .*\+erpo.query_weight=none\. Or the date changed "
                                         rf"since the cache was built: .*; {fix}\.$"):
        reference.lookup(verl_loop.training_prompt_ids(dataset, tokenizer, **rendering))

    # the next day's start with this cache (a resumed run, a cache reused) names the day it was built and its fix,
    # where it blamed the data ("the data, chat template, ... changed"); with the fix the cache is read as it is
    built_on = today()
    move_the_machines_clock(monkeypatch, days=1)
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as error:
        trainer._setup()
    assert re.fullmatch(r"prompt '.*' has no ell_theta0\(q\) in the reference cache \S+ \(\d+ of \d+ prompts missing\) "
                        r"\(the chat template writes today's date into the prompts, and the cache was built on "
                        rf"{built_on}\): {fix}\.", str(error.value)), str(error.value)
    trainer.config.data.apply_chat_template_kwargs = {"date_string": built_on}
    trainer._setup()
    assert trainer.actor_rollout_wg.loss_fns[-1].keywords["reference"].entries == reference.entries


# --- OpenRLHF --------------------------------------------------------------------------------------------------------

def openrlhf_prompts(tokenizer) -> list[str]:
    """The PromptDataset's prompts as OpenRLHF 0.11's `preprocess_data` renders a row's question with the chat template
    (a user message, the generation prompt; no keyword arguments), today."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                          add_generation_prompt=True) for question in QUESTIONS]


@pytest.mark.parametrize("template", TEMPLATES)
def test_openrlhf_a_template_that_writes_the_date_is_named(model_dir, tmp_path, monkeypatch, caplog, template):
    """`load_or_build_query_reference` warns in one line, as TRL's and verl's starts do (the same DatedTemplate), that
    the prompts carry today's date and a later day's start misses them; the next start 3 days later (a run resumed, a
    cache reused: OpenRLHF renders its prompts again) names the day the cache was built and the fix in the
    template (OpenRLHF passes it no date_string), where it blamed the data, chat template or truncation. Following
    it works: the template changed (the date fixed to the cache's day, or none), the cache deleted (kept, it is
    refused: its tokenizer fingerprint records the template, which the advice "change the template and resume"
    missed) and built again by a fresh start (a resume cannot: its actor holds a checkpoint); a resumed run reads it
    on any later day. With the date fixed to the cache's day, the new cache holds the old one's values."""
    from erpo.integrations.openrlhf_reference import load_or_build_query_reference
    from test_openrlhf_integration import StandInActor
    tokenizer, built_on = dated_tokenizer(TEMPLATES[template]), today()
    fix = (rf"give the tokenizer of --actor.model_name_or_path a chat template that fixes the date \(\{{% set "
           rf"date_string = '{built_on}' %\}} first\) or writes none" if template == "date_string" else
           r"give the tokenizer of --actor.model_name_or_path a chat template that writes no date \(it does not read "
           r"date_string\)") + (rf", {DELETE_THE_CACHE}start afresh: a resumed run cannot build it again, its actor no "
                                r"longer holds theta0")
    path = str(tmp_path / "cache.json")

    def start(resumed_step=None):
        return load_or_build_query_reference(StandInActor(model_dir), tokenizer, openrlhf_prompts(tokenizer),
                                             path=path, model_path=model_dir, resumed_step=resumed_step)

    with caplog.at_level(logging.WARNING):
        built = start().entries
    (warned,) = date_warnings(caplog)
    assert re.fullmatch(rf"ERPO: the chat template writes today's date \({built_on}\) into every prompt, which "
                        r"OpenRLHF renders at each start: a run resumed, or a cache reused, on another day \(local "
                        r"time\) finds none of its prompts in the reference cache, keyed by today's prompts, and "
                        rf"stops; {fix}", warned), warned
    move_the_machines_clock(monkeypatch, days=3)
    with pytest.raises(ValueError) as error:
        start()
    assert re.fullmatch(r"prompt '.*' has no ell_theta0\(q\) in the reference cache \S+ \(4 of 4 prompts missing\) "
                        r"\(the chat template writes today's date into the prompts, and the cache was built on "
                        rf"{built_on}\): {fix}\.", str(error.value)), str(error.value)
    with pytest.raises(ValueError) as resumed:   # a resumed run: the same fix, no other remedy
        start(resumed_step=2)
    assert str(resumed.value) == str(error.value)

    tokenizer.chat_template = fixed_template(TEMPLATES[template], built_on)
    with pytest.raises(ValueError, match=r"does not match this run: tokenizer: cache built with"):
        start(resumed_step=2)
    os.remove(path)
    rebuilt = start().entries
    assert (rebuilt == built) == (template == "date_string")   # the date the cache held: its prompts and values
    move_the_machines_clock(monkeypatch, days=5)
    assert start(resumed_step=2).entries == rebuilt


def test_openrlhf_finds_the_date_in_the_prompts_the_template_rendered(monkeypatch):
    """The PromptDataset holds texts: `template_date` renders the first one as on another day by moving the date the
    template wrote into it (`on_date`), which is the text the template renders on that day; prompts the template
    did not write (OpenRLHF's input_template), a date the truncation cuts off and a tokenizer without a chat
    template are no date."""
    from erpo.integrations import openrlhf_reference
    tokenizer = dated_tokenizer(TAKES_DATE_STRING)
    (text, *_), yesterday = openrlhf_prompts(tokenizer), datetime.now() - timedelta(days=1)
    ids = openrlhf_reference.prompt_token_ids(tokenizer, [text])[0]
    dated = openrlhf_reference.template_date(tokenizer, text, ids, None)
    assert dated is not None and (dated.today, dated.takes_date_string) == (today(), True)
    move_the_clock(monkeypatch, days=-1)
    assert dated.render({"strftime_now": yesterday.strftime}) == openrlhf_reference.prompt_token_ids(
        tokenizer, openrlhf_prompts(tokenizer)[:1])[0] != ids
    monkeypatch.undo()
    plain = "User: 1+1=\nAssistant: "   # OpenRLHF's input_template, no chat template
    assert openrlhf_reference.template_date(tokenizer, plain, openrlhf_reference.prompt_token_ids(
        tokenizer, [plain])[0], None) is None
    kept = len(ids) - len(f"Today: {today()}\n") - 2   # the date is in the first tokens, cut off
    assert openrlhf_reference.template_date(tokenizer, text, ids[-kept:], kept) is None
    tokenizer.chat_template = None
    assert openrlhf_reference.template_date(tokenizer, text, ids, None) is None
