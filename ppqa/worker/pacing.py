"""When a worker claims: the timing of `Worker._claim_if_room` (worker/loop.py), apart from
what a claim does.

A worker with work in flight runs a full claim only every `poll_seconds` when the last one
found nothing, so that its SQL does not sit between every two engine steps; meanwhile it looks
for a newer job id (`lookups.newest_job_id`, one read) every ARRIVAL_PROBE_SECONDS and claims at
once when there is one. A claim that found jobs is followed by another at the next turn, until
one finds nothing: a busy worker claims a document a turn, and one look finds an ingest's
newest job only. An idle worker claims at every turn and waits between turns for
`poll_seconds`, ended early by a stop or a new job. Among `peers` workers sharing the queue,
each claims up to an even share of the questions left (`share`).
"""

from __future__ import annotations

import threading
import time

from sqlalchemy.exc import SQLAlchemyError

from ppqa.store import lookups
from ppqa.store.db import Database
from ppqa.store.errors import StoreError
from ppqa.store.models import QUEUED, RUNNING
from ppqa.worker.options import WorkerOptions

# How often a worker between two full claims asks whether a job was ingested (one read of the
# largest job id): a new job waits about this long, while the full claim, ~5 ms of SQL on the
# engine loop's thread between two steps, stays at `poll_seconds`.
ARRIVAL_PROBE_SECONDS = 0.2
# How often a worker among peers re-reads the questions left to share: a sum over the queue's
# jobs (8-12 ms at 20,000 of them: benchmarks/results/cpu/store_scale_{sqlite,pg}.json), run on
# the engine loop's thread between two steps; a share moves slowly.
SHARE_READ_SECONDS = 2.0


class ClaimPacer:
    def __init__(self, db: Database, options: WorkerOptions, stop: threading.Event) -> None:
        self.db, self.options, self._stop = db, options, stop
        self._next_claim = 0.0  # perf_counter time before which a worker with work skips claims
        self._claim_on_settle = False  # the last claim was deferred (queue.Claims.deferred)
        self._seen_job_id = 0  # the newest job id before the last claim: a larger one is new
        self._next_probe = 0.0  # perf_counter time of a busy worker's next look for a new job
        self._shared = (-1.0, 0)  # (perf_counter time, share) of the last `share` read

    def may_claim(self, busy: bool) -> bool:
        """Whether to claim now: an idle worker always; one with work (`busy`) once
        `poll_seconds` have passed since a claim found nothing, or earlier when a look (at most
        every ARRIVAL_PROBE_SECONDS) finds a job ingested since the last claim. Notes the newest
        job id: a job ingested while the claim runs has a larger one."""
        now = time.perf_counter()
        early = busy and now < self._next_claim  # before the full claim only for a new job
        if early:
            if now < self._next_probe:
                return False
            self._next_probe = now + ARRIVAL_PROBE_SECONDS
        newest = self._newest_job_id()
        if early and newest <= self._seen_job_id:
            return False
        self._seen_job_id = newest
        return True

    def claimed(self) -> None:
        """A claim came back with jobs: claim again at the next turn. A busy worker claims one
        document a turn, so the rest of what one ingest added (found by one look, whose newer
        job id it was) waits in the queue until a claim comes back empty."""
        self._next_claim = 0.0

    def found_nothing(self, deferred: bool) -> None:
        """A claim came back empty: the next full one after `poll_seconds`, or as soon as a job
        settles where a document waits for room to be claimed whole (`deferred`)."""
        self._next_claim = time.perf_counter() + self.options.poll_seconds
        self._claim_on_settle = deferred

    def look_again_soon(self) -> None:
        """A busy worker at its share among peers: ask again after ARRIVAL_PROBE_SECONDS."""
        self._next_claim = time.perf_counter() + ARRIVAL_PROBE_SECONDS

    def job_settled(self) -> None:
        """A job ended: the room a waiting document needs may be here now."""
        if self._claim_on_settle:
            self._next_claim, self._claim_on_settle = 0.0, False

    def share(self) -> int | None:
        """Among `peers` workers sharing the queue, the questions in flight up to which this
        one claims: an even share of what is left, queued or claimed by any of them (None:
        all it has room for). One below it always exists while questions wait, so none is
        left unclaimed; an idle worker claims a document whatever its share. Read from the
        store at most every SHARE_READ_SECONDS: a sum over the whole queue, which a busy
        worker would otherwise run between every two steps."""
        if self.options.peers <= 1:
            return None
        now = time.perf_counter()
        if now - self._shared[0] < SHARE_READ_SECONDS:
            return self._shared[1]
        try:
            left = lookups.waiting_questions(self.db, self.options.model, (QUEUED, RUNNING))
        except (SQLAlchemyError, StoreError):
            return None  # the claim that follows reports a store that stays down
        self._shared = (now, -(-left // self.options.peers))
        return self._shared[1]

    def wait_for_jobs(self) -> None:
        """An idle worker's wait before its next full claim: `poll_seconds`, ended early by a
        stop or a job ingested (looked for every ARRIVAL_PROBE_SECONDS). Jobs whose lease
        expired, released or retried keep their ids: only the full claim finds those."""
        deadline = time.perf_counter() + self.options.poll_seconds
        while (left := deadline - time.perf_counter()) > 0:
            if self._stop.wait(min(ARRIVAL_PROBE_SECONDS, left)) or self._job_arrived():
                return

    def _newest_job_id(self) -> int:
        """`lookups.newest_job_id`; on a database blip the last one seen (nothing new): the
        look is a hint, and the full claim reports a store that stays down."""
        try:
            return lookups.newest_job_id(self.db)
        except (SQLAlchemyError, StoreError):
            return self._seen_job_id

    def _job_arrived(self) -> bool:
        """Whether a job was ingested since the last claim."""
        return self._newest_job_id() > self._seen_job_id
