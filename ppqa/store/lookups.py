"""What a worker reads of the queue without claiming anything (store/queue.py claims): the
answers still to write for queued jobs (its progress total; with running ones, the work that
workers started together split), whether a claim would find a job
(`ppqa run` exits at once on an empty queue), and the newest job id (a following worker's look
for new jobs between its full claims)."""

from __future__ import annotations

from sqlalchemy import func, or_, select

from ppqa.store.db import Database
from ppqa.store.models import QUEUED, Job, Question
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
