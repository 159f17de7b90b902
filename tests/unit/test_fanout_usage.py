"""Tally.usage's cached tokens: per prompt the least over its choices (the prompt's hit as
the request first saw it), whichever choice reached a worker first."""

from __future__ import annotations

from services.frontend.fanout import FanJob, Tally, choice_job
from services.frontend.jobs import Chunk, Job
from services.frontend.models import ModelInfo
from services.frontend.openai_schema import parse_completion, split_batch


def _tally(n: int) -> Tally:
    req = parse_completion({"model": "m", "prompt": ["a", "b"], "n": n})
    info = ModelInfo("m", "", 512, 16, 1, 0)
    prompts = [Job("rid", r, info, [1, 2, 3], 0) for r in split_batch(req)]
    choices = [choice_job(j, "b", p * n + c, c) for p, j in enumerate(prompts)
               for c in range(n)]
    return Tally(FanJob("b", req, prompts, choices, 0))


def test_cached_is_the_least_hit_of_each_prompts_choices() -> None:
    tally = _tally(3)
    # prompt 0 cold: choice 1 was scheduled first and computed it, 0 and 2 hit its blocks;
    # prompt 1 warm: every choice hit 32 (one of them 48: blocks another choice computed)
    for index, cached in enumerate([64, 0, 64, 32, 48, 32]):
        tally.see(index, Chunk("", [], "length", 70 if index < 3 else 50, 2, cached))
    assert tally.done and tally.usage() == (120, 12, 0 + 32)


def test_usage_of_what_finished() -> None:
    tally = _tally(2)
    tally.see(1, Chunk("", [], "length", 70, 2, 64))
    assert tally.usage() == (0, 2, 0)  # prompt 0's first choice has not finished
    tally.see(0, Chunk("", [], "length", 70, 3, 0))
    tally.see(2, Chunk("", [], "length", 50, 1, 32))
    assert not tally.done and tally.usage() == (120, 6, 0 + 32)
