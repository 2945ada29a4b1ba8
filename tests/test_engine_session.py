"""The engine session: questions submitted while it runs, a mode per document group in one step,
chunked prefill beside decode, cancellation. The golden rule holds throughout: every answer is
stock's greedy answer (fp32) to the same question, however the work arrived and was batched."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ppqa import Answer, QuestionRequest, SamplingParams
from ppqa.engine.runtime.scheduler import Scheduler
from tests.helpers import pending_document, plain_template, text, tiny_engine


def _requests(rng: random.Random, doc: str, count: int, tmpl: str, tag: str,
              budget: int | None = None) -> list[QuestionRequest]:
    """`count` questions about `doc`, each with `budget` answer tokens (default: 1-10 drawn)."""
    return [QuestionRequest((tag, i), doc, text(rng, rng.randint(3, 25)),
                            SamplingParams(max_new_tokens=budget or rng.randint(1, 10),
                                           ignore_eos=True),
                            tmpl) for i in range(count)]


def _reference(eng, requests: list[QuestionRequest]) -> dict:
    """Stock's answers, one document at a time in a plain run."""
    out: dict = {}
    for doc in dict.fromkeys(r.document for r in requests):
        group = [r for r in requests if r.document == doc]
        eng.run(group, mode="stock", on_answer=lambda r, a: out.__setitem__(r.key, a))
    return out


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
    batches = [(_requests(rng, docs[0], 6, tmpl, "a"), "cascade"),
               (_requests(rng, docs[1], 5, tmpl, "b"), "stock"),
               (_requests(rng, docs[2], 7, tmpl, "c"), "parallel"),
               (_requests(rng, docs[0], 3, tmpl, "d"), "stock")]
    expected = _reference(eng, [r for batch, _ in batches for r in batch])

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
    keep = _requests(rng, doc, 4, tmpl, "keep")
    drop = _requests(rng, doc, 4, tmpl, "drop")
    for r in drop:
        r.sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = _reference(eng, keep)
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
    first = _requests(rng, short, 3, tmpl, "s", budget=20)
    second = _requests(rng, long, 3, tmpl, "l")
    # The same weights in a second engine, so that this one has no document cached yet.
    expected = _reference(tiny_engine("tiny-mha", seed=2, max_prefill_tokens=64), first + second)

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
    good = _requests(rng, text(rng, 50), 2, tmpl, "good")
    bad = _requests(rng, text(rng, 50), 2, str(broken), "bad")
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
    first = _requests(rng, doc, 4, tmpl, "first", budget=12)
    later = _requests(rng, doc, 1, tmpl, "later")
    alone = _requests(rng, other, 1, tmpl, "alone")
    expected = _reference(eng, first + later + alone)
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
    session.submit(_requests(rng, text(rng, 30), 4, tmpl, "s", budget=40), mode="stock")
    session.step()
    session.submit(_requests(rng, text(rng, 1500), 2, tmpl, "l", budget=2), mode="stock")
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


def test_a_new_documents_cascade_group_waits_for_room(tmp_path: Path, monkeypatch) -> None:
    """With the batch nearly full of one document's cascade requests, a second document's
    group does not start on the first row that frees (it would read its whole document every
    step for one query): it starts when a quarter of the rows are free, and its questions
    then join the steps of the first document's; tokens stay stock's (fp32). (No step past the
    8 rows here: the widening is tested on its own below.)"""
    eng = tiny_engine("tiny-gqa", seed=4, max_batch_requests=8, max_wide_requests=8)
    tmpl = plain_template(tmp_path)
    rng = random.Random(3)
    first = _requests(rng, text(rng, 120), 8, tmpl, "first", budget=12)
    first[0].sampling = SamplingParams(max_new_tokens=2, ignore_eos=True)
    first[1].sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    second = _requests(rng, text(rng, 90), 5, tmpl, "second", budget=4)
    expected = _reference(eng, first + second)

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
    first = _requests(rng, text(rng, 120), 4, tmpl, "a", budget=8)
    second = _requests(rng, text(rng, 110), 4, tmpl, "b", budget=8)
    single = _requests(rng, text(rng, 100), 1, tmpl, "c", budget=8)
    expected = _reference(eng, first + second + single)

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
    arrivals = [(_requests(rng, docs[0], 7, tmpl, "a", budget=12), "cascade"),
                (_requests(rng, docs[1], 3, tmpl, "b", budget=8), "stock"),
                (_requests(rng, docs[2], 9, tmpl, "c"), "cascade"),
                (_requests(rng, docs[0], 3, tmpl, "d"), "cascade"),
                (_requests(rng, docs[3], 3, tmpl, "e"), "parallel")]
    expected = _reference(eng, [r for batch, _ in arrivals for r in batch])
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
    first = _requests(rng, text(rng, 80), 3, tmpl, "a", budget=12)
    late = _requests(rng, text(rng, 50), 2, tmpl, "b", budget=4)
    expected = _reference(eng, first + late)
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
        requests += _requests(rng, doc, rng.randint(1, 5), tmpl, f"d{d}")
    got: dict = {}
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    for k in range(0, len(requests), 4):  # questions arrive while others decode
        session.submit(requests[k:k + 4], mode="cascade")
        session.step()
    session.drain()
    session.close()
    assert len(starts) >= 24 and all(s >= 0 for s in starts), starts
    reference = _reference(tiny_engine(), requests)
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
    first = _requests(rng, text(rng, 70), 4, tmpl, "a", budget=6)
    later = _requests(rng, text(rng, 90), 4, tmpl, "b", budget=5)
    expected = _reference(eng, first + later)
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

