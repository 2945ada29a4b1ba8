"""A job ingested between two full claims is claimed within a look for new job ids
(`lookups.newest_job_id`, every `pacing.ARRIVAL_PROBE_SECONDS`), not at the next `poll_seconds`:
by an idle following worker and by a busy one, which claims the rest of that ingest's jobs at
the turns after (one document a turn). The real engine on `dummy:tiny-mha` (CPU) and a
real SQLite store; `poll_seconds` is a minute, so a worker that waited for its full claim fails
the test (a bounded wait, never a hang). Order is read from the store and the worker's events."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from ppqa.store import lookups, queue
from ppqa.store.models import Job
from ppqa.worker import pacing
from ppqa.worker.report import ProgressSink
from tests.helpers import WORKER_MODEL, make_worker, on_each_step

DOC = "The harbor of Velm opened in 1901. It has three piers and a red lighthouse."
OTHER = "Orrin is a river town with two bridges and a market on Sundays."
POLL_SECONDS = 60.0  # the full claim's period: far longer than any test here waits


@pytest.fixture(scope="module")
def engine():
    from ppqa.engine.engine import Engine

    return Engine(WORKER_MODEL, device="cpu")


class _Events(ProgressSink):
    """Records claims and settled jobs; signals the worker's first wait and each job settled."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.idle, self.any_settled = threading.Event(), threading.Event()

    def claimed(self, claims) -> None:
        self.events.append(("claimed", tuple(c.job_id for c in claims)))

    def settled(self, outcome) -> None:
        self.events.append(("settled", outcome.job_id, outcome.status))
        self.any_settled.set()

    def waiting(self) -> None:
        self.idle.set()


def _times(db, job_id: int):
    with db.read() as conn:
        return conn.execute(select(Job.status, Job.created_at, Job.started_at, Job.finished_at)
                            .where(Job.id == job_id)).one()


def test_newest_job_id_is_zero_when_empty_and_grows_with_each_ingest(any_db, add_job):
    assert lookups.newest_job_id(any_db) == 0
    first = add_job(any_db, DOC, ["How many piers?"])
    assert lookups.newest_job_id(any_db) == first
    second = add_job(any_db, OTHER, ["How many bridges?"])
    assert lookups.newest_job_id(any_db) == second > first
    queue.claim_jobs(any_db, "w", 60)  # a claim changes jobs, not their ids
    assert lookups.newest_job_id(any_db) == second


def test_an_idle_following_worker_claims_a_new_job_before_its_poll(sqlite_db, add_job, engine):
    sink = _Events()
    worker = make_worker(sqlite_db, engine, sink, follow=True, poll_seconds=POLL_SECONDS)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert sink.idle.wait(30), "the worker never went idle"
        job = add_job(sqlite_db, OTHER, ["How many bridges?"], max_new_tokens=2, mode="stock")
        settled = sink.any_settled.wait(POLL_SECONDS / 2)
    finally:
        worker.request_stop()
        thread.join(30)
    assert not thread.is_alive() and not failure, failure
    assert settled, "the new job waited for the full claim"
    status, created, started, _ = _times(sqlite_db, job)
    assert status == "done"
    assert (started - created).total_seconds() < POLL_SECONDS / 2
    assert [e for e in sink.events if e[0] == "claimed"] == [("claimed", (job,))]


def _long_job(db, add_job) -> int:
    return add_job(db, DOC, [f"Describe part {i} in detail." for i in range(3)],
                   max_new_tokens=60, mode="stock")


def _ingest_while_busy(monkeypatch, engine, ingest) -> list[int]:
    """At the engine's fifth step (the long job decoding, the full claim a minute off) call
    `ingest()` for the ids of the jobs it adds; the sixth step lasts as long as a look's
    period, so the next iteration looks. Returns the list those ids go into."""
    late: list[int] = []

    def on_step(n: int) -> None:
        if n == 5:
            late.extend(ingest())
        if n == 6:
            time.sleep(pacing.ARRIVAL_PROBE_SECONDS * 1.5)

    on_each_step(monkeypatch, engine, on_step)
    return late


def test_a_busy_worker_claims_a_new_job_before_its_poll(sqlite_db, add_job, engine, monkeypatch):
    long_job = _long_job(sqlite_db, add_job)
    late = _ingest_while_busy(monkeypatch, engine, lambda: [
        add_job(sqlite_db, OTHER, ["How many bridges?"], max_new_tokens=2, mode="stock")])
    sink = _Events()
    summary = make_worker(sqlite_db, engine, sink, poll_seconds=POLL_SECONDS).run()

    assert summary.count("done") == 2 and len(late) == 1
    # The late job was claimed while the long one decoded, not after it ended.
    assert _times(sqlite_db, late[0]).started_at < _times(sqlite_db, long_job).finished_at
    kinds = [e[:2] for e in sink.events]
    assert kinds.index(("claimed", (late[0],))) < kinds.index(("settled", long_job))


def test_a_busy_worker_claims_every_job_of_one_ingest_before_its_poll(sqlite_db, add_job, engine,
                                                                    monkeypatch):
    """One look finds an ingest's newest job id; a busy worker claims one document a turn, so
    the ingest's other jobs come from the claims that follow the first, not from the full claim
    a minute later (or after the busy job ends)."""
    long_job = _long_job(sqlite_db, add_job)
    towns = ("Orrin", "Pell", "Marrow")
    late = _ingest_while_busy(monkeypatch, engine, lambda: [  # one ingest of three documents
        add_job(sqlite_db, f"{town} is a river town with {i + 2} bridges.",
                ["How many bridges?"], max_new_tokens=2, mode="stock")
        for i, town in enumerate(towns)])
    sink = _Events()
    summary = make_worker(sqlite_db, engine, sink, poll_seconds=POLL_SECONDS).run()

    assert summary.count("done") == 4 and len(late) == 3
    kinds = [e[:2] for e in sink.events]
    long_settled = kinds.index(("settled", long_job))
    for job in late:
        assert kinds.index(("claimed", (job,))) < long_settled, (job, sink.events)
        assert _times(sqlite_db, job).started_at < _times(sqlite_db, long_job).finished_at


def test_a_store_that_cannot_answer_the_look_still_serves_jobs(sqlite_db, add_job, engine,
                                                              monkeypatch):
    """The look is a hint: a database error there, busy or idle, is nothing new, and the
    full claims go on."""
    def blip(db):
        raise OperationalError("SELECT max(jobs.id)", {}, Exception("database is locked"))

    monkeypatch.setattr(lookups, "newest_job_id", blip)
    long_job = _long_job(sqlite_db, add_job)
    late = _ingest_while_busy(monkeypatch, engine, lambda: [
        add_job(sqlite_db, OTHER, ["How many bridges?"], max_new_tokens=2)])
    sink = _Events()
    summary = make_worker(sqlite_db, engine, sink, poll_seconds=POLL_SECONDS).run()
    assert summary.count("done") == 2 and len(late) == 1
    # Nothing told the busy worker of the late job: it was claimed when the long one ended.
    claims = [e[1] for e in sink.events if e[0] == "claimed"]
    assert claims == [(long_job,), (late[0],)]
    kinds = [e[:2] for e in sink.events]
    assert kinds.index(("settled", long_job)) < kinds.index(("claimed", (late[0],)))
