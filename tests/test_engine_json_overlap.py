"""JSON answers under the step in flight (`EngineConfig.overlap_steps`): a constrained step's
forward is launched before the step in flight is read back, its masks filled after the matchers
consumed that step's tokens (engine/session.py `_launch`).

The answers must not change: greedy (fp32) constrained and free questions side by side, under
two schemas of different lengths and free budgets of 1 to 24 tokens (streams finish at
different steps), on the byte tokenizer and on SmolLM2's BPE vocabulary, in stock, cascade and
parallel and in one session that holds all three, equal a run that reads every step back
before the next; every constrained answer completes and validates. The overlap must really
happen for constrained steps (counted in `RunStats.overlapped_steps`), and a stream that the
step in flight finished gets no mask in the step behind it. A schema's streams are spread over
lanes (compiled copies, so that the masks fill in parallel): every row's mask is the one its
stream's matcher gives alone, whichever lane it copies and wherever its row is.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch

from ppqa import QuestionRequest, SamplingParams
from ppqa.engine.runtime.grammar import Grammars, GrammarRows
from ppqa.engine.runtime.request import Stream
from ppqa.json_schema import schema_text
from tests.helpers import (BOUNDED_SCHEMA, answers_by_key, assert_pool_holds_only_cached_documents,
                           plain_template, text, tiny_engine)

LONG = BOUNDED_SCHEMA  # bounded in every field: random answers close within the budget
SHORT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": False}
SCHEMAS = {"long": LONG, "short": SHORT}
BUDGET = 128
MODES = {"stock": None, "cascade": None, "parallel": 3}


def _workload(rng: random.Random, tmpl: str) -> list[QuestionRequest]:
    """Three documents of eight questions: constrained (both schemas) and free (budgets 1-24)."""
    requests = []
    for d, chars in enumerate((150, 60, 100)):
        doc = text(rng, chars)
        for q in range(8):
            if q % 2:
                name = "long" if q % 4 == 1 else "short"
                sampling = SamplingParams(max_new_tokens=BUDGET,
                                          json_schema=schema_text(SCHEMAS[name]))
            else:
                sampling = SamplingParams(max_new_tokens=rng.randint(1, 24))
            requests.append(QuestionRequest((d, q), doc, text(rng, rng.randint(3, 15)),
                                            sampling, tmpl))
    return requests


def _one_session(eng, requests: list[QuestionRequest]) -> dict:
    """The three documents in one session, one mode each (stock, cascade, parallel): stock and
    cascade requests share decode steps, parallel ones take steps of their own beside them."""
    got = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    for d, mode in enumerate(MODES):
        session.submit([r for r in requests if r.key[0] == d], mode=mode, streams=MODES[mode])
    session.drain()
    session.flush()
    session.close()
    assert len(got) == len(requests)
    return {k: (a.token_ids, a.finish_reason, a.text) for k, a in got.items()}


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-gqa+bpe"])
def test_json_answers_are_the_same_with_and_without_the_step_in_flight(
        preset: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if preset.endswith("+bpe"):
        request.getfixturevalue("smollm2")  # SmolLM2's tokenizer, linked into PPQA_HOME
    tmpl = plain_template(tmp_path) if preset == "tiny-gqa" else "qa"
    requests = _workload(random.Random(preset), tmpl)
    engines = {overlap: tiny_engine(preset, overlap_steps=overlap) for overlap in (True, False)}
    reference = answers_by_key(engines[False], requests, mode="stock")
    runs = {}
    for overlap, eng in engines.items():
        for mode, streams in MODES.items():
            runs[overlap, mode] = answers_by_key(eng, requests, mode=mode, streams=streams)
        runs[overlap, "one session"] = _one_session(eng, requests)
    for key, run in runs.items():
        assert run == reference, key
    assert_pool_holds_only_cached_documents(engines[True])

    lengths = set()
    for r in requests:
        ids, reason, answer = reference[r.key]
        if r.sampling.json_schema is None:
            assert reason == "length"  # the random model's free answers run to their budgets
            continue
        assert reason == "stop"  # the grammar completed, well inside the budget
        jsonschema.validate(json.loads(answer), json.loads(r.sampling.json_schema))
        lengths.add(len(ids))
    assert len(lengths) > 3, lengths  # constrained streams finish at different steps


@pytest.mark.parametrize("mode", list(MODES))
def test_constrained_steps_are_launched_before_the_step_in_flight_is_read(
        mode: str, tmp_path: Path) -> None:
    tmpl = plain_template(tmp_path)
    rng = random.Random(mode)
    doc = text(rng, 80)
    requests = [QuestionRequest(q, doc, text(rng, rng.randint(3, 15)), SamplingParams(
        max_new_tokens=BUDGET, json_schema=schema_text(LONG)), tmpl) for q in range(6)]
    counts = {}
    for overlap in (True, False):
        answers = {}
        stats = tiny_engine(overlap_steps=overlap).run(
            requests, mode=mode, streams=MODES[mode],
            on_answer=lambda r, a: answers.__setitem__(r.key, a))
        counts[overlap] = stats.overlapped_steps
        longest = max(len(a.token_ids) for a in answers.values())
    # Token 1 comes from the question prefill, tokens 2..n from decode steps: every decode
    # step but the first is launched behind the one before it.
    assert counts[True] >= longest - 2 > 0
    assert counts[False] == 0


def test_masks_fill_while_the_next_step_is_built(tmp_path: Path, monkeypatch) -> None:
    """A constrained step behind the step in flight fills its masks on another thread while
    the main thread builds the next step: each fill waits (a bounded while) for a step to be
    built after it began, and only a fill with no step after it (the last) waits in vain."""
    import threading

    from ppqa.engine.runtime.scheduler import Scheduler

    from ppqa.engine import session

    built, main = threading.Event(), threading.get_ident()
    fills: list[tuple[bool, bool]] = []  # (off the main thread, a step was built meanwhile)
    fill, build, later = GrammarRows.bitmask, Scheduler.decode_step, session.fill_later

    def watched_later(*args, **kw):
        built.clear()  # on the main thread, before the fill is handed over
        return later(*args, **kw)

    def watched_fill(self, *args, **kw):
        off_main = threading.get_ident() != main
        fills.append((off_main, off_main and built.wait(timeout=2.0)))
        return fill(self, *args, **kw)

    def watched_build(self, *args, **kw):
        step = build(self, *args, **kw)
        built.set()
        return step

    monkeypatch.setattr(session, "fill_later", watched_later)
    monkeypatch.setattr(GrammarRows, "bitmask", watched_fill)
    monkeypatch.setattr(Scheduler, "decode_step", watched_build)
    tmpl = plain_template(tmp_path)
    rng = random.Random(9)
    doc = text(rng, 80)
    requests = [QuestionRequest(q, doc, text(rng, rng.randint(3, 15)), SamplingParams(
        max_new_tokens=BUDGET, json_schema=schema_text(LONG)), tmpl) for q in range(4)]
    answers = {}
    tiny_engine().run(requests, mode="stock", on_answer=lambda r, a: answers.__setitem__(r.key, a))
    for answer in answers.values():
        jsonschema.validate(json.loads(answer.text), LONG)
    behind = [f for f in fills if f[0]]  # the first decode step fills on the main thread
    assert len(behind) >= 5
    assert sum(overlapped for _, overlapped in behind) >= len(behind) - 1


def test_a_stream_finished_in_flight_gets_no_mask(tmp_path: Path) -> None:
    eng = tiny_engine()
    vocab = eng.model_config.vocab_size
    schema = schema_text(LONG)
    sampling = SamplingParams(max_new_tokens=BUDGET, json_schema=schema)
    streams = [Stream(key=i, suffix_ids=[1], sampling=sampling, seed=0, prompt_tokens=2,
                      matcher=eng.grammars.matcher(schema)) for i in range(3)]
    rows = GrammarRows(streams, [0, 2, 3])
    every = rows.bitmask(4, vocab)
    assert every[1].eq(-1).all()  # no stream there: everything allowed
    assert not every[0].eq(-1).all()  # '{' only, at the start of the object
    streams[1].finish_reason = "stop"  # the step in flight ended it
    streams[2].cancelled = True
    some = rows.bitmask(4, vocab)
    assert torch.equal(some[0], every[0])
    assert some[1:].eq(-1).all()
    streams[0].finish_reason = "stop"
    assert rows.bitmask(4, vocab) is None  # nothing to mask: no bitmask built


def test_masks_are_the_same_on_every_lane_and_in_any_row_order() -> None:
    eng = tiny_engine()
    vocab = eng.model_config.vocab_size
    grammars = Grammars(eng.tokenizer, vocab)
    grammars.lanes = 3
    schema = schema_text(LONG)
    sampling = SamplingParams(max_new_tokens=BUDGET, json_schema=schema)
    prefixes = ['{"label": "', '{"label": "no", "score": ', '{"label": "yes", "score": 1',
                '{', '{"label": "unsure", "score": 10, "ok": true, "note": "ab', '{"label": "',
                '{"label": "no", "score": 3, "ok": ']
    streams = []
    for i, prefix in enumerate(prefixes):
        state = grammars.matcher(schema)
        for byte in prefix.encode():
            assert state.matcher.consume_token(byte)
        streams.append(Stream(key=i, suffix_ids=[1], sampling=sampling, seed=0, prompt_tokens=2,
                              matcher=state))
    assert [s.matcher.lane for s in streams] == [0, 1, 2, 0, 1, 2, 0]
    rows = [5, 0, 3, 6, 1, 4, 2]  # not in lane order
    together = GrammarRows(streams, rows).bitmask(7, vocab)
    for stream, row in zip(streams, rows):
        assert torch.equal(together[row], GrammarRows([stream], [0]).bitmask(1, vocab)[0])
    assert torch.equal(together[5], together[4])  # streams 0 and 5: one state, lanes 0 and 2
    assert not torch.equal(together[5], together[6])  # stream 3, after '{' only
