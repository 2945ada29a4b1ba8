"""`WorkerOptions`: what a worker (`worker/loop.Worker`) is told to run and how: its model and
device, the decode mode, how much it keeps in flight, leases and polling. `ppqa run` builds
them from its options (cli/run.py), `ppqa serve --worker` from its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from ppqa.worker.setup import default_worker_id


@dataclass
class WorkerOptions:
    model: str = "smollm2"
    device: str = "cpu"
    mode: str = "auto"  # "auto": each job's own mode (auto there: the cost model per document)
    streams: int | str | None = None  # P, "auto" (the cost model's P) or None (engine default)
    # Jobs in flight at once (over one or more documents): as many as a batch has rows
    # (EngineConfig.max_batch_requests), since a job may be one question; the session's room
    # (worker/loop.Worker._has_room: a batch of requests waiting at most) bounds claims first.
    max_jobs: int = 256
    max_questions: int = 1024  # unanswered questions in flight (a job is always taken whole)
    # Workers sharing this queue (`ppqa run --peers N`, e.g. one on each of N hosts; `--gpus`
    # sets it for its workers): each claims while its questions in flight are below an even
    # share of what is left (queued or claimed), so that the others each find work rather
    # than the first ready taking a batch and a backlog (worker/pacing.ClaimPacer.share).
    peers: int = 1
    follow: bool = False  # keep waiting for new jobs instead of exiting when the queue is empty
    lease_seconds: float = 60.0
    max_attempts: int = 3
    poll_seconds: float = 2.0  # full claims' period when none came (arrivals are seen sooner)
    worker_id: str = field(default_factory=default_worker_id)

    def __post_init__(self) -> None:
        if self.streams is not None and self.streams != "auto" and (
                not isinstance(self.streams, int) or self.streams < 1):
            raise ValueError(f"streams must be at least 1 or 'auto', got {self.streams!r}")
        for name in ("max_jobs", "max_questions", "max_attempts", "peers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.lease_seconds > 0 or not self.poll_seconds > 0:
            raise ValueError("lease_seconds and poll_seconds must be positive")
