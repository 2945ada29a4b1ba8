"""Background submits (`EngineSession.submit(background=True)`, the worker's claims): the
prompts are rendered at once and tokenized on the session's tokenizer thread while steps run.
The questions give the same answers as when submitted at once (fp32), join in submit order,
count as queued work before their tokens are ready, and can be cancelled or rejected alone."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from ppqa import Engine, EngineConfig, QuestionRequest, SamplingParams
from tests.helpers import plain_template, text


@pytest.fixture(scope="module")
def bpe_engine():
    """A tiny model with the `tokenizers`-library BPE tokenizer (it tokenizes off the GIL)."""
    return Engine("dummy:tiny-gqa+bpe", device="cpu", config=EngineConfig(seed=5))


def _requests(rng: random.Random, doc: str, count: int, tmpl: str, tag: str,
              **sampling) -> list[QuestionRequest]:
    return [QuestionRequest((tag, i), doc, text(rng, rng.randint(5, 40)),
                            SamplingParams(max_new_tokens=rng.randint(1, 8), ignore_eos=True,
                                           **sampling), tmpl)
            for i in range(count)]


def _drain(session) -> None:
    while session.has_work():
        session.step()


def test_background_submits_tokenize_on_a_thread_and_answer_as_at_once(
        bpe_engine, tmp_path: Path, monkeypatch) -> None:
    assert bpe_engine.tokenizer.tokenizes_off_thread
    tmpl = plain_template(tmp_path)
    rng = random.Random(11)
    docs = [text(rng, n) for n in (900, 300, 1500)]
    batches = [_requests(rng, doc, 5, tmpl, tag) for doc, tag in zip(docs, "abc")]
    batches.append(_requests(rng, docs[0], 3, tmpl, "d"))  # a document already in the session

    expected: dict = {}
    at_once = bpe_engine.session(on_answer=lambda r, a: expected.__setitem__(r.key, a))
    for batch in batches:
        at_once.submit(batch, mode="auto")
    _drain(at_once)
    at_once.close()

    threads = []
    encode_many = bpe_engine.tokenizer.encode_many
    monkeypatch.setattr(bpe_engine.tokenizer, "encode_many",
                        lambda texts: threads.append(threading.get_ident()) or encode_many(texts))
    got: dict = {}
    session = bpe_engine.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    session.submit(batches[0], mode="auto", background=True)
    assert session.has_work() and session.queued_requests == len(batches[0])
    assert session.open_questions == len(batches[0])
    for batch in batches[1:]:  # arriving while the first ones run
        session.step()
        session.submit(batch, mode="auto", background=True)
    _drain(session)
    session.close()
    assert threads and threading.get_ident() not in threads
    assert set(got) == set(expected)
    for key, answer in expected.items():
        assert got[key].token_ids == answer.token_ids, key


def test_background_submits_queue_before_a_later_submit_at_once(bpe_engine, tmp_path: Path) -> None:
    tmpl = plain_template(tmp_path)
    rng = random.Random(12)
    first = _requests(rng, text(rng, 600), 4, tmpl, "first")
    second = _requests(rng, text(rng, 400), 3, tmpl, "second")
    session = bpe_engine.session()
    session.submit(first, mode="stock", background=True)
    session.submit(second, mode="stock")  # waits for the tokenizer thread, then queues
    waiting = [s.key.key for r in session.sched.waiting for s in r.streams]
    assert waiting == [r.key for r in first + second]
    session.close()


def test_background_rejections_and_cancels_reach_only_their_questions(
        bpe_engine, tmp_path: Path) -> None:
    tmpl = plain_template(tmp_path)
    rng = random.Random(13)
    doc = text(rng, 700)
    good = _requests(rng, doc, 4, tmpl, "good")
    bad_seed = QuestionRequest(("bad", 0), doc, "what?",
                               SamplingParams(max_new_tokens=3, seed=1 << 63), tmpl)
    bad_template = QuestionRequest(("bad", 1), text(rng, 300), "why?",
                                   SamplingParams(max_new_tokens=3), str(tmp_path / "none.jinja"))
    doomed = _requests(rng, text(rng, 500), 3, tmpl, "doomed")
    answers: dict = {}
    errors: dict = {}
    session = bpe_engine.session(on_answer=lambda r, a: answers.__setitem__(r.key, a),
                                 on_error=lambda r, e: errors.__setitem__(r.key, e))
    taken = session.submit([*good, bad_seed, bad_template], mode="auto", background=True)
    assert taken == len(good) + 1 and set(errors) == {("bad", 1)}  # the template, at once
    session.submit(doomed, mode="auto", background=True)
    assert session.cancel(lambda r: r.key[0] == "doomed") == len(doomed)
    _drain(session)
    session.close()
    assert set(errors) == {("bad", 0), ("bad", 1)}
    assert isinstance(errors[("bad", 0)], ValueError)
    assert set(answers) == {r.key for r in good}


def _step_log(session) -> list[frozenset]:
    """The question keys of every decode step the session's scheduler builds, in order."""
    log: list[frozenset] = []
    build = session.sched.decode_step

    def logged(requests, **kw):
        log.append(frozenset(s.key.key for r in requests if r.row >= 0 for s in r.streams))
        return build(requests, **kw)

    session.sched.decode_step = logged
    return log


def test_background_questions_join_after_a_count_of_iterations_whatever_the_thread_takes(
        bpe_engine, tmp_path: Path, monkeypatch) -> None:
    """A busy session queues a background submit once `tokenize_ahead_iterations` steps have
    run since it (at the start of the next), waiting for its tokens then if need be: how long
    the tokenizer thread takes changes no step, so the same work in the same order decodes
    in the same batches (bf16 answers depend on them)."""
    tmpl = plain_template(tmp_path)
    rng = random.Random(14)
    running = [QuestionRequest(r.key, r.document, r.question,
                               SamplingParams(max_new_tokens=40, ignore_eos=True), r.template)
               for r in _requests(rng, text(rng, 800), 4, tmpl, "run")]
    late = _requests(rng, text(rng, 1200), 3, tmpl, "late")
    encode_many = bpe_engine.tokenizer.encode_many

    def run(delay: float) -> tuple[list[frozenset], int]:
        import time

        monkeypatch.setattr(bpe_engine.tokenizer, "encode_many",
                            lambda texts: time.sleep(delay) or encode_many(texts))
        session = bpe_engine.session()
        log = _step_log(session)
        session.submit(running, mode="stock")
        session.step()
        session.submit(late, mode="stock", background=True)
        joined = None
        for i in range(1, 8):
            session.step()
            keys = {s.key.key for r in (*session.sched.waiting, *session.sched.prefilling,
                                        *session.sched.running) for s in r.streams}
            if joined is None and any(k[0] == "late" for k in keys):
                joined = i
        _drain(session)
        session.close()
        return log, joined

    quick, quick_joined = run(0.0)
    slow, slow_joined = run(0.3)
    ahead = bpe_engine.session().tokenize_ahead_iterations
    assert quick_joined == slow_joined == ahead + 1
    assert quick == slow


def test_an_idle_sessions_background_submits_start_together_at_the_first_step(
        bpe_engine, tmp_path: Path) -> None:
    """Submits made while nothing is scheduled (a worker's first claims) all start at the
    first step, which waits for their tokens: none of them joins later, one document an
    iteration beside the others' decode; a submit made once the session runs still waits
    `tokenize_ahead_iterations` steps."""
    tmpl = plain_template(tmp_path)
    rng = random.Random(15)
    docs = [_requests(rng, text(rng, 600), 3, tmpl, f"d{i}") for i in range(4)]
    later = _requests(rng, text(rng, 600), 2, tmpl, "later")
    session = bpe_engine.session()
    log = _step_log(session)
    assert session.tokenize_ahead_iterations > 1
    for batch in docs:
        session.submit(batch, mode="stock", background=True)

    def queued() -> set:
        return {s.key.key[0] for r in (*session.sched.waiting, *session.sched.prefilling,
                                       *session.sched.running) for s in r.streams}

    session.step()
    assert queued() == {"d0", "d1", "d2", "d3"}
    session.submit(later, mode="stock", background=True)
    session.step()
    assert "later" not in queued()
    _drain(session)
    session.close()
    assert {k[0] for k in log[0]} == {"d0", "d1", "d2", "d3"}  # one batch from the first step


@pytest.mark.parametrize("mode", ["stock", "cascade", "parallel"])
def test_prefill_ahead_launches_documents_only_and_changes_no_answer(
        tmp_path: Path, mode: str) -> None:
    """`prefill_ahead` between an idle session's background submits (a worker's first
    claims) prefills each document as it comes, in chunks, and neither a question nor a
    decode step runs before `step`. Every answer is the token ids of the same submits without
    it (fp32), and the first decode step holds every question still open: each call admits
    up to the prefill budget, where one first step admits that much in all and the rest join
    later beside decode. Two engines, so that neither finds the other's documents cached."""
    tmpl = plain_template(tmp_path)
    rng = random.Random(16)
    docs = [_requests(rng, text(rng, n), 3, tmpl, f"d{i}") for i, n in enumerate((700, 40, 1100))]

    def run(ahead: bool):
        engine = Engine("dummy:tiny-gqa+bpe", device="cpu",
                        config=EngineConfig(seed=5, max_prefill_tokens=64))
        answers: dict = {}
        session = engine.session(on_answer=lambda r, a: answers.__setitem__(r.key, a.token_ids))
        log = _step_log(session)
        launched = []
        for batch in docs:
            session.submit(batch, mode=mode, background=True)
            if ahead:
                launched.append(session.prefill_ahead())
                sched = session.sched
                # this submit's document is prefilled whole; no question has started
                assert not sched.pending_documents() and not sched.running
                assert not session._intake.pending and not log
        _drain(session)
        assert session.prefill_ahead() is False  # nothing left to prefill
        session.close()
        return answers, log, launched

    plain, plain_log, _ = run(False)
    ahead, ahead_log, launched = run(True)
    assert launched == [True, True, True]
    assert ahead == plain and len(plain) == 9
    open_after_prefill = {key for key, ids in plain.items() if len(ids) > 1}
    assert open_after_prefill <= ahead_log[0]
    assert plain_log[0] < ahead_log[0]  # the budget held the plain first step's admission


def test_prefill_ahead_waits_while_questions_decode(bpe_engine, tmp_path: Path) -> None:
    """Once questions decode, `prefill_ahead` does nothing: a document joins by `step`'s
    bounded prefill beside the decode, as any later submit does."""
    tmpl = plain_template(tmp_path)
    rng = random.Random(17)
    session = bpe_engine.session()
    session.submit(_requests(rng, text(rng, 300), 2, tmpl, "a"), mode="stock")
    session.step()
    assert session.sched.running
    session.submit(_requests(rng, text(rng, 300), 2, tmpl, "b"), mode="stock", background=True)
    steps = session.stats.steps
    assert session.prefill_ahead() is False
    assert session.stats.steps == steps and session._intake.pending
    _drain(session)
    session.close()


def test_auto_prices_each_document_with_those_decoding_beside_it(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """The cost model hears how many documents share a group's decode steps: the scheduler's,
    the rest of its submit and the submits still tokenizing, as many as the batch holds."""
    from ppqa.engine import intake

    seen: list[int] = []
    real = intake.choose_plan

    def recording(*args, documents, **kwargs):
        seen.append(documents)
        return real(*args, documents=documents, **kwargs)

    monkeypatch.setattr(intake, "choose_plan", recording)
    engine = Engine("dummy:tiny-gqa+bpe", device="cpu",
                    config=EngineConfig(seed=5, max_batch_requests=12))
    tmpl = plain_template(tmp_path)
    rng = random.Random(14)
    docs = [text(rng, n) for n in (300, 400, 500, 600, 700)]
    session = engine.session()
    session.submit([r for d, tag in zip(docs[:2], "ab") for r in _requests(rng, d, 3, tmpl, tag)],
                   mode="auto")
    assert seen == [2, 2]  # the first with the one after it, the second with the first
    session.submit(_requests(rng, docs[2], 3, tmpl, "c"), mode="auto", background=True)
    session.submit(_requests(rng, docs[3], 3, tmpl, "d"), mode="auto", background=True)
    _drain(session)
    assert seen[2:] == [4, 4]  # c: a and b held, d still tokenizing; d: a, b and c held
    session.submit(_requests(rng, docs[0], 3, tmpl, "e"), mode="auto")
    assert seen[-1] == 1  # nothing else held: a's document again counts once
    _drain(session)
    session.submit([r for d, tag in zip(docs[2:], "fgh") for r in _requests(rng, d, 6, tmpl, tag)],
                   mode="auto")
    assert seen[-3:] == [2, 2, 2]  # three of 6 questions each, and 12 rows hold two
    session.close()
