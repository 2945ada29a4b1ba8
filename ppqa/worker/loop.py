"""The worker behind `ppqa run`: keeps one engine session full from the queue, writes results.

The loop, between engine steps (the step in flight runs on the GPU meanwhile):
  - claim when the session has room (jobs and questions in flight below the limits, a short
    backlog of requests waiting for KV): `claim_jobs` is a short write transaction that leases
    every claimable job of one document (one document per iteration while work is in flight,
    so that the claim and its tokenization fit beside the step in flight; an idle worker
    claims all its room at once, the session prefilling each document while the next is
    claimed, `EngineSession.prefill_ahead`); each job's
    unanswered questions go to the session (`EngineSession.submit`) with the job's mode, and
    its lease to the `LeaseKeeper`;
  - step the session once: admission, chunked prefill, one decode step per kind of request;
  - write the answers that step finished (`record_answers`, one short transaction) and settle
    each job whose questions are all answered or rejected (a few an iteration while the session
    has work, so that the writes fit beside the step in flight): `finish_job` with its own speed
    report, or `fail_job` with the reason (a document too long for the model, a template that
    fails to render or parameters the sampler cannot take fail that job alone, without a
    retry; the other jobs go on);
  - jobs whose lease the heartbeat found lost (cancelled, or taken over) leave the session at
    once (`EngineSession.cancel`).
So a job ingested while others decode starts at the next claim, not after the others end.
When to claim (full claims every `poll_seconds` when none came, a look for a newer job id in
between, peers' shares) is `pacing.ClaimPacer`'s.

The worker knows nothing of terminals: it tells a `ProgressSink` what happens (the CLI renders
that with Rich or log lines) and returns a `WorkerSummary`. `request_stop()` (the CLI calls it
on SIGINT/SIGTERM) stops admitting work; the session drops what is in flight, finished jobs are
settled and unfinished ones released, so a stopped worker leaves no job running. If the engine
itself fails (e.g. out of memory), the answers it delivered first are written, every job in
flight they do not complete is failed for a retry, the session starts afresh, and the in-flight
limits halve; they grow back as jobs finish.
"""

from __future__ import annotations

import queue as threadsafe
import threading
import time

from sqlalchemy.exc import SQLAlchemyError

from ppqa.store import queue
from ppqa.store.db import Database, error_reason
from ppqa.store.errors import StoreError
from ppqa.store.queue import ClaimedJob
from ppqa.worker.lease import LeaseKeeper
from ppqa.worker.options import WorkerOptions
from ppqa.worker.pacing import ClaimPacer
from ppqa.worker.report import (JobOutcome, JobRun, ProgressSink, WorkerSummary, answer_row,
                                job_report)
from ppqa.worker.requests import ALL_SAMPLES, engine_requests, job_sampling

# An engine that fails this many times in a row is broken, not unlucky: stop the worker rather
# than burn through the queue failing every job. Each failure halves the in-flight limits first.
MAX_ENGINE_CRASHES = 3
# Jobs settled (each a write transaction with its report) between two engine steps while the
# session has work: 16 jobs settling at once idled the GPU 80-96 ms at a time, about 5 ms a job
# (results/h200/gprof_labeling_auto_s21c1.json, `long_idle_gaps`); the rest settle over the
# next iterations, their answers already written.
SETTLE_PER_ITERATION = 2


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
        # In-flight limits: halved after an engine failure (e.g. out of memory), grown back to
        # the options' as jobs finish.
        self.max_jobs, self.max_questions = options.max_jobs, options.max_questions
        self._runs: dict[int, JobRun] = {}
        self._answers: list[tuple[JobRun, tuple[int, int], object]] = []  # not yet written
        self._lost: threadsafe.SimpleQueue[list[int]] = threadsafe.SimpleQueue()
        self._session = None
        self._leases: LeaseKeeper | None = None
        self._pacer = ClaimPacer(db, options, self._stop)
        self._crashes = 0  # engine failures since a job last finished well

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop admitting work; safe from a signal handler or another thread."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> WorkerSummary:
        """Drain the queue (or, with `follow`, keep serving it) until stopped; see module doc."""
        started = time.perf_counter()
        self.progress.started(self.options)
        self._leases = LeaseKeeper(self.db, self.options.worker_id, [], self.options.lease_seconds,
                                   on_lost=self._lost.put, on_problem=self.progress.message)
        try:
            with self._leases:
                self._session = self._new_session()
                while not self.stopping:
                    self._drop_lost()
                    claimed = self._claim_if_room()
                    if self._session.has_work():
                        if not self._engine_call(self._session.step):
                            continue
                        busy = self._session.has_work()
                        if self._write_and_settle(SETTLE_PER_ITERATION if busy else None):
                            self._crashes = 0
                        continue
                    self._write_and_settle()
                    if claimed or self._runs:
                        continue
                    if not self.options.follow:
                        break
                    self.progress.waiting()
                    self._pacer.wait_for_jobs()
                self._wind_down()
        finally:
            self.summary.wall_seconds = time.perf_counter() - started
            self.summary.stopped_by = self.stop_reason
            self.progress.finished(self.summary)
        return self.summary

    def _engine_call(self, call) -> bool:
        """Run an engine call (a step, a prefill ahead); False if the engine failed, which
        fails the jobs in flight for a retry (`_crash`), or stops the worker after
        MAX_ENGINE_CRASHES failures with no job finished between them."""
        try:
            call()
            return True
        except Exception as exc:  # noqa: BLE001 - fail the batch, then decide
            self._crashes += 1
            self._crash(exc)
            if self._crashes >= MAX_ENGINE_CRASHES:
                raise WorkerError(f"the engine failed {self._crashes} times in a row; "
                                  f"last error: {self.summary.last_error}") from None
            return False

    def _new_session(self):
        return self.engine.session(on_answer=self._on_answer, on_error=self._on_error)

    # A request's key: (job id, (question id, sample)); the second part is what JobRun tracks.
    # The one request of a question with choices and several samples has sample ALL_SAMPLES:
    # each of its answers says which sample it is (see `_requests`).
    def _on_answer(self, req, answer) -> None:
        run = self._runs.get(req.key[0])
        if run is None or run.lost:  # a cancelled job's late answers are not wanted
            return
        question_id, sample = req.key[1]
        if sample == ALL_SAMPLES:
            sample = answer.sample
            if (question_id, sample) not in run.pending:  # stored before; drawn the same again
                return
        self._answers.append((run, (question_id, sample), answer))

    def _on_error(self, req, exc) -> None:
        run = self._runs.get(req.key[0])
        if run is None:
            return
        # The session rejects a question for its own inputs (a prompt that cannot fit, a
        # template that fails to render): the same inputs fail the same way on a retry.
        question_id, sample = req.key[1]
        wanted = ([w for w in run.outstanding if w[0] == question_id] if sample == ALL_SAMPLES
                  else [req.key[1]])
        for w in wanted:
            run.reject(w, str(exc) or type(exc).__name__, permanent=True)

    # ---- claiming ----------------------------------------------------------------------------

    def _outstanding(self) -> int:
        """Questions in flight: claimed, neither answered nor rejected yet."""
        return sum(len(r.outstanding) for r in self._runs.values())

    def _has_room(self) -> bool:
        outstanding = self._outstanding()
        backlog = self._session.queued_requests < self.engine.config.max_batch_requests
        return len(self._runs) < self.max_jobs and outstanding < self.max_questions and backlog

    def _claim_if_room(self) -> bool:
        """Claim jobs (one document at a time) while the session has room and the pacer says
        so; True if any came. A worker with work in flight claims one document per call: the
        claim's SQL and its questions' tokenization happen between two engine steps, while the
        step in flight runs, so each call's share stays within about one step's time rather
        than the whole room's (the GPU would idle through the rest). An idle session takes all
        the room it has at once, the session prefilling each claim's document while the next
        is claimed (`EngineSession.prefill_ahead`). Among `peers`, claims stop at this
        worker's share."""
        busy = bool(self._runs)
        if self.stopping or not self._has_room() or not self._pacer.may_claim(busy):
            return False
        opts, got_any = self.options, False
        share = self._pacer.share()
        if busy and share is not None and self._outstanding() >= share:
            self._pacer.look_again_soon()
            return False
        while (not self.stopping and self._has_room() and not (busy and got_any)
               and (share is None or not got_any or self._outstanding() < share)):
            outstanding = self._outstanding()
            try:
                claims = queue.claim_jobs(
                    self.db, opts.worker_id, opts.lease_seconds,
                    max_jobs=self.max_jobs - len(self._runs),
                    max_questions=max(1, self.max_questions - outstanding),
                    max_attempts=opts.max_attempts, model=opts.model,
                    whole_within=(self.max_jobs, self.max_questions))
            except (SQLAlchemyError, StoreError) as exc:
                if not busy and not got_any and not opts.follow:
                    raise
                # A worker with work, or a long-running one, rides out a database blip.
                self.progress.message(f"cannot claim jobs, retrying: {error_reason(exc)}")
                claims = []
            if not claims:
                # A document waiting for room to be claimed whole: ask again when a job ends.
                self._pacer.found_nothing(deferred=getattr(claims, "deferred", False))
                break
            self._start(claims)
            self._pacer.claimed()
            got_any = True
            # Idle, the next claims would leave the GPU waiting: it prefills these documents
            # meanwhile. A failure there ends the claims like a failed step.
            if not busy and not self._engine_call(self._session.prefill_ahead):
                break
        return got_any

    def _start(self, claims: list[ClaimedJob]) -> None:
        """Hand claimed jobs to the session: the jobs of one mode in one submit, so that the
        questions of several jobs about one document form one group."""
        self.progress.claimed(claims)
        by_mode: dict[str, list] = {}
        for claim in claims:
            run = self._runs[claim.job_id] = JobRun(claim, started_at=time.perf_counter())
            self._leases.add([claim.job_id])
            try:
                requests = engine_requests(claim, job_sampling(claim))
            except Exception as exc:  # noqa: BLE001 - one job's bad parameters fail it alone
                for wanted in list(run.pending):
                    run.reject(wanted, f"{type(exc).__name__}: {exc}", permanent=True)
                continue
            mode = self.options.mode if self.options.mode != "auto" else claim.params.mode
            by_mode.setdefault(mode, []).extend(requests)
        for mode, requests in by_mode.items():
            try:
                self._session.submit(requests, mode=mode, streams=self.options.streams,
                                     background=True)
            except Exception as exc:  # noqa: BLE001 - e.g. an unknown mode stored by hand
                for req in requests:
                    self._on_error(req, exc)

    def _drop_lost(self) -> None:
        """Jobs cancelled or taken over: out of the session at once; answers saved so far count,
        but they are not ours to end."""
        lost: set[int] = set()
        while not self._lost.empty():
            lost.update(self._lost.get())
        lost &= set(self._runs)
        if not lost:
            return
        self._session.cancel(lambda req: req.key[0] in lost)
        for job_id in sorted(lost):
            if not self._runs[job_id].lost:
                self._runs[job_id].lost = True
                self.progress.message(f"job {job_id}: lease lost (cancelled or taken over)")

    # ---- writing and settling ----------------------------------------------------------------

    def _write_and_settle(self, limit: int | None = None) -> bool:
        """Write the finished answers in one transaction and end the jobs that are complete
        (at most `limit` of them; None: all); True if a job finished well."""
        self._write_answers()
        finished_well = False
        for run in [r for r in self._runs.values() if r.settleable][:limit]:
            outcome = self._settle(run)
            finished_well |= outcome is not None and outcome.status == "done"
            self._pacer.job_settled()
        if finished_well:
            self.max_jobs = min(self.options.max_jobs, self.max_jobs * 2)
            self.max_questions = min(self.options.max_questions, self.max_questions * 2)
        return finished_well

    def _write_answers(self) -> None:
        """The answers delivered since the last write, in one transaction; where it fails, each
        keeps a second try when its job settles (`JobRun.unsaved`)."""
        if self._answers:
            batch, self._answers = self._answers, []
            rows = [answer_row(wanted, a) for _, wanted, a in batch]
            try:
                queue.record_answers(self.db, rows, worker_id=self.options.worker_id)
                saved = True
            except Exception as exc:  # noqa: BLE001 - each answer gets a second try at settling
                saved = False
                self.progress.message(f"answers not saved yet ({error_reason(exc)})")
            now = time.perf_counter()
            for run, wanted, answer in batch:
                if saved:
                    run.add_answer(wanted, answer, now)
                    self.progress.answered(run.claim, len(answer.token_ids))
                else:
                    run.unsaved.append((wanted, answer, None))
                    run.outstanding.discard(wanted)

    def _settle(self, run: JobRun, *, released_ok: bool = False) -> JobOutcome | None:
        """End one job: finished, failed (retried or not), released or lost."""
        del self._runs[run.claim.job_id]
        self._leases.forget([run.claim.job_id])
        run.save_unsaved(self.db, self.options.worker_id)
        return self._record(run, lambda: self._end(run, released_ok))

    def _end(self, run: JobRun, release: bool) -> JobOutcome:
        opts, job_id = self.options, run.claim.job_id
        if run.lost:
            return JobOutcome.of(run, "lost")
        if run.complete and run.error is None:
            report = job_report(run, opts, self.engine.peak_memory_bytes,
                                self._session.stats.max_batch_requests)
            status = queue.finish_job(self.db, job_id, opts.worker_id, report)
            return JobOutcome.of(run, status, report=report)
        if release and run.error is None:
            released = queue.release_jobs(self.db, opts.worker_id, [job_id])
            return JobOutcome.of(run, "released" if job_id in released else "lost")
        error = run.error or f"the engine returned without {len(run.pending)} answer(s)"
        status = queue.fail_job(self.db, job_id, opts.worker_id, error, opts.max_attempts,
                                retry=not run.permanent)
        return JobOutcome.of(run, status, error=error)

    def _record(self, run: JobRun, end) -> JobOutcome | None:
        """Run one settling step; a database that fails now must not lose the other jobs'
        outcomes: the job keeps its lease until it expires, and the next claim closes it."""
        try:
            outcome = end()
        except (SQLAlchemyError, StoreError) as exc:
            self.progress.message(f"job {run.claim.job_id}: could not update the store "
                                  f"({error_reason(exc)}); its lease will expire and another "
                                  "worker will take it over")
            return None
        self.summary.add(outcome)
        self.progress.settled(outcome)
        return outcome

    def _crash(self, exc: Exception) -> None:
        """The engine failed: the answers it delivered before failing are written, every job
        in flight that they do not complete fails for a retry (which runs only its unanswered
        questions), and a new session starts with halved limits."""
        crash = f"engine error: {type(exc).__name__}: {exc}"
        self.summary.last_error = crash
        self._session.close()
        self._write_answers()
        for run in list(self._runs.values()):
            if run.error is None and not run.complete:
                run.error = crash
            self._settle(run)
        self.max_jobs = max(1, self.max_jobs // 2)
        self.max_questions = max(1, self.max_questions // 2)
        self._session = self._new_session()

    def _wind_down(self) -> None:
        """After a stop or the end of the queue: what finished is written and settled, the
        rest released (a release is not an attempt)."""
        self._session.close()
        self._write_and_settle()
        for run in list(self._runs.values()):
            self._settle(run, released_ok=True)

