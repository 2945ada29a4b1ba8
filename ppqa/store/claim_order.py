"""Which document a claim takes next (`store/queue.claim_jobs` claims its jobs).

`next_document` looks, among the claimable jobs (`claimable`: queued, or running with an
expired lease) of the top priority, for a document this worker holds, then one no other live
worker holds, then any; each look is an index range that stops at its first row, so a claim
reads the same few rows whatever the queue holds (tests/test_store_scale.py).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import and_, or_, select

from ppqa.store.models import QUEUED, RUNNING, Job


def claimable(now: datetime, model: str | None):
    """The condition on `Job` of a job a worker of `model` may claim at `now`."""
    cond = or_(Job.status == QUEUED, and_(Job.status == RUNNING, Job.lease_expires_at < now))
    if model is not None:
        cond = and_(cond, or_(Job.model.is_(None), Job.model == model))
    return cond


def next_document(conn, now: datetime, model: str | None, worker_id: str, order):
    """The row naming the document to claim next, or None. Among the claimable jobs of the top
    priority: a document with a job this worker runs (its KV is likely still in its engine),
    else the oldest one no other live worker runs (claiming that would prefill it twice), else
    the first in the usual order (at the top priority, then, where a concurrent claim holds
    every top job, at any).

    Each look reads a bounded part of the queue, whatever its size: the documents held (the
    running jobs, a few per worker) are read first, and each ordered look is an index range
    that stops at its first row (`_first_open`). Conditions over every queued job (an OR of
    statuses, a subquery per row) made a claim 30 ms on SQLite and 256 ms on PostgreSQL at
    20,000 queued jobs (benchmarks/results/cpu/store_scale_before_{sqlite,pg}.json)."""
    tops = [conn.execute(select(Job.priority).where(part)
                         .order_by(*(k.desc() for k in lead), Job.priority.desc()).limit(1))
            .scalar() for part, lead in _open_parts(now, model)]
    top = max((p for p in tops if p is not None), default=None)
    if top is None:
        return None
    held = conn.execute(select(Job.document_id, Job.lease_owner).distinct().where(
        Job.status == RUNNING, Job.lease_expires_at >= now)).all()
    mine = sorted({doc for doc, owner in held if owner == worker_id})
    others = sorted({doc for doc, owner in held if owner != worker_id})
    looks = [{"documents": mine}] if mine else []
    looks += [{"exclude": others}, {}] if others else [{}]
    for look in looks:
        head = _first_open(conn, now, model, order, top, **look)
        if head is not None:
            return head
    # Every top job is locked by a concurrent claim (PostgreSQL's SKIP LOCKED): any priority.
    return _first_open(conn, now, model, order)


def _open_parts(now: datetime, model: str | None, indexed: bool = True) -> list[tuple]:
    """`claimable` as its parts, each an index range of the claim order, with the columns an
    ordered look at it leads with: queued jobs (for a worker of a model, those of no model and
    those of its model apart, ranges of the index by model, whose look leads with the model
    column so that PostgreSQL takes that index: it would guess no-model jobs spread over the
    queue's order and read past every job of other models looking for one), and running jobs
    whose lease expired (a few at most). indexed False: the same conditions written so that no
    database reads them through those indexes (`_first_open`'s documents)."""
    status = Job.status if indexed else Job.status.concat("")
    expired = and_(status == RUNNING, Job.lease_expires_at < now)
    if model is None:
        return [(status == QUEUED, ()), (expired, ())]
    either = or_(Job.model.is_(None), Job.model == model)
    if not indexed:
        return [(and_(status == QUEUED, either), ()), (and_(expired, either), ())]
    return [(and_(status == QUEUED, Job.model.is_(None)), (Job.model,)),
            (and_(status == QUEUED, Job.model == model), (Job.model,)),
            (and_(expired, either), ())]


def _first_open(conn, now: datetime, model: str | None, order, top: int | None = None,
                documents: list[int] | None = None, exclude: list[int] = ()):
    """The first claimable job in `order`, row-locked, skipping rows locked by a concurrent
    claim: the first of each part of `_open_parts`, the earliest of them. `top`: of that
    priority only; `exclude`: not of these documents; `documents`: of these only, read
    through the documents' index (SQLite, which keeps no statistics, would otherwise take
    the claim order's and read every queued job of the priority)."""
    by_document = documents is not None
    priority = Job.priority + 0 if by_document else Job.priority
    best = None
    for part, lead in _open_parts(now, model, indexed=not by_document):
        query = select(Job.document_id, Job.priority, Job.created_at, Job.id).where(part)
        if top is not None:
            query = query.where(priority == top)
        if by_document:
            query = query.where(Job.document_id.in_(documents))
        if exclude:
            query = query.where(Job.document_id.not_in(exclude))
        row = conn.execute(query.order_by(*lead, *order).limit(1)
                           .with_for_update(skip_locked=True)).first()
        if row is not None and (best is None or _rank(row) < _rank(best)):
            best = row
    return best


def _rank(row) -> tuple:
    """A job row's place in the claim order: priority high first, then oldest, then id."""
    return (-row.priority, row.created_at, row.id)
