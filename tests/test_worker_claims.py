"""The worker's claims, in process, with the real engine on `dummy:tiny-mha` (CPU): an idle
worker prefills each claimed document before its next claim (and an engine failure there fails
the claims for a retry), one-question jobs fill a batch, and a worker among peers claims its
share and leaves the rest to its siblings. The rest of the worker: test_worker.py.
"""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from ppqa.store.models import Answer
from tests.helpers import job_states, make_worker
from tests.test_worker import DOC, MODEL


@pytest.fixture(scope="module")
def engine():
    from ppqa.engine.engine import Engine

    return Engine(MODEL, device="cpu")


def test_an_idle_worker_prefills_each_claimed_document_before_the_next_claim(
        sqlite_db, add_job, engine, monkeypatch):
    """An idle worker claims its room a document at a time; between two claims the session
    prefills the document just claimed (`prefill_ahead`), and no question prefills or decodes
    until the claims are done: the first decode step holds every document's questions."""
    from ppqa.store import queue
    from ppqa.worker import loop

    for i in range(3):
        add_job(sqlite_db, f"Document {i}. " + DOC, ["Who?", "When?"], name=f"d{i}",
                max_new_tokens=3)
    events: list = []
    claim = queue.claim_jobs

    def logged_claim(*args, **kwargs):
        claims = claim(*args, **kwargs)
        events.append(("claim", [c.document_name for c in claims]))
        return claims

    monkeypatch.setattr(loop.queue, "claim_jobs", logged_claim)
    make_session = engine.session

    def session(*args, **kwargs):
        made = make_session(*args, **kwargs)
        ahead, build = made.prefill_ahead, made.sched.decode_step

        def logged_ahead():
            launched = ahead()
            events.append(("ahead", launched, bool(made.sched.pending_documents()),
                           len(made.sched.running)))
            return launched

        def logged_step(requests, **kw):
            events.append(("decode", sorted({s.key.key[0] for r in requests if r.row >= 0
                                             for s in r.streams})))
            return build(requests, **kw)

        made.prefill_ahead, made.sched.decode_step = logged_ahead, logged_step
        return made

    monkeypatch.setattr(engine, "session", session)
    summary = make_worker(sqlite_db, engine, mode="stock").run()
    assert summary.count("done") == 3
    first_decode = next(i for i, e in enumerate(events) if e[0] == "decode")
    before = events[:first_decode]
    assert before == [("claim", ["d0"]), ("ahead", True, False, 0),
                      ("claim", ["d1"]), ("ahead", True, False, 0),
                      ("claim", ["d2"]), ("ahead", True, False, 0), ("claim", [])]
    assert len(events[first_decode][1]) == 3  # the three jobs' questions decode together


def test_an_engine_failure_while_prefilling_ahead_fails_the_claims_for_a_retry(
        sqlite_db, add_job):
    """A document's prefill that fails between an idle worker's claims (out of memory) is an
    engine failure like a failed step: the jobs in flight fail for a retry, the worker goes
    on with a new session, and each question is answered once."""
    from ppqa.engine.engine import Engine

    class FailingAheadEngine(Engine):
        def session(self, *args, **kwargs):
            session = super().session(*args, **kwargs)
            ahead = session.prefill_ahead

            def ahead_that_fails_once():
                if not self.failed:
                    self.failed = True
                    raise RuntimeError("CUDA out of memory (simulated)")
                return ahead()

            session.prefill_ahead = ahead_that_fails_once
            return session

    jobs = [add_job(sqlite_db, f"Document {i}. " + DOC, ["Who?", "When?"], max_new_tokens=3,
                    seed=i) for i in range(3)]
    engine = FailingAheadEngine(MODEL, device="cpu")
    engine.failed = False
    worker = make_worker(sqlite_db, engine, max_attempts=3)
    summary = worker.run()

    assert engine.failed
    states = job_states(sqlite_db)
    assert {states[j][0] for j in jobs} == {"done"}
    assert states[jobs[0]][1] == 2  # the job claimed before the failure ran again
    assert "out of memory" in summary.last_error
    with sqlite_db.read() as conn:
        assert conn.execute(select(func.count(Answer.id))).scalar_one() == 6
    assert summary.count("queued") > 0  # failed for a retry, not lost


def test_one_question_jobs_fill_a_batch_by_default(sqlite_db, add_job, engine, monkeypatch):
    """A job may be a single question (a judge's verdict, one label): with the default
    options a worker takes as many such jobs as a batch has rows, so they decode together
    rather than a few dozen at a time."""
    jobs = 40
    for i in range(jobs):
        add_job(sqlite_db, DOC, [f"Is claim {i} in the text?"], name="velm", max_new_tokens=3)
    widest = [0]
    make_session = engine.session

    def session(*args, **kwargs):
        made = make_session(*args, **kwargs)
        build = made.sched.decode_step

        def logged(requests, **kw):
            widest[0] = max(widest[0], sum(len(r.streams) for r in requests if r.row >= 0))
            return build(requests, **kw)

        made.sched.decode_step = logged
        return made

    monkeypatch.setattr(engine, "session", session)
    summary = make_worker(sqlite_db, engine, mode="stock").run()
    assert summary.count("done") == jobs
    assert engine.config.max_batch_requests >= jobs
    assert widest[0] == jobs


@pytest.mark.parametrize("peers, left_queued", [(1, 0), (2, 2), (4, 3)])
def test_an_idle_worker_among_peers_claims_its_share(sqlite_db, add_job, engine, monkeypatch,
                                                     peers, left_queued):
    """Workers started together (`ppqa run --gpus`) split what waits: an idle worker's first
    claims stop at its share of the waiting questions, whole documents, at least one."""
    from tests.helpers import on_each_step

    for i in range(4):
        add_job(sqlite_db, f"Document {i}. " + DOC, ["Who?", "When?", "Where?"],
                name=f"d{i}", max_new_tokens=2)
    queued_at_first_step = []

    def count_queued(n):
        if n == 1:
            queued_at_first_step.append(sum(s[0] == "queued" for s in job_states(sqlite_db).values()))

    on_each_step(monkeypatch, engine, count_queued)
    summary = make_worker(sqlite_db, engine, peers=peers).run()
    assert queued_at_first_step == [left_queued]
    assert summary.count("done") == 4  # alone, it took the rest once its claims were done


@pytest.mark.parametrize("peers, queued_while_busy", [(1, 0), (2, 1)])
def test_a_busy_worker_among_peers_leaves_the_rest_to_its_siblings(
        sqlite_db, add_job, engine, monkeypatch, peers, queued_while_busy):
    """A lone worker claims a document an iteration while it has room; among peers, a busy
    worker claims only below an even share of the questions left (queued, or claimed by any
    of them), and an idle one takes what is left."""
    from ppqa.store import queue
    from tests.helpers import on_each_step

    for i in range(4):
        add_job(sqlite_db, f"Document {i}. " + DOC, ["Who?", "When?", "Where?"],
                name=f"d{i}", max_new_tokens=8)
    sibling = queue.claim_jobs(sqlite_db, "sibling", 60)  # another worker holds a document
    assert len(sibling) == 1
    queued = {}

    def count_queued(n):
        queued[n] = sum(s[0] == "queued" for s in job_states(sqlite_db).values())

    on_each_step(monkeypatch, engine, count_queued)
    summary = make_worker(sqlite_db, engine, peers=peers).run()
    # Its first claims: 2 documents of the 12 questions left among 2 (or all it has room for).
    assert queued[1] == (0 if peers == 1 else 1)
    assert queued[4] == queued_while_busy
    assert summary.count("done") == 3  # idle, it took the last document whatever its share
    assert job_states(sqlite_db)[sibling[0].job_id][0] == "running"
