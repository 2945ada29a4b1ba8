"""What a worker reads of the queue without claiming anything (store/queue.py claims): the
answers still to write for queued jobs (its progress total; with running ones, the work that
workers started together split), whether a claim would find a job
(`ppqa run` exits at once on an empty queue) and why not while jobs are open, and the newest job id (a following worker's look
for new jobs between its full claims)."""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import func, or_, select

from ppqa.store.db import Database
from ppqa.store.models import QUEUED, RUNNING, Answer, Job, Question
from ppqa.store.claim_order import claimable


# Job ids bound in one IN list (SQLite and PostgreSQL take well over this many parameters).
ID_CHUNK = 5000


def id_chunks(ids: list[int]) -> Iterator[list[int]]:
    """`ids` in lists of at most ID_CHUNK, one IN list each."""
    for at in range(0, len(ids), ID_CHUNK):
        yield ids[at:at + ID_CHUNK]


def waiting_questions(db: Database, model: str | None = None,
                      statuses: tuple[str, ...] = (QUEUED,)) -> int:
    """Answers still to write for jobs in `statuses` (that a worker of `model` may take; one
    per unanswered question, or per missing sample): for queued jobs, the part of the queue
    nobody has claimed yet, a worker's progress total; with running ones too, the work left
    that workers sharing the queue split (`worker/pacing.ClaimPacer.share`).

    Read as the answers those jobs want (questions x samples, from the jobs' rows) less the
    answers they have, which only jobs a worker has claimed (`started_at` set) can hold:
    workers write answers for the jobs they claim, a sample once each. So the query reads the
    jobs' rows and the questions of started ones, not every question of the queue: a count
    question by question took 0.28 s on SQLite and 1.4 s on PostgreSQL at 390,000 queued
    questions, and a worker reads this between two engine steps
    (benchmarks/results/cpu/store_scale_before_{sqlite,pg}.json)."""
    which = [Job.status.in_(statuses)]
    if model is not None:
        which.append(or_(Job.model.is_(None), Job.model == model))
    wanted = select(func.coalesce(func.sum(Job.question_count * Job.samples), 0)).where(*which)
    with db.read() as conn:
        left = int(conn.execute(wanted).scalar_one())
        # The started jobs' ids first: a join the planner drives from the jobs' side even
        # where its statistics still describe an empty table (a store just filled).
        started = list(conn.execute(select(Job.id).where(
            *which, Job.started_at.is_not(None))).scalars())
        for chunk in id_chunks(started):
            left -= int(conn.execute(
                select(func.count(Answer.id)).select_from(Question)
                .join(Answer, Answer.question_id == Question.id)
                .where(Question.job_id.in_(chunk))).scalar_one())
    return left


def has_claimable(db: Database, model: str | None = None) -> bool:
    """Whether `claim_jobs` would find a job now (queued, or running with an expired lease)."""
    with db.read() as conn:
        now = db.now(conn)
        found = conn.execute(select(Job.id).where(claimable(now, model)).limit(1)).first()
        return found is not None


def newest_job_id(db: Database) -> int:
    """The largest job id, 0 for an empty store. Ingest inserts jobs with growing ids and nothing
    deletes them, so a larger one than a worker saw means a job was ingested since: a look far
    cheaper than `claim_jobs`, which a worker then runs. It misses what keeps its id (a job
    released, retried or whose lease expired) and, on PostgreSQL, a job committed after one with
    a larger id: those wait for the worker's full poll."""
    with db.read() as conn:
        return int(conn.execute(select(func.coalesce(func.max(Job.id), 0))).scalar_one())


def unclaimable_work(db: Database, model: str | None = None) -> tuple[dict[str, int], int, float | None]:
    """Why a worker of `model` finds nothing to claim while jobs are open: (queued jobs per
    other model, jobs of this model running under leases not yet expired, seconds until the
    first of those leases expires or None)."""
    with db.read() as conn:
        now = db.now(conn)
        others: dict[str, int] = {}
        if model is not None:
            rows = conn.execute(select(Job.model, func.count()).where(
                Job.status == QUEUED, Job.model.is_not(None), Job.model != model)
                .group_by(Job.model))
            others = {name: int(n) for name, n in rows}
        running = select(func.count(), func.min(Job.lease_expires_at)).where(
            Job.status == RUNNING, Job.lease_expires_at >= now)
        if model is not None:
            running = running.where(or_(Job.model.is_(None), Job.model == model))
        leased, first = conn.execute(running).one()
    left = None if first is None else max((first - now).total_seconds(), 0.0)
    return dict(sorted(others.items())), int(leased), left
