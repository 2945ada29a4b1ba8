"""What a worker reads of the queue without claiming anything (store/queue.py claims): the
answers still to write for queued jobs (its progress total; with running ones, the work that
workers started together split), whether a claim would find a job
(`ppqa run` exits at once on an empty queue) and why not while jobs are open, and the newest job id (a following worker's look
for new jobs between its full claims)."""

from __future__ import annotations

from sqlalchemy import func, or_, select

from ppqa.store.db import Database
from ppqa.store.models import QUEUED, RUNNING, Job, Question
from ppqa.store.queue import answer_count, claimable


def waiting_questions(db: Database, model: str | None = None,
                      statuses: tuple[str, ...] = (QUEUED,)) -> int:
    """Answers still to write for jobs in `statuses` (that a worker of `model` may take; one
    per unanswered question, or per missing sample): for queued jobs, the part of the queue
    nobody has claimed yet, a worker's progress total; with running ones too, the work left
    that workers sharing the queue split (`worker/pacing.ClaimPacer.share`)."""
    stmt = (select(func.coalesce(func.sum(Job.samples - answer_count()), 0))
            .select_from(Question).join(Job, Job.id == Question.job_id)
            .where(Job.status.in_(statuses), answer_count() < Job.samples))
    if model is not None:
        stmt = stmt.where(or_(Job.model.is_(None), Job.model == model))
    with db.read() as conn:
        return int(conn.execute(stmt).scalar_one())


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
