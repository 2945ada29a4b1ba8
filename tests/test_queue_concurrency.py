"""Several real processes open a blank store and drain its queue at once (spawned, so each has
its own interpreter and connections): migrations run once, no job is claimed twice, none is
lost, every question gets exactly one answer. On SQLite (one file) and PostgreSQL."""

import multiprocessing
import random

import pytest
from sqlalchemy import func, select

N_WORKERS = 4
N_DOCUMENTS = 12
JOBS_PER_DOCUMENT = 4
# Spawned interpreters import SQLAlchemy before the first barrier: minutes on a loaded 2-core
# machine (a CI run beside other work timed out at 120 s), so the barriers wait generously.
BARRIER_S = 600
REPORT = dict(device="cpu", model="none", mode="stock", wall_seconds=0.01, questions=2,
              prompt_tokens=10, answer_tokens=2)


def drain(location: str, worker_id: str, seed: int, start, go, results) -> None:
    """One worker process: open the store, wait for the jobs, claim and answer until empty.
    Reports ("opened", id, None) once the store is open, then ("done", id, claimed) or, on any
    error, ("error", id, repr) after breaking the start barrier, if it has not passed it, so
    no sibling waits there for it."""
    started = False
    try:
        from ppqa.store import queue
        from ppqa.store.db import open_db

        rng = random.Random(seed)
        start.wait(timeout=BARRIER_S)
        started = True
        db = open_db(location)  # all open (and so migrate) the blank store at the same moment
        results.put(("opened", worker_id, None))
        if not go.wait(timeout=BARRIER_S):
            raise TimeoutError("the jobs were never added")
        claimed = []
        while True:
            jobs = queue.claim_jobs(db, worker_id, 120, max_jobs=rng.randint(1, 3))
            if not jobs:
                break
            for job in jobs:
                claimed.append(job.job_id)
                for q in job.questions:
                    queue.record_answer(db, q.id, f"{worker_id}: {q.text}", 2, "stop",
                                        worker_id=worker_id)
                assert queue.finish_job(db, job.job_id, worker_id, REPORT) == "done"
        db.close()
        results.put(("done", worker_id, claimed))
    except BaseException as exc:  # report instead of dying silently
        if not started:
            start.abort()
        results.put(("error", worker_id, repr(exc)))


def collect(results, procs, kind: str) -> dict[str, object]:
    """One `kind` message from every worker; the first worker error fails the test at once
    (a worker that died used to leave the others, and this process, waiting on a barrier)."""
    got = {}
    while len(got) < len(procs):
        what, worker_id, payload = results.get(timeout=BARRIER_S)
        if what == "error":
            for p in procs:
                p.terminate()
            pytest.fail(f"{worker_id} failed: {payload}")
        assert what == kind, (what, worker_id)
        got[worker_id] = payload
    return got


def run_workers(location: str, add_job) -> tuple[list[int], dict[str, list[int]]]:
    ctx = multiprocessing.get_context("spawn")
    start, go, results = ctx.Barrier(N_WORKERS), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=drain, args=(location, f"w{i}", i, start, go, results))
             for i in range(N_WORKERS)]
    for p in procs:
        p.start()
    collect(results, procs, "opened")
    from ppqa.store.db import open_db

    db = open_db(location)
    job_ids = [add_job(db, f"Document number {d}.", (f"Q{d}.{j}a?", f"Q{d}.{j}b?"),
                       name=f"doc{d}", priority=d % 3)
               for j in range(JOBS_PER_DOCUMENT) for d in range(N_DOCUMENTS)]
    go.set()
    by_worker = collect(results, procs, "done")
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    check_store(db, job_ids, by_worker)
    db.close()
    return job_ids, by_worker


def check_store(db, job_ids, by_worker) -> None:
    from ppqa.store.models import Answer, Job, MigrationRecord, Question
    from ppqa.store.migrations import MIGRATIONS

    all_claims = [j for claimed in by_worker.values() for j in claimed]
    assert len(all_claims) == len(set(all_claims)), "a job was claimed twice"
    assert sorted(all_claims) == sorted(job_ids), "a job was lost"
    owner = {j: w for w, claimed in by_worker.items() for j in claimed}
    with db.read() as conn:
        assert conn.execute(select(MigrationRecord.name).order_by(MigrationRecord.name)
                            ).scalars().all() == [name for name, _ in MIGRATIONS]
        jobs = conn.execute(select(Job.id, Job.status, Job.attempts)).all()
        assert {(j.status, j.attempts) for j in jobs} == {("done", 1)}
        answers = conn.execute(select(Question.job_id, Question.id, Answer.worker)
                               .join(Answer, Answer.question_id == Question.id)).all()
        assert conn.execute(select(func.count(Question.id))).scalar_one() == 2 * len(job_ids)
    assert len(answers) == 2 * len(job_ids) == len({a.id for a in answers})
    # Each answer was written by the one worker that claimed its job.
    assert all(owner[a.job_id] == a.worker for a in answers)


def test_processes_share_one_sqlite_file(sqlite_path, add_job):
    _, by_worker = run_workers(str(sqlite_path), add_job)
    assert sum(len(c) for c in by_worker.values()) == N_DOCUMENTS * JOBS_PER_DOCUMENT


@pytest.mark.postgres
def test_processes_share_postgresql(pg_url, add_job):
    _, by_worker = run_workers(pg_url, add_job)
    assert sum(len(c) for c in by_worker.values()) == N_DOCUMENTS * JOBS_PER_DOCUMENT
