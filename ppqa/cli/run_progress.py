"""How `ppqa run` shows a worker's progress on stderr: Rich bars on a terminal, log lines elsewhere.

Both renderers are `ProgressSink`s fed by the worker (`worker/loop.py`) from its main thread and
its heartbeat thread. `Counters` keeps what both show: questions done of total (total = what this
worker has claimed plus what still waits in the queue, re-read at each claim), answer tokens per
second since the first claim, and the remaining time at that pace. `RichProgress` draws an
overall bar plus one bar per document in flight; `LogProgress` prints a line per claim and per
finished job, and a progress line every `interval` seconds (for logs, CI and `nohup`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from ppqa.worker.report import JobOutcome, ProgressSink, WorkerSummary


class Counters:
    def __init__(self) -> None:
        self.done = 0
        self.total = 0
        self.tokens = 0
        self.started: float | None = None
        self.first_answer_at: float | None = None
        self.in_flight: dict[int, list] = {}  # document id -> [name, done, total, open jobs]
        self.claimed: dict[int, int] = {}  # job id -> questions claimed
        self.lock = threading.Lock()

    def claim(self, claims, waiting: int) -> None:
        with self.lock:
            if self.started is None:
                self.started = time.monotonic()
            claimed = sum(len(c.questions) for c in claims)
            self.total = self.done + claimed + waiting + self._open_questions()
            for c in claims:
                self.claimed[c.job_id] = len(c.questions)
                doc = self.in_flight.setdefault(c.document_id, [c.document_name, 0, 0, 0])
                doc[2] += len(c.questions)
                doc[3] += 1

    def _open_questions(self) -> int:
        return sum(total - done for _, done, total, _ in self.in_flight.values())

    def answer(self, claim, tokens: int) -> None:
        with self.lock:
            if self.first_answer_at is None:
                self.first_answer_at = time.monotonic()
            self.done += 1
            self.tokens += tokens
            self.in_flight[claim.document_id][1] += 1

    def settle(self, outcome: JobOutcome) -> bool:
        """Count a job out (its unanswered questions leave the total: they are not this
        worker's to do any more); True when its document has no job left in flight."""
        with self.lock:
            self.total -= self.claimed.pop(outcome.job_id, outcome.answered) - outcome.answered
            doc = self.in_flight.get(outcome.document_id)
            if doc is None:
                return True
            doc[3] -= 1
            if doc[3] <= 0:
                del self.in_flight[outcome.document_id]
                return True
            return False

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started if self.started is not None else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def remaining(self) -> float | None:
        """At the pace since the first answer: the wait for it is mostly the document's
        prefill, paid once, which would make an estimate from the start far too long."""
        if self.done < 2 or self.first_answer_at is None:
            return None
        pace = (time.monotonic() - self.first_answer_at) / (self.done - 1)
        return max(self.total - self.done, 0) * pace


def _hms(seconds: float | None) -> str:
    return "?" if seconds is None else str(timedelta(seconds=round(seconds)))


def outcome_line(o: JobOutcome) -> str:
    if o.status == "done" and o.report:
        r = o.report
        return (f"job {o.job_id} done: {r['questions']} questions in {r['wall_seconds']:.1f} s "
                f"({r['tokens_per_second']:.1f} tok/s, mode {r['mode']})")
    if o.status == "failed":
        return f"job {o.job_id} failed: {o.error}"
    if o.status == "queued":
        return f"job {o.job_id} will be retried: {o.error}"
    if o.status == "released":
        return (f"job {o.job_id} released with {o.answered} answers saved "
                f"({o.questions} questions in all); another worker can take it now")
    return f"job {o.job_id}: {o.status} ({o.answered} answers saved)"


def summary_line(s: WorkerSummary) -> str:
    d = s.to_dict()
    line = (f"{d['jobs_done']} job(s) done, {d['jobs_failed']} failed, "
            f"{d['jobs_retried']} to retry, {d['jobs_released']} released; "
            f"{d['questions_answered']} answers in {_hms(s.wall_seconds)} "
            f"({d['questions_per_second']:.2f} questions/s, {d['tokens_per_second']:.1f} tok/s)")
    return line + (f"; stopped by {s.stopped_by}" if s.stopped_by else "")


class _Base(ProgressSink):
    def __init__(self, console: Console, waiting_questions) -> None:
        self.console = console
        self.counters = Counters()
        self._waiting_questions = waiting_questions  # () -> questions still queued

    def started(self, options) -> None:
        self.console.print(f"ppqa run: worker {options.worker_id}, model {options.model} on "
                           f"{options.device}, mode {options.mode}, lease {options.lease_seconds:g} s")

    def message(self, text: str) -> None:
        self.console.print(text)


class LogProgress(_Base):
    def __init__(self, console: Console, waiting_questions, interval: float = 10.0) -> None:
        super().__init__(console, waiting_questions)
        self.interval = interval
        self._last = time.monotonic()

    def claimed(self, claims) -> None:
        self.counters.claim(claims, self._waiting_questions())
        names = sorted({c.document_name for c in claims})
        self.console.print(f"claimed {len(claims)} job(s) ({', '.join(str(c.job_id) for c in claims)}) "
                           f"of {', '.join(names)}: {sum(len(c.questions) for c in claims)} questions")

    def answered(self, claim, answer_tokens: int) -> None:
        self.counters.answer(claim, answer_tokens)
        if time.monotonic() - self._last >= self.interval:
            self._last = time.monotonic()
            c = self.counters
            self.console.print(
                f"progress: {c.done}/{c.total} questions, {len(c.in_flight)} document(s) in "
                f"flight, {c.tokens_per_second:.1f} tok/s, elapsed {_hms(c.elapsed)}, "
                f"remaining ~{_hms(c.remaining)}")

    def settled(self, outcome: JobOutcome) -> None:
        self.counters.settle(outcome)
        self.console.print(outcome_line(outcome))

    def finished(self, summary: WorkerSummary) -> None:
        self.console.print(summary_line(summary))


class RichProgress(_Base):
    def __init__(self, console: Console, waiting_questions) -> None:
        super().__init__(console, waiting_questions)
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                             TextColumn("left"), TimeRemainingColumn(), console=console,
                             transient=False)
        self.overall = self.bars.add_task("all questions", total=None, rate="")
        self.doc_tasks: dict[int, int] = {}
        self.bars.start()

    def claimed(self, claims) -> None:
        self.counters.claim(claims, self._waiting_questions())
        self.bars.update(self.overall, total=self.counters.total, completed=self.counters.done,
                         description="all questions")
        for c in claims:
            task = self.doc_tasks.get(c.document_id)
            if task is None:
                self.doc_tasks[c.document_id] = self.bars.add_task(
                    f"  {c.document_name[:40]}", total=len(c.questions), rate="")
            else:
                self.bars.update(task, total=self.bars.tasks[task].total + len(c.questions))

    def answered(self, claim, answer_tokens: int) -> None:
        self.counters.answer(claim, answer_tokens)
        self.bars.update(self.overall, completed=self.counters.done,
                         rate=f"{self.counters.tokens_per_second:.1f} tok/s")
        task = self.doc_tasks.get(claim.document_id)
        if task is not None:
            self.bars.advance(task)

    def settled(self, outcome: JobOutcome) -> None:
        doc_id = outcome.document_id
        if self.counters.settle(outcome) and doc_id in self.doc_tasks:
            self.bars.remove_task(self.doc_tasks.pop(doc_id))
        self.bars.update(self.overall, total=self.counters.total)
        if outcome.status != "done":
            self.console.print(outcome_line(outcome))

    def waiting(self) -> None:
        self.bars.update(self.overall, description="all questions (waiting for jobs)")

    def finished(self, summary: WorkerSummary) -> None:
        self.bars.stop()
        self.console.print(summary_line(summary))


def make_progress(waiting_questions, *, stream=None) -> ProgressSink:
    """Rich bars when stderr is a terminal, else log lines (PPQA_LOG_INTERVAL seconds apart)."""
    stream = stream or sys.stderr
    console = Console(file=stream, highlight=False, soft_wrap=True)
    if console.is_terminal:
        return RichProgress(console, waiting_questions)
    interval = float(os.environ.get("PPQA_LOG_INTERVAL", "10"))
    return LogProgress(console, waiting_questions, interval)
