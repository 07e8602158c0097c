"""Whether a chat template writes today's date into the prompts (Llama 3.x's, some Mistral ones: transformers'
`strftime_now`, local time), found at a run's start by rendering one prompt as on another date.

TRL and verl render the prompts at each step, while the reference cache is keyed by their token ids as rendered at
start: when the date changes during the run, no prompt is in the cache and the run stops. OpenRLHF renders them once,
at each start (its PromptDataset): a run resumed, or a cache reused, on another day misses them all. `date_dependence`
finds it with one render, so that the trainer can say so before training, and its miss message can name the date."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

DATE_SHIFT = timedelta(days=400)   # another day, month, year and weekday
DATE_STRING_FORMAT = "%d %b %Y"    # Llama 3.x's `date_string` ("26 Jul 2024"), which its template writes as is
CACHE_DAYS = 366                   # how far back `DatedTemplate.load_miss` looks for the day a cache was built


def on_another_date(shift: timedelta = DATE_SHIFT) -> dict:
    """Chat template keyword arguments that render as on the date `shift` from now: transformers' `strftime_now`,
    a global of its template environment, shadowed by a render variable of the same name."""
    return {"strftime_now": (datetime.now() + shift).strftime}


@dataclass(frozen=True)
class DateSettings:
    """Where a trainer's user fixes the date, in its setting names: `kwargs` formats the date_string pair (the chat
    template's keyword arguments; None where the trainer passes the template none: OpenRLHF's preprocess_data),
    `template` names where a chat template goes, `resume_rebuilds`: a resumed run builds a deleted reference cache
    at theta0 (TRL's, from the model as passed), else a resumed run's actor holds a checkpoint and needs the cache of
    its start (verl, OpenRLHF)."""

    kwargs: str | None
    template: str
    resume_rebuilds: bool


@dataclass(frozen=True)
class DatedTemplate:
    """A chat template that writes today's date: `today` (DATE_STRING_FORMAT) and whether `date_string=today`
    renders the prompts as today on any date (Llama 3.x's template reads it); `render` and `rendered`: the prompt it
    was found by, as `date_dependence` took them."""

    today: str
    takes_date_string: bool
    render: Callable[[dict], list[int]] = field(repr=False, compare=False)
    rendered: list[int] = field(repr=False, compare=False)

    def fix(self, settings: DateSettings) -> str:
        """What to do, in the trainer's setting names (`settings`). The date pinned in the chat template's keyword
        arguments renders the prompts the cache holds, so the run starts or resumes with the cache as it is. A
        changed chat template changes the tokenizer's fingerprint, which the cache records (a cache built with
        another template is refused): the cache is then built anew at theta0, which a resumed run can do only where
        the trainer builds it from the model as passed (`settings.resume_rebuilds`)."""
        if self.takes_date_string and settings.kwargs is not None:
            return (f"set {settings.kwargs.format(date_string=repr(self.today))} (the date the cache's prompts hold) "
                    "and start or resume")
        template = (f"a chat template that fixes the date ({{% set date_string = {self.today!r} %}} first) or writes "
                    "none" if self.takes_date_string else "a chat template that writes no date (it does not read "
                    "date_string)")
        rebuild = ("start or resume: the cache is built again from the model as passed" if settings.resume_rebuilds
                   else "start afresh: a resumed run cannot build it again, its actor no longer holds theta0")
        return (f"give {settings.template} {template}, delete the reference cache (it records the chat template, "
                f"and a cache built with another one is refused) and {rebuild}")

    def start_warning(self, trainer: str, settings: DateSettings, *, at_each_step: bool = True) -> str:
        """The one line said before training: what will happen, and the fix. `at_each_step`: the trainer renders
        the prompts at each step (TRL, verl's agent loop), else once at each start (OpenRLHF's PromptDataset)."""
        if at_each_step:
            happens = ("at each step: when the date changes during the run (local time), no prompt is in the reference "
                       "cache, keyed by today's prompts, and the run stops")
        else:
            happens = ("at each start: a run resumed, or a cache reused, on another day (local time) finds none of its "
                       "prompts in the reference cache, keyed by today's prompts, and stops")
        return (f"the chat template writes today's date ({self.today}) into every prompt, which {trainer} renders "
                f"{happens}; {self.fix(settings)}")

    def miss_cause(self, settings: DateSettings) -> str:
        """The clause a prompt missing from the cache mid-run ends with: the date as a possible cause."""
        return (f"Or the date changed since the cache was built: the chat template writes today's date into the "
                f"prompts; {self.fix(settings)}.")

    def load_miss(self, cached: Callable[[list[int]], bool], settings: DateSettings) -> str | None:
        """Why a reference cache read at start lacks the training prompts, when the date is why: None when today's
        prompt is in it (`cached(token_ids)`), else the day within the last CACHE_DAYS on which the prompt renders as
        one the cache holds (the day it was built: a run resumed, or a cache reused, on a later day), said with the
        fix for that day, the whole remedy; None when no day does (something else changed). One render per day
        looked at."""
        if cached(self.rendered):
            return None
        for back in range(1, CACHE_DAYS + 1):
            day = datetime.now() - timedelta(days=back)
            if cached(self.render({"strftime_now": day.strftime})):
                built = replace(self, today=day.strftime(DATE_STRING_FORMAT))
                return (f"(the chat template writes today's date into the prompts, and the cache was built on "
                        f"{built.today}): {built.fix(settings)}.")
        return None


def date_dependence(render: Callable[[dict], list[int]], rendered: list[int]) -> DatedTemplate | None:
    """None when one prompt, `rendered` (its token ids as the trainer rendered it today), renders the same on another
    date; else the DatedTemplate. `render(kwargs)` renders that prompt as the trainer does, with `kwargs` added to
    the chat template's keyword arguments. One render; one more only for a template that writes the date."""
    if render(on_another_date()) == rendered:
        return None
    today = datetime.now().strftime(DATE_STRING_FORMAT)
    return DatedTemplate(today, render({**on_another_date(), "date_string": today}) == rendered, render, rendered)
