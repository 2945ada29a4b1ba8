"""Keeps a worker's leases alive while the model works: a heartbeat thread.

The main thread is busy stepping the engine session, so a small daemon
thread calls `queue.heartbeat` every third of the lease, in its own short transaction (the
store's connection pool gives it its own connection). Jobs the store says this worker no longer
owns (cancelled, or taken over after the lease expired while this process was frozen) are
passed to `on_lost`; a failed heartbeat (database briefly unreachable) is reported to
`on_problem` and retried at the next beat, well before the lease runs out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ppqa.store import queue
from ppqa.store.db import Database, error_reason


class LeaseKeeper:
    def __init__(self, db: Database, worker_id: str, job_ids: list[int], lease_seconds: float,
                 *, on_lost: Callable[[list[int]], None],
                 on_problem: Callable[[str], None] = lambda _: None) -> None:
        self.db, self.worker_id, self.lease_seconds = db, worker_id, lease_seconds
        self.job_ids = list(job_ids)
        self.on_lost, self.on_problem = on_lost, on_problem
        # A third of the lease leaves two more beats before it can expire.
        self.interval = max(lease_seconds / 3.0, 0.05)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ppqa-heartbeat", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def add(self, job_ids: list[int]) -> None:
        """Start renewing these leases too (jobs just claimed)."""
        self.job_ids = self.job_ids + [j for j in job_ids if j not in self.job_ids]

    def forget(self, job_ids: list[int]) -> None:
        """Stop renewing these leases (the jobs are being finished, failed or released)."""
        self.job_ids = [j for j in self.job_ids if j not in set(job_ids)]

    def _beat(self) -> None:
        while not self._done.wait(self.interval):
            job_ids = self.job_ids  # one snapshot: `forget` may replace the list meanwhile
            try:
                lost = queue.heartbeat(self.db, self.worker_id, job_ids, self.lease_seconds)
            except Exception as exc:  # noqa: BLE001 - try again at the next beat
                self.on_problem(f"heartbeat failed, retrying: {error_reason(exc)}")
                continue
            lost = [j for j in lost if j in self.job_ids]  # not those settled meanwhile
            if lost:
                self.forget(lost)
                self.on_lost(lost)
