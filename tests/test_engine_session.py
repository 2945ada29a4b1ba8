"""The engine session: questions submitted while it runs, a mode per document group in one step,
chunked prefill beside decode, cancellation. The golden rule holds throughout: every answer is
stock's greedy answer (fp32) to the same question, however the work arrived and was batched."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ppqa import Answer, QuestionRequest, SamplingParams
from ppqa.engine.runtime.scheduler import Scheduler
from tests.helpers import (pending_document, plain_template, session_questions, stock_answers,
                           text, tiny_engine)


@pytest.fixture
def spy_steps(monkeypatch):
    """The modes of the requests in every decode step that the scheduler builds."""
    seen: list[tuple[str, ...]] = []
    build = Scheduler.decode_step

    def recording(self, requests, **kw):
        seen.append(tuple(r.mode for r in requests))
        return build(self, requests, **kw)

    monkeypatch.setattr(Scheduler, "decode_step", recording)
    return seen


@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa"])
def test_arrivals_mixed_modes_and_early_finishes_give_stock_tokens(preset, tmp_path: Path,
                                                                  spy_steps) -> None:
    eng = tiny_engine(preset, seed=3)
    tmpl = plain_template(tmp_path)
    rng = random.Random(preset)
    docs = [text(rng, n) for n in (120, 40, 200)]
    batches = [(session_questions(rng, docs[0], 6, tmpl, "a"), "cascade"),
               (session_questions(rng, docs[1], 5, tmpl, "b"), "stock"),
               (session_questions(rng, docs[2], 7, tmpl, "c"), "parallel"),
               (session_questions(rng, docs[0], 3, tmpl, "d"), "stock")]
    expected = stock_answers(eng, [r for batch, _ in batches for r in batch])

    got: dict[object, Answer] = {}
    arrivals: dict[str, int] = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    steps = 0
    for requests, mode in batches:  # each batch arrives two steps after the one before
        session.submit(requests, mode=mode, streams=3 if mode == "parallel" else None)
        arrivals[requests[0].key[0]] = len(got)
        for _ in range(2):
            session.step()
            steps += 1
    session.drain()
    stats = session.close()

    assert set(got) == set(expected)
    for key, answer in expected.items():
        assert got[key].token_ids == answer.token_ids, key
        assert got[key].mode == dict(batches_modes(batches))[key[0]]
    assert arrivals["d"] > 0  # answers came out before the last questions arrived
    assert stats.mode == "mixed" and stats.questions == len(expected)
    # One step held stock and cascade requests together; parallel ran in steps of its own.
    assert any({"stock", "cascade"} <= set(step) for step in spy_steps)
    assert all(set(step) == {"parallel"} for step in spy_steps if "parallel" in step)
    # Finished streams left at once: later steps carried fewer requests than the peak.
    sizes = [len(step) for step in spy_steps]
    assert sizes[-1] < max(sizes)


def batches_modes(batches):
    return [(requests[0].key[0], mode) for requests, mode in batches]


def test_cancel_drops_questions_and_frees_their_place(tmp_path: Path) -> None:
    eng = tiny_engine("tiny-gqa", seed=5)
    tmpl = plain_template(tmp_path)
    rng = random.Random(7)
    doc = text(rng, 150)
    keep = session_questions(rng, doc, 4, tmpl, "keep")
    drop = session_questions(rng, doc, 4, tmpl, "drop")
    for r in drop:
        r.sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = stock_answers(eng, keep)
    free_before = eng.kv_free_tokens

    got: dict[object, Answer] = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    session.submit(keep + drop, mode="cascade")
    session.step()
    session.step()
    def held(tag: str) -> int:
        return sum(1 for r in session.sched.prefilling + session.sched.running
                   for s in r.streams if s.key.key[0] == tag)

    assert held("drop") == 4  # their 40-token answers are far from done
    assert session.cancel(lambda r: r.key[0] == "drop") == 4
    assert held("drop") == 0  # the cancelled requests left at once
    session.drain()
    session.close()
    assert set(got) == set(expected)
    assert all(got[k].token_ids == a.token_ids for k, a in expected.items())
    # Everything but the cached document went back to the pool.
    assert eng.kv_free_tokens == free_before


def test_long_document_prefills_in_chunks_while_others_decode(tmp_path: Path) -> None:
    eng = tiny_engine("tiny-mha", seed=2, max_prefill_tokens=64)
    tmpl = plain_template(tmp_path)
    rng = random.Random(11)
    short, long = text(rng, 30), text(rng, 400)
    first = session_questions(rng, short, 3, tmpl, "s", budget=20)
    second = session_questions(rng, long, 3, tmpl, "l")
    # The same weights in a second engine, so that this one has no document cached yet.
    expected = stock_answers(tiny_engine("tiny-mha", seed=2, max_prefill_tokens=64), first + second)

    got: dict[object, Answer] = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    session.submit(first, mode="stock")
    session.step()  # the short document is in and decoding
    tokens_before = [len(s.output_ids) for r in session.sched.running for s in r.streams]
    session.submit(second, mode="stock")
    chunk_steps = 0
    while any(not r.doc.ready for r in session.sched.prefilling) or session.sched.waiting:
        session.step()
        chunk_steps += 1
    tokens_after = [len(s.output_ids) for r in session.sched.running for s in r.streams
                    if s.key.key[0] == "s"]
    session.drain()
    session.close()
    # The long document (over 400 tokens) needed several bounded chunks of 64 tokens, and the
    # short document's answers kept growing meanwhile.
    assert chunk_steps >= 5
    assert sum(tokens_after) > sum(tokens_before)
    assert all(got[k].token_ids == a.token_ids for k, a in expected.items())


def test_later_chunks_of_a_document_in_one_run_name_its_earlier_slots() -> None:
    # A backend may then read the earlier chunks as one run (TritonBackend._fused_chunk).
    eng = tiny_engine("tiny-gqa", max_prefill_tokens=64)
    session, doc = pending_document(eng, list(range(3, 3 + 150)), mode="stock")
    assert doc.start >= 0  # a fresh pool gives the document one run of slots
    chunks = [session.sched.document_chunk(doc) for _ in range(3)]
    assert [c.num_tokens for c in chunks] == [64, 64, 22] and doc.ready
    assert chunks[0].plain_causal and chunks[0].doc_prior is None
    assert [c.doc_prior for c in chunks[1:]] == [(doc.start, 64), (doc.start, 128)]
    assert not any(c.plain_causal for c in chunks[1:])
    _, meta = eng.parts.runner.prepare(chunks[2])
    assert meta.doc_prior == (doc.start, 128)
    session.close()


def test_one_bad_group_fails_alone(tmp_path: Path) -> None:
    eng = tiny_engine("tiny-gqa")
    tmpl = plain_template(tmp_path)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% block prefix %}{% include 'x' %}{% endblock %}"
                      "{% block question %}{{ question }}{% endblock %}", encoding="utf-8")
    rng = random.Random(1)
    good = session_questions(rng, text(rng, 50), 2, tmpl, "good")
    bad = session_questions(rng, text(rng, 50), 2, str(broken), "bad")
    # SamplingParams refuses such a seed; one that got past it (set by hand) fails alone too.
    beyond = SamplingParams(max_new_tokens=2, seed=0)
    object.__setattr__(beyond, "seed", 2**70)
    huge_seed = [QuestionRequest(("seed", 0), good[0].document, "Why?", beyond, tmpl)]
    got, errors = {}, {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a),
                          on_error=lambda r, e: errors.__setitem__(r.key, e))
    assert session.submit(bad + good + huge_seed) == 2
    session.drain()
    session.close()
    assert set(got) == {r.key for r in good}
    assert set(errors) == {r.key for r in bad} | {("seed", 0)}
    assert "seed" in str(errors[("seed", 0)])


def test_auto_joins_a_document_that_cascade_already_decodes(tmp_path: Path) -> None:
    """A worker may claim one document's jobs over several claims: auto puts the later
    questions into the cascade group that already reads the document (one read a step for
    all), whatever the cost model would say of the few alone; a document without a live
    cascade group is left to the cost model. Tokens stay stock's (fp32)."""
    eng = tiny_engine("tiny-gqa", seed=5)
    tmpl = plain_template(tmp_path)
    rng = random.Random(11)
    doc, other = text(rng, 150), text(rng, 60)
    first = session_questions(rng, doc, 4, tmpl, "first", budget=12)
    later = session_questions(rng, doc, 1, tmpl, "later")
    alone = session_questions(rng, other, 1, tmpl, "alone")
    expected = stock_answers(eng, first + later + alone)
    got: dict[object, Answer] = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    session.submit(first, mode="cascade")
    session.step()
    session.step()  # the first questions are decoding by cascade
    assert session.sched.cascade_on(session.sched.running[0].doc_key)
    session.submit(later, mode="auto")
    session.submit(alone, mode="auto")
    session.drain()
    session.close()
    assert got[later[0].key].mode == "cascade"
    assert got[alone[0].key].mode != "cascade"  # on the CPU auto weighs stock and parallel
    for key, answer in expected.items():
        assert got[key].token_ids == answer.token_ids, key


def test_time_charged_to_answers_fits_in_the_session(tmp_path: Path) -> None:
    """Prefill chunks and a scoring prefill run while a decode step is in flight: the answers'
    prefill and decode seconds are each charged once, so together they never exceed the
    session's wall time."""
    import time

    eng = tiny_engine("tiny-mha", seed=2, max_prefill_tokens=64)
    tmpl = plain_template(tmp_path)
    rng = random.Random(5)
    got: dict[object, Answer] = {}
    began = time.perf_counter()
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    session.submit(session_questions(rng, text(rng, 30), 4, tmpl, "s", budget=40), mode="stock")
    session.step()
    session.submit(session_questions(rng, text(rng, 1500), 2, tmpl, "l", budget=2), mode="stock")
    session.step()
    # Questions with choices, scored in one prefill while the first ones still decode.
    session.submit([QuestionRequest(("c", i), text(rng, 400), text(rng, 6), template=tmpl,
                                    choices=("yes", "no", "not stated"))
                    for i in range(3)], mode="stock")
    session.drain()
    session.close()
    wall = time.perf_counter() - began
    charged = sum(a.prefill_s + a.decode_s for a in got.values())
    assert len(got) == 9 and all(a.decode_s > 0 for k, a in got.items() if k[0] != "c")
    assert all(a.prefill_s > 0 for k, a in got.items() if k[0] == "c")
    assert 0 < charged <= wall
