"""The engine session's rows and room: a document's cascade group waits for a quarter of the
rows, a large group goes past them where the pool holds it, small batches with groups waiting,
documents kept in one run in a full pool, and a batch ending on its budgets giving its place
before its last step is read. Every answer is stock's greedy answer (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ppqa import Answer, QuestionRequest, SamplingParams
from ppqa.engine.runtime.scheduler import Scheduler
from tests.helpers import plain_template, session_questions, stock_answers, text, tiny_engine


def test_a_new_documents_cascade_group_waits_for_room(tmp_path: Path, monkeypatch) -> None:
    """With the batch nearly full of one document's cascade requests, a second document's
    group does not start on the first row that frees (it would read its whole document every
    step for one query): it starts when a quarter of the rows are free, and its questions
    then join the steps of the first document's; tokens stay stock's (fp32). (No step past the
    8 rows here: the widening is tested on its own below.)"""
    eng = tiny_engine("tiny-gqa", seed=4, max_batch_requests=8, max_wide_requests=8)
    tmpl = plain_template(tmp_path)
    rng = random.Random(3)
    first = session_questions(rng, text(rng, 120), 8, tmpl, "first", budget=12)
    first[0].sampling = SamplingParams(max_new_tokens=2, ignore_eos=True)
    first[1].sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    second = session_questions(rng, text(rng, 90), 5, tmpl, "second", budget=4)
    expected = stock_answers(eng, first + second)

    steps: list[tuple[int, int]] = []  # (requests of "first", of "second") in each decode step
    build = Scheduler.decode_step

    def recording(self, requests, **kw):
        tags = [r.streams[0].key.key[0] for r in requests]
        steps.append((tags.count("first"), tags.count("second")))
        return build(self, requests, **kw)

    monkeypatch.setattr(Scheduler, "decode_step", recording)
    got: dict[object, Answer] = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    session.submit(first, mode="cascade")
    session.submit(second, mode="cascade")
    session.drain()
    session.close()

    for key, answer in expected.items():
        assert got[key].token_ids == answer.token_ids, key
    joined = next(i for i, (_, b) in enumerate(steps) if b)
    # One row was free from the third step on; the second group waited for two (8 // 4).
    assert any(a == 7 and b == 0 for a, b in steps[:joined])
    assert steps[joined][0] == 6
    assert max(a + b for a, b in steps) == 8


@pytest.mark.parametrize("budget,wide,prefill", [(4000, True, None), (4000, True, 40),
                                                 (350, False, None)])
def test_a_large_group_starts_past_the_batch_rows_where_the_pool_holds_it(
        tmp_path: Path, monkeypatch, budget, wide, prefill) -> None:
    """Two documents of 4 cascade questions with rows for 4: the second group is half of the
    rows or more, so where the pool holds it beside the first it starts at once, past the 4
    rows (both decode in steps of 8), also when the prefill budget admits it over several
    calls (40 tokens); where the pool does not hold it, it waits for the first to leave. A
    group of one question never goes past the rows. Tokens stay stock's (fp32) either way."""
    eng = tiny_engine("tiny-gqa", seed=7, max_batch_requests=4, kv_token_budget=budget,
                      max_prefill_tokens=prefill)
    assert eng.config.wide_requests == 8
    tmpl = plain_template(tmp_path)
    rng = random.Random(7)
    first = session_questions(rng, text(rng, 120), 4, tmpl, "a", budget=8)
    second = session_questions(rng, text(rng, 110), 4, tmpl, "b", budget=8)
    single = session_questions(rng, text(rng, 100), 1, tmpl, "c", budget=8)
    expected = stock_answers(eng, first + second + single)

    steps: list[tuple[int, int, int]] = []  # requests of "a", "b" and "c" in each decode step
    build = Scheduler.decode_step

    def recording(self, requests, **kw):
        tags = [r.streams[0].key.key[0] for r in requests]
        steps.append((tags.count("a"), tags.count("b"), tags.count("c")))
        return build(self, requests, **kw)

    monkeypatch.setattr(Scheduler, "decode_step", recording)
    got: dict[object, Answer] = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    for group in (first, second, single):
        session.submit(group, mode="cascade")
    session.drain()
    session.close()

    assert set(got) == set(expected)
    for key, answer in expected.items():
        assert got[key].token_ids == answer.token_ids, key
    assert (max(a + b for a, b, _ in steps) == 8) == wide
    assert all(a + b + c <= 8 for a, b, c in steps)
    assert all(a + b + c <= 4 for a, b, c in steps if c)  # a group of one stays within them
    if not wide:
        assert not any(a and b for a, b, _ in steps)  # the second waited for the first


@pytest.mark.parametrize("max_batch", [8, 12])
def test_small_batches_with_waiting_groups_finish_every_question(tmp_path: Path, max_batch) -> None:
    """Groups of every mode arriving while a batch of a few rows is full: cascade groups of new
    documents wait for room, the others queue behind them in order, and every question is
    still answered with stock's tokens (fp32): the admission rule never leaves work stranded."""
    eng = tiny_engine("tiny-mha", seed=6, max_batch_requests=max_batch,
                      max_wide_requests=max_batch)
    tmpl = plain_template(tmp_path)
    rng = random.Random(max_batch)
    docs = [text(rng, n) for n in (90, 60, 120, 40)]
    arrivals = [(session_questions(rng, docs[0], 7, tmpl, "a", budget=12), "cascade"),
                (session_questions(rng, docs[1], 3, tmpl, "b", budget=8), "stock"),
                (session_questions(rng, docs[2], 9, tmpl, "c"), "cascade"),
                (session_questions(rng, docs[0], 3, tmpl, "d"), "cascade"),
                (session_questions(rng, docs[3], 3, tmpl, "e"), "parallel")]
    expected = stock_answers(eng, [r for batch, _ in arrivals for r in batch])
    waited = []
    room = Scheduler._room_for_group

    def recording(self, doc_key, free_rows):
        fits = room(self, doc_key, free_rows)
        waited.append(not fits)
        return fits

    got: dict[object, Answer] = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    session.sched._room_for_group = recording.__get__(session.sched)
    for requests, mode in arrivals:
        session.submit(requests, mode=mode, streams=2 if mode == "parallel" else None)
        session.step()
        assert session.active_requests <= max_batch
    session.drain()
    stats = session.close()
    assert any(waited)  # a new document's group did wait for room
    assert set(got) == set(expected) and stats.questions == len(expected)
    for key, answer in expected.items():
        assert got[key].token_ids == answer.token_ids, key


def test_a_question_prefill_beside_decode_is_read_in_the_next_iteration(tmp_path: Path) -> None:
    """Questions prefilled while others decode: their prefill is launched, then the decode step
    of the requests already running (without them); their first tokens are read back only in
    the next iteration, after that iteration's decode step is queued (the device has run the
    prefill by then, and the host went on meanwhile), and they decode from the step after.
    An iteration count, not the device's progress, decides, so the same work makes the same
    steps. Tokens stay stock's (fp32)."""
    eng = tiny_engine("tiny-gqa", seed=4)
    tmpl = plain_template(tmp_path)
    rng = random.Random(11)
    first = session_questions(rng, text(rng, 80), 3, tmpl, "a", budget=12)
    late = session_questions(rng, text(rng, 50), 2, tmpl, "b", budget=4)
    expected = stock_answers(eng, first + late)
    got: dict[object, Answer] = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    events: list[tuple] = []
    launch, settle = session._launch, session._settle_prefill

    def logged_launch(step, prev):
        events.append((step.inputs.kind if prev is None else "decode",
                       frozenset(s.key.key[0] for r in step.requests if r.row >= 0
                                 for s in r.streams)))
        return launch(step, prev)

    def logged_settle(earlier_only=False):
        before = len(session._unsettled)
        settle(earlier_only)
        if len(session._unsettled) < before:
            events.append(("read", frozenset()))

    session._launch, session._settle_prefill = logged_launch, logged_settle
    session.submit(first, mode="stock")
    for _ in range(3):
        session.step()
    assert session.sched.running and not session.sched.waiting
    events.clear()
    session.submit(late, mode="stock")
    for _ in range(3):
        session.step()
    kinds = [k for k, _ in events]
    prefill = kinds.index("extend")
    assert "b" in events[prefill][1] and "a" not in events[prefill][1]
    # this iteration's decode step (the running requests alone), the next one's, then the
    # prefill's read back, then a decode step holding the late questions too
    assert kinds[prefill + 1:prefill + 5] == ["decode", "decode", "read", "decode"]
    assert events[prefill + 1][1] == events[prefill + 2][1] == {"a"}
    assert events[prefill + 4][1] == {"a", "b"}
    session.drain()
    session.close()
    assert set(got) == set(expected)
    for key, answer in expected.items():
        assert got[key].token_ids == answer.token_ids, key


def test_documents_stay_one_run_through_a_long_session_of_a_full_pool(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """Many documents through one session whose KV pool holds about ten at a time: requests'
    own slots come from the far end and a new document evicts for a run, so every document is
    one run of slots (read at affine addresses; first fit alone gathered 7 of these 24), and
    the answers stay stock's."""
    from ppqa.engine.runtime.document_cache import DocumentCache

    starts: list[int] = []
    insert = DocumentCache.insert

    def recorded(self, token_ids, key=None):
        doc = insert(self, token_ids, key)
        if doc is not None:
            starts.append(doc.start)
        return doc

    monkeypatch.setattr(DocumentCache, "insert", recorded)
    rng = random.Random(7)
    tmpl = plain_template(tmp_path)
    eng = tiny_engine(kv_token_budget=4000, max_batch_requests=12)
    requests = []
    for d in range(24):
        doc = text(rng, rng.randint(150, 450))
        requests += session_questions(rng, doc, rng.randint(1, 5), tmpl, f"d{d}")
    got: dict = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    for k in range(0, len(requests), 4):  # questions arrive while others decode
        session.submit(requests[k:k + 4], mode="cascade")
        session.step()
    session.drain()
    session.close()
    assert len(starts) >= 24 and all(s >= 0 for s in starts), starts
    reference = stock_answers(tiny_engine(), requests)
    assert {k: a.token_ids for k, a in got.items()} == \
        {k: a.token_ids for k, a in reference.items()}


@pytest.mark.parametrize("mode,max_batch,streams", [("stock", 4, None), ("cascade", 4, None),
                                                    ("parallel", 1, 4)])
def test_a_batch_ending_on_its_budgets_gives_its_place_before_its_last_step_is_read(
        tmp_path: Path, mode, max_batch, streams) -> None:
    """A full batch whose answers all end at one step (their token budgets): the requests
    waiting for its rows are admitted, and their document prefilled, while that last step is
    still in flight, and its answers are delivered after (read while the device prefills the
    next ones). Tokens stay stock's (fp32)."""
    eng = tiny_engine("tiny-mha", seed=5, max_batch_requests=max_batch,
                      max_wide_requests=max_batch)
    tmpl = plain_template(tmp_path)
    rng = random.Random(mode)
    first = session_questions(rng, text(rng, 70), 4, tmpl, "a", budget=6)
    later = session_questions(rng, text(rng, 90), 4, tmpl, "b", budget=5)
    expected = stock_answers(eng, first + later)
    events: list[tuple[str, str]] = []
    got: dict[object, Answer] = {}

    def on_answer(request: QuestionRequest, answer: Answer) -> None:
        got[request.key] = answer
        events.append(("answer", request.key[0]))

    session = eng.session(on_answer=on_answer)
    admit = session.sched.admit

    def logged_admit():
        admitted = admit()
        events.extend(("admit", r.streams[0].key.key[0]) for r in admitted)
        return admitted

    session.sched.admit = logged_admit
    session.submit(first, mode=mode, streams=streams)
    session.submit(later, mode=mode, streams=streams)
    session.drain()
    stats = session.close()
    assert stats.left_early == (1 if streams else 4)
    assert events.index(("admit", "b")) < events.index(("answer", "a"))
    assert not session.sched.leaving
    assert set(got) == set(expected)
    for key, answer in expected.items():
        assert got[key].token_ids == answer.token_ids, key
