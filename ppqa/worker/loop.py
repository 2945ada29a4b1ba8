"""The worker behind `ppqa run`: claims queued jobs, answers them with the Engine, writes results.

One cycle: `claim_jobs` (a short write transaction: every claimable job of one document, leased
to this worker; repeated for more documents while the batch has room) -> one `QuestionRequest`
per unanswered question -> `Engine.run`, whose `on_answer` writes each answer the moment it is
done through `record_answer` (its own short transaction: nothing is held open while the model
runs) -> per job, `finish_job` with a speed report when all its questions are answered,
`fail_job` when the engine rejected it (e.g. a document too long for the model, a template
that fails to render: that job fails alone, the others of the cycle go on), or `release_jobs`
when a stop cut it short. A `LeaseKeeper` thread heartbeats the leases meanwhile; a job it
finds cancelled (or taken over) has its questions dropped from the engine at the next step.

The worker knows nothing of terminals: it tells a `ProgressSink` what happens (the CLI renders
that with Rich or log lines) and returns a `WorkerSummary`. `request_stop()` (the CLI calls it
on SIGINT/SIGTERM) stops admitting work; the engine drops what is in flight, and the cycle
settles as above, so a stopped worker leaves no job running.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from sqlalchemy.exc import SQLAlchemyError

from ppqa.store import queue
from ppqa.store.db import Database, error_reason
from ppqa.store.errors import StoreError
from ppqa.store.queue import ClaimedJob
from ppqa.worker.lease import LeaseKeeper
from ppqa.worker.report import JobOutcome, JobRun, ProgressSink, WorkerSummary, job_report
from ppqa.worker.setup import default_worker_id

# An engine that raises on this many cycles in a row is broken, not unlucky: stop the worker
# rather than burn through the queue failing every job. Each failure halves the next batch first.
MAX_ENGINE_CRASHES = 3


@dataclass
class WorkerOptions:
    model: str = "smollm2"
    device: str = "cpu"
    mode: str = "auto"  # "auto": each job's own mode when the batch agrees, else the engine's pick
    streams: int | str | None = None  # P, "auto" (the cost model's P) or None (engine default)
    max_jobs: int = 16  # jobs per cycle (over one or more documents)
    max_questions: int = 512  # unanswered questions per cycle (the first job is taken whole)
    follow: bool = False  # keep waiting for new jobs instead of exiting when the queue is empty
    lease_seconds: float = 60.0
    max_attempts: int = 3
    poll_seconds: float = 2.0  # --follow: how often an idle worker looks for new jobs
    worker_id: str = field(default_factory=default_worker_id)

    def __post_init__(self) -> None:
        if self.streams is not None and self.streams != "auto" and (
                not isinstance(self.streams, int) or self.streams < 1):
            raise ValueError(f"streams must be at least 1 or 'auto', got {self.streams!r}")
        for name in ("max_jobs", "max_questions", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.lease_seconds > 0 or not self.poll_seconds > 0:
            raise ValueError("lease_seconds and poll_seconds must be positive")


class WorkerError(RuntimeError):
    """The worker had to stop: its engine keeps failing."""


class Worker:
    def __init__(self, db: Database, engine, options: WorkerOptions,
                 progress: ProgressSink | None = None) -> None:
        self.db, self.engine, self.options = db, engine, options
        self.progress = progress or ProgressSink()
        self._stop = threading.Event()
        self.stop_reason: str | None = None
        self.summary = WorkerSummary(worker_id=options.worker_id, model=options.model,
                                     device=options.device)
        # Batch limits of the next cycle: halved after an engine failure (e.g. out of memory),
        # grown back to the options' after each cycle that goes well.
        self.max_jobs, self.max_questions = options.max_jobs, options.max_questions

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop admitting work; safe from a signal handler or another thread."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> WorkerSummary:
        """Drain the queue (or, with `follow`, keep serving it) until stopped; see module doc."""
        started = time.perf_counter()
        crashes = 0
        self.progress.started(self.options)
        try:
            while not self.stopping:
                try:
                    claims = self._claim()
                except (SQLAlchemyError, StoreError) as exc:
                    if not self.options.follow:
                        raise
                    # A long-running worker rides out a database restart or a network blip.
                    self.progress.message(f"cannot claim jobs, retrying: {error_reason(exc)}")
                    self._stop.wait(self.options.poll_seconds)
                    continue
                if not claims:
                    if not self.options.follow:
                        break
                    self.progress.waiting()
                    self._stop.wait(self.options.poll_seconds)
                    continue
                crashed = self._run_cycle(claims)
                crashes = crashes + 1 if crashed else 0
                self._resize(smaller=crashed)
                if crashes >= MAX_ENGINE_CRASHES:
                    raise WorkerError(f"the engine failed {crashes} times in a row; "
                                      f"last error: {self.summary.last_error}")
        finally:
            self.summary.wall_seconds = time.perf_counter() - started
            self.summary.stopped_by = self.stop_reason
            self.progress.finished(self.summary)
        return self.summary

    def _resize(self, smaller: bool) -> None:
        opts = self.options
        if smaller:
            self.max_jobs = max(1, self.max_jobs // 2)
            self.max_questions = max(1, self.max_questions // 2)
        else:
            self.max_jobs = min(opts.max_jobs, self.max_jobs * 2)
            self.max_questions = min(opts.max_questions, self.max_questions * 2)

    def _claim(self) -> list[ClaimedJob]:
        """Jobs of one document, then more documents while the cycle has room."""
        opts, claims, questions = self.options, [], 0
        while not self.stopping and len(claims) < self.max_jobs and questions < self.max_questions:
            try:
                got = queue.claim_jobs(
                    self.db, opts.worker_id, opts.lease_seconds,
                    max_jobs=self.max_jobs - len(claims),
                    max_questions=self.max_questions - questions,
                    max_attempts=opts.max_attempts, model=opts.model)
            except (SQLAlchemyError, StoreError):
                if not claims:
                    raise
                break  # work on what is already claimed rather than strand it
            if not got:
                break
            claims += got
            questions += sum(len(c.questions) for c in got)
        if claims:
            self.progress.claimed(claims)
        return claims

    def _run_cycle(self, claims: list[ClaimedJob]) -> bool:
        """Answer the claimed jobs and settle each one; True if the engine itself crashed."""
        runs = {c.job_id: JobRun(c) for c in claims}
        requests = []
        for claim in claims:  # one job's bad parameters fail that job alone, before the engine
            try:
                requests += _requests(claim)
            except Exception as exc:  # noqa: BLE001 - whatever its input raises is its own
                runs[claim.job_id].reject(exc, permanent=True)  # the same params fail again
        # Keys of questions whose job was cancelled or taken over; the lease keeper adds to it
        # and the engine drops them at its next step.
        cancelled: set = set()
        cycle_start = time.perf_counter()

        def on_answer(req, answer) -> None:
            run = runs[req.key[0]]
            if run.lost:  # cancelled meanwhile: its answers are not wanted any more
                return
            tokens = len(answer.token_ids)
            try:
                queue.record_answer(self.db, req.key[1], answer.text, tokens,
                                    answer.finish_reason, total_seconds=answer.latency_s,
                                    worker_id=self.options.worker_id)
            except Exception as exc:  # noqa: BLE001 - kept to retry at settle time
                run.unsaved.append((req.key[1], answer, exc))
                self.progress.message(f"job {run.claim.job_id}: answer not saved yet "
                                      f"({error_reason(exc)})")
                return
            run.add_answer(req.key[1], tokens, answer.prompt_tokens, time.perf_counter())
            self.progress.answered(run.claim, tokens)

        def on_error(req, exc) -> None:
            runs[req.key[0]].reject(exc)

        def on_lost(job_ids: list[int]) -> None:
            self._lost(runs, job_ids)
            cancelled.update((j, q.id) for j in job_ids if j in runs
                             for q in runs[j].claim.questions)

        stats, crash, mode = None, None, self._mode(claims)
        with LeaseKeeper(self.db, self.options.worker_id, list(runs),
                         self.options.lease_seconds, on_lost=on_lost,
                         on_problem=self.progress.message) as leases:
            try:
                if requests:
                    stats = self.engine.run(requests, mode=mode,
                                            streams=self.options.streams, on_answer=on_answer,
                                            on_error=on_error, should_stop=self._stop.is_set,
                                            cancelled=cancelled)
            except Exception as exc:  # noqa: BLE001 - settle what we have, then decide
                crash = f"engine error: {type(exc).__name__}: {exc}"
                self.summary.last_error = crash
            self._settle(list(runs.values()), stats, cycle_start, crash, mode, leases)
        return crash is not None

    def _mode(self, claims: list[ClaimedJob]) -> str:
        if self.options.mode != "auto":
            return self.options.mode
        modes = {c.params.mode for c in claims}
        return modes.pop() if len(modes) == 1 else "auto"

    def _lost(self, runs: dict[int, JobRun], job_ids: list[int]) -> None:
        """Jobs cancelled or taken over: not ours to end, and their further answers are not
        written (the engine drops their questions; see `_run_cycle`)."""
        for job_id in job_ids:
            if job_id in runs and not runs[job_id].lost:
                runs[job_id].lost = True
                self.progress.message(f"job {job_id}: lease lost (cancelled or taken over)")

    def _settle(self, runs: list[JobRun], stats, cycle_start: float, crash: str | None,
                mode: str, leases: LeaseKeeper) -> None:
        """End every job of the cycle: finished, failed, retried or released (see module doc).
        Each lease stays renewed until its job is ended, so none expires while others settle."""
        for run in runs:
            run.save_unsaved(self.db, self.options.worker_id)
        to_release = []
        for run in runs:
            if not run.lost and not run.complete and run.error is None and crash is None \
                    and self.stopping:
                to_release.append(run)  # a stop cut it short: give it back at once
                continue
            leases.forget([run.claim.job_id])
            self._record(run, lambda: self._end(run, runs, stats, cycle_start, crash, mode))
        ids = [r.claim.job_id for r in to_release]
        leases.forget(ids)
        released: set[int] = set()
        self._record(None, lambda: released.update(
            queue.release_jobs(self.db, self.options.worker_id, ids)))
        for run in to_release:  # a release is not an attempt; one not ours any more was "lost"
            self._record(run, lambda: JobOutcome.of(
                run, "released" if run.claim.job_id in released else "lost"))

    def _end(self, run: JobRun, runs: list[JobRun], stats, cycle_start: float,
             crash: str | None, mode: str) -> JobOutcome:
        opts, job_id = self.options, run.claim.job_id
        if run.lost:
            return JobOutcome.of(run, "lost")
        if run.complete and run.error is None:
            report = job_report(run, runs, stats, cycle_start, opts, mode)
            status = queue.finish_job(self.db, job_id, opts.worker_id, report)
            return JobOutcome.of(run, status, report=report)
        error = run.error or crash or (
            f"the engine returned without answering {len(run.pending)} question(s)")
        status = queue.fail_job(self.db, job_id, opts.worker_id, error, opts.max_attempts,
                                retry=not run.permanent)
        return JobOutcome.of(run, status, error=error)

    def _record(self, run: JobRun | None, end) -> None:
        """Run one settling step; a database that fails now must not lose the other jobs'
        outcomes: the job keeps its lease until it expires, and the next claim closes it."""
        try:
            outcome = end()
        except (SQLAlchemyError, StoreError) as exc:
            what = f"job {run.claim.job_id}" if run else "releasing jobs"
            self.progress.message(f"{what}: could not update the store ({error_reason(exc)}); "
                                  "its lease will expire and a worker will take it over")
            return
        if isinstance(outcome, JobOutcome):
            self.summary.add(outcome)
            self.progress.settled(outcome)


def _requests(claim: ClaimedJob) -> list:
    """The engine requests of a job's unanswered questions; raises if its parameters cannot
    make any (a seed or budget out of range, in a job queued before ingest checked them)."""
    from ppqa.config import SamplingParams
    from ppqa.engine.outputs import QuestionRequest

    p = claim.params
    sampling = SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                              top_p=p.top_p, seed=p.seed)
    return [QuestionRequest(key=(claim.job_id, q.id), document=claim.document_text,
                            question=q.text, sampling=sampling, template=p.template,
                            template_source=claim.template_source)
            for q in claim.questions]
