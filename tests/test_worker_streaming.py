"""The worker keeps one engine session fed: jobs join while others decode, a cancelled job
leaves the session at once while the others go on, and a job whose template fails fails alone.
The real engine on `dummy:tiny-mha` (CPU) and a real SQLite store; order is read from the
store's answer ids and the worker's own events, never from wall-clock time."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from ppqa.store.jobs import cancel_job
from ppqa.store.models import Answer, Job, Question
from ppqa.worker.loop import Worker, WorkerOptions
from ppqa.worker.report import ProgressSink
from tests.helpers import on_each_step

MODEL = "dummy:tiny-mha"
DOC = "The harbor of Velm opened in 1901. It has three piers and a red lighthouse."
OTHER = "Orrin is a river town with two bridges and a market on Sundays."


@pytest.fixture(scope="module")
def engine():
    from ppqa.engine.engine import Engine

    return Engine(MODEL, device="cpu")


def _answer_ids(db, job_id: int) -> list[int]:
    with db.read() as conn:
        return list(conn.execute(select(Answer.id).join(Question, Question.id == Answer.question_id)
                                 .where(Question.job_id == job_id)).scalars())


def _status(db, job_id: int) -> str:
    with db.read() as conn:
        return conn.execute(select(Job.status).where(Job.id == job_id)).scalar_one()


class _Events(ProgressSink):
    """Records what the worker reports, and runs a hook on the first answer of a job."""

    def __init__(self, on_first=None) -> None:
        self.events: list[tuple] = []
        self.on_first, self.fired = on_first, False

    def claimed(self, claims) -> None:
        self.events.append(("claimed", tuple(c.job_id for c in claims)))

    def answered(self, claim, answer_tokens: int) -> None:
        self.events.append(("answered", claim.job_id))
        if self.on_first is not None and not self.fired:
            self.fired = True
            self.on_first(claim.job_id)

    def message(self, text: str) -> None:
        self.events.append(("message", text))


def test_a_job_ingested_while_another_decodes_starts_before_it_ends(sqlite_db, add_job, engine,
                                                                  monkeypatch):
    long_job = add_job(sqlite_db, DOC, [f"Describe part {i} in detail." for i in range(3)],
                       max_new_tokens=60, mode="stock")
    late: list[int] = []

    def ingest_on_the_fifth(n: int) -> None:
        if n == 5:  # the long job is decoding by now
            late.append(add_job(sqlite_db, OTHER, ["How many bridges?"], max_new_tokens=2,
                                mode="stock"))

    on_each_step(monkeypatch, engine, ingest_on_the_fifth)
    sink = _Events()
    worker = Worker(sqlite_db, engine, WorkerOptions(model=MODEL, device="cpu", poll_seconds=0.01),
                    sink)
    summary = worker.run()

    assert summary.count("done") == 2 and len(late) == 1
    # The late job was claimed and answered while the long one still had answers to come.
    assert max(_answer_ids(sqlite_db, late[0])) < min(_answer_ids(sqlite_db, long_job))
    claims = [e[1] for e in sink.events if e[0] == "claimed"]
    assert claims == [(long_job,), (late[0],)]


def test_a_busy_worker_claims_one_document_between_two_steps(sqlite_db, add_job, engine,
                                                             monkeypatch):
    """With work in flight, each loop iteration claims one document's jobs at most, so that
    a claim's SQL and tokenization take one slot beside the step in flight, not the room's."""
    long_job = add_job(sqlite_db, DOC, [f"Describe part {i} in detail." for i in range(3)],
                       max_new_tokens=60, mode="stock")
    sink = _Events()
    late: list[int] = []

    def ingest_on_the_fifth(n: int) -> None:
        sink.events.append(("step",))
        if n == 5:  # three documents at once, while the long job decodes
            late.extend(add_job(sqlite_db, f"{OTHER} Copy {k}.", ["How many bridges?"],
                                max_new_tokens=2, mode="stock", name=f"late{k}")
                        for k in range(3))

    on_each_step(monkeypatch, engine, ingest_on_the_fifth)
    worker = Worker(sqlite_db, engine, WorkerOptions(model=MODEL, device="cpu", poll_seconds=0.01),
                    sink)
    summary = worker.run()

    assert summary.count("done") == 4
    claims = [e[1] for e in sink.events if e[0] in ("claimed",)]
    assert sorted(j for c in claims[1:] for j in c) == sorted(late)
    assert all(len(c) == 1 for c in claims[1:])  # one document (one job each) per claim
    # ... and a step of the session between any two claims.
    kinds = [e[0] for e in sink.events if e[0] in ("claimed", "step")]
    assert all(not (a == b == "claimed") for a, b in zip(kinds, kinds[1:])), kinds
    assert max(_answer_ids(sqlite_db, late[-1])) < min(_answer_ids(sqlite_db, long_job))


def test_a_busy_worker_settles_a_few_jobs_between_two_steps(sqlite_db, add_job, engine,
                                                            monkeypatch):
    """Jobs that finish together while another still decodes are settled a few an iteration
    (SETTLE_PER_ITERATION), each after its answers were written; all end done."""
    from ppqa.worker import loop

    long_job = add_job(sqlite_db, DOC, [f"Describe part {i} in detail." for i in range(2)],
                       max_new_tokens=60, mode="stock")
    short = [add_job(sqlite_db, OTHER, [f"Short {k}?"], max_new_tokens=3, mode="stock",
                     name=f"short{k}") for k in range(5)]
    sink = _Events()
    sink.settled = lambda outcome: sink.events.append(("settled", outcome.job_id))
    on_each_step(monkeypatch, engine, lambda n: sink.events.append(("step",)))
    worker = Worker(sqlite_db, engine, WorkerOptions(model=MODEL, device="cpu"), sink)
    summary = worker.run()

    assert summary.count("done") == 6
    kinds = [e[0] for e in sink.events if e[0] in ("settled", "step")]
    last_step = max(i for i, k in enumerate(kinds) if k == "step")
    assert kinds[:last_step].count("settled") == len(short)  # all while the long job decoded
    streak = 0
    for kind in kinds[:last_step]:
        streak = streak + 1 if kind == "settled" else 0
        assert streak <= loop.SETTLE_PER_ITERATION < len(short), kinds
    order = [e[1] for e in sink.events if e[0] == "settled"]
    assert sorted(order[:len(short)]) == sorted(short) and order[-1] == long_job


def test_cancel_stops_one_job_at_once_and_the_others_go_on(sqlite_db, add_job, engine,
                                                          monkeypatch):
    doomed = add_job(sqlite_db, DOC, [f"Question {k}?" for k in range(6)], max_new_tokens=400,
                     mode="stock")
    kept = add_job(sqlite_db, OTHER, [f"Other {k}?" for k in range(3)], max_new_tokens=20,
                   mode="stock")
    on_each_step(monkeypatch, engine, lambda n: cancel_job(sqlite_db, doomed) if n == 5 else None)
    sink = _Events()
    worker = Worker(sqlite_db, engine, WorkerOptions(model=MODEL, device="cpu",
                                                     lease_seconds=0.3), sink)
    summary = worker.run()

    assert _status(sqlite_db, doomed) == "cancelled" and _status(sqlite_db, kept) == "done"
    assert any(e[0] == "message" and f"job {doomed}: lease lost" in e[1] for e in sink.events)
    # The heartbeat saw the cancel long before 400 tokens: the doomed job left the session
    # with nothing written, while the other job finished.
    assert _answer_ids(sqlite_db, doomed) == []
    assert len(_answer_ids(sqlite_db, kept)) == 3
    assert [o.status for o in summary.jobs if o.job_id == kept] == ["done"]
    assert [o.status for o in summary.jobs if o.job_id == doomed] == ["lost"]


def test_a_template_that_fails_to_render_fails_its_job_alone(sqlite_db, add_job, engine, tmp_path):
    # Renders ingest's short sample document (so ingest queues it), fails on the real one.
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% block prefix %}{% if document | length > 40 %}{% include 'x' %}"
                      "{% endif %}{{ document }}{% endblock %}"
                      "{% block question %}{{ question }}{% endblock %}", encoding="utf-8")
    bad = add_job(sqlite_db, DOC, ["Anything?"], template=str(broken), max_new_tokens=3)
    good = add_job(sqlite_db, OTHER, ["How many bridges?"], max_new_tokens=3)
    summary = Worker(sqlite_db, engine, WorkerOptions(model=MODEL, device="cpu")).run()

    assert _status(sqlite_db, good) == "done"
    assert _status(sqlite_db, bad) == "failed"  # failed at once: the same template fails again
    with sqlite_db.read() as conn:
        attempts, error = conn.execute(select(Job.attempts, Job.error).where(Job.id == bad)).one()
    assert attempts == 1 and ("template" in error.lower() or "include" in error.lower())
    assert summary.last_error is None  # the engine itself never failed


def test_a_document_waits_to_be_claimed_whole_rather_than_in_parts(sqlite_db, add_job, engine,
                                                                   monkeypatch):
    # Room for 3 jobs: the first document takes 2, the second has 2 and waits until both fit,
    # so its questions reach the session in one submit (one group, one decode mode).
    first = [add_job(sqlite_db, DOC, [f"Part {i}?"], max_new_tokens=8) for i in range(2)]
    second = [add_job(sqlite_db, OTHER, [f"Bridge {i}?"], max_new_tokens=2) for i in range(2)]
    submits: list[list] = []
    make_session = engine.session

    def recording_session(*args, **kwargs):
        session = make_session(*args, **kwargs)
        submit = session.submit

        def recorded(requests, **kw):
            submits.append(sorted({r.key[0] for r in requests}))
            return submit(requests, **kw)

        session.submit = recorded
        return session

    monkeypatch.setattr(engine, "session", recording_session)
    sink = _Events()
    worker = Worker(sqlite_db, engine, WorkerOptions(model=MODEL, device="cpu", poll_seconds=0.01,
                                                     max_jobs=3), sink)
    summary = worker.run()
    assert summary.count("done") == 4
    claims = [e[1] for e in sink.events if e[0] == "claimed"]
    assert claims == [tuple(first), tuple(second)]
    assert submits == [first, second]
