"""How `ppqa run` shows a worker's progress on stderr: Rich bars on a terminal, log lines elsewhere.

Both renderers are `ProgressSink`s fed by the worker (`ppqa/worker/loop.py`) from its main
thread and its heartbeat thread. `Counters` keeps what both show: answers done of total
(one per question, or per sample where a job asks for several; total = answered + claimed and
still open + what waits in the queue, re-read at a claim or a settled job at most every
WAITING_READ_SECONDS and at the end, so that answers another worker took, or a stop gave
back, are counted truthfully; in between this worker's claims come off the last read), answer
tokens per second since the first claim, and the remaining time at the pace since the first
answer (recomputed whenever it is shown, so it grows while nothing is answered).
`RichProgress` draws an overall bar plus one bar per document in flight and prints a line per
claim and per settled job above them; `LogProgress` prints the same lines, and a progress line
every `interval` seconds (for logs, CI and `nohup`). Every line is printed without passwords
(`common.redacted`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeElapsedColumn)
from rich.text import Text

from ppqa.cli.common import redacted
from ppqa.worker.report import JobOutcome, ProgressSink, WorkerSummary


# How often the progress total re-reads the answers waiting in the queue, a sum over the queued
# jobs (8-12 ms at 20,000 of them: benchmarks/results/cpu/store_scale_{sqlite,pg}.json) that
# the worker runs between two engine steps; in between, its claims come off the last read.
WAITING_READ_SECONDS = 2.0


def plural(n: int, word: str) -> str:
    """'1 question', '2 questions'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


class Counters:
    def __init__(self) -> None:
        self.done = 0
        self.total = 0
        self.tokens = 0
        self.started: float | None = None
        self.first_answer_at: float | None = None
        self.in_flight: dict[int, list] = {}  # document id -> [name, done, total, open jobs]
        self.claimed: dict[int, int] = {}  # job id -> answers claimed
        self.lock = threading.Lock()

    def claim(self, claims, waiting: int) -> None:
        with self.lock:
            if self.started is None:
                self.started = time.monotonic()
            for c in claims:
                self.claimed[c.job_id] = c.answers_wanted
                doc = self.in_flight.setdefault(c.document_id, [c.document_name, 0, 0, 0])
                doc[2] += c.answers_wanted
                doc[3] += 1
            self._recount(waiting)

    def _recount(self, waiting: int) -> None:
        self.total = self.done + self._open_questions() + waiting

    def _open_questions(self) -> int:
        return sum(total - done for _, done, total, _ in self.in_flight.values())

    def answer(self, claim, tokens: int) -> None:
        with self.lock:
            if self.first_answer_at is None:
                self.first_answer_at = time.monotonic()
            self.done += 1
            self.tokens += tokens
            self.in_flight[claim.document_id][1] += 1

    def settle(self, outcome: JobOutcome, waiting: int) -> bool:
        """Count a job out: its unanswered questions are no longer this worker's (a released
        or retried job's are back in `waiting`). True when its document has no job left."""
        with self.lock:
            claimed = self.claimed.pop(outcome.job_id, outcome.answered)
            doc = self.in_flight.get(outcome.document_id)
            emptied = True
            if doc is not None:
                doc[2] -= claimed - outcome.answered
                doc[3] -= 1
                emptied = doc[3] <= 0
                if emptied:
                    del self.in_flight[outcome.document_id]
            self._recount(waiting)
            return emptied

    def finish(self, summary: WorkerSummary, waiting: int) -> None:
        with self.lock:
            self.done = max(self.done, summary.questions)
            self.in_flight.clear()
            self._recount(waiting)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started if self.started is not None else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def pace(self) -> float | None:
        """Seconds per answer since the first answer (whose wait is mostly the document's
        prefill, paid once: counting it would make estimates far too long), up to now."""
        if self.done < 2 or self.first_answer_at is None:
            return None
        return (time.monotonic() - self.first_answer_at) / (self.done - 1)

    @property
    def remaining(self) -> float | None:
        pace = self.pace
        return None if pace is None else max(self.total - self.done, 0) * pace


def _hms(seconds: float | None) -> str:
    return "?" if seconds is None else str(timedelta(seconds=round(seconds)))


def claim_line(claims) -> str:
    names = sorted({c.document_name for c in claims})
    questions = sum(len(c.questions) for c in claims)
    return (f"claimed {plural(len(claims), 'job')} ({', '.join(str(c.job_id) for c in claims)}) "
            f"of {', '.join(names)}: {plural(questions, 'question')}")


def outcome_line(o: JobOutcome) -> str:
    if o.status == "done" and o.report:
        r = o.report
        return (f"job {o.job_id} done: {plural(r['questions'], 'question')} in "
                f"{r['wall_seconds']:.1f} s ({r['tokens_per_second']:.1f} tok/s, mode {r['mode']})")
    if o.status == "failed":
        return f"job {o.job_id} failed: {o.error}"
    if o.status == "queued":
        return f"job {o.job_id} will be retried: {o.error}"
    if o.status == "released":
        return (f"job {o.job_id} released with {plural(o.answered, 'answer')} saved "
                f"({plural(o.questions, 'question')} in all); another worker can take it now")
    return f"job {o.job_id}: {o.status} ({plural(o.answered, 'answer')} saved)"


def summary_line(s: WorkerSummary) -> str:
    d = s.to_dict()
    line = (f"{plural(d['jobs_done'], 'job')} done, {d['jobs_failed']} failed, "
            f"{d['jobs_retried']} to retry, {d['jobs_released']} released; "
            f"{plural(d['questions_answered'], 'answer')} in {_hms(s.wall_seconds)} "
            f"({d['questions_per_second']:.2f} questions/s, {d['tokens_per_second']:.1f} tok/s)")
    return line + (f"; stopped by {s.stopped_by}" if s.stopped_by else "")


class _Base(ProgressSink):
    def __init__(self, console: Console, waiting_questions) -> None:
        self.console = console
        self.counters = Counters()
        self._waiting_questions = waiting_questions  # () -> answers still queued
        self._read_at: float | None = None  # when the store was last read, and what it said
        self._read = 0
        self._claimed_since = 0  # answers claimed since that read

    def _waiting(self, claimed: int = 0, fresh: bool = False) -> int:
        """Answers still queued: read from the store at most every WAITING_READ_SECONDS (or
        when `fresh`); in between, the last read less the answers this worker has claimed
        since (`claimed`: the claim being counted). The read is a sum over the queue, and a
        worker calls this between two engine steps at each claim and each settled job."""
        now = time.monotonic()
        if not fresh and self._read_at is not None and now - self._read_at < WAITING_READ_SECONDS:
            self._claimed_since += claimed
            return max(0, self._read - self._claimed_since)
        try:
            self._read = self._waiting_questions()
        except Exception:  # noqa: BLE001 - a display figure; the store may be briefly away
            return max(0, self._read - self._claimed_since - claimed)
        self._read_at, self._claimed_since = now, 0
        return self._read

    def _print(self, text: str) -> None:
        self.console.print(redacted(text), markup=False)

    def started(self, options) -> None:
        self._print(f"ppqa run: worker {options.worker_id}, model {options.model} on "
                    f"{options.device}, mode {options.mode}, lease {options.lease_seconds:g} s")

    def message(self, text: str) -> None:
        self._print(text)


class LogProgress(_Base):
    """Log lines: one per claim and settled job, and a progress line every `interval` seconds
    while documents are in flight, printed by a thread of its own from the first claim to
    `finished`, so that a long prefill or a decode of answers that all end late is not silent."""

    def __init__(self, console: Console, waiting_questions, interval: float = 10.0) -> None:
        super().__init__(console, waiting_questions)
        self.interval = interval
        self._last = time.monotonic()
        self._due_lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def claimed(self, claims) -> None:
        self.counters.claim(claims, self._waiting(claimed=sum(c.answers_wanted for c in claims)))
        self._print(claim_line(claims))
        if self._ticker is None and not self._stop.is_set():
            self._ticker = threading.Thread(target=self._tick, name="ppqa-progress-lines",
                                            daemon=True)
            self._ticker.start()

    def answered(self, claim, answer_tokens: int) -> None:
        self.counters.answer(claim, answer_tokens)
        self._progress_if_due()

    def _tick(self) -> None:
        while True:
            left = self.interval - (time.monotonic() - self._last)
            if self._stop.wait(left if left > 0 else self.interval):
                return
            self._progress_if_due()

    def _progress_if_due(self) -> None:
        with self._due_lock:
            if time.monotonic() - self._last < self.interval or not self.counters.in_flight:
                return
            self._last = time.monotonic()
        c = self.counters
        self._print(
            f"progress: {c.done}/{plural(c.total, 'answer')}, {len(c.in_flight)} "
            f"document(s) in flight, {c.tokens_per_second:.1f} tok/s, elapsed "
            f"{_hms(c.elapsed)}, remaining ~{_hms(c.remaining)}")

    def settled(self, outcome: JobOutcome) -> None:
        self.counters.settle(outcome, self._waiting())
        self._print(outcome_line(outcome))

    def finished(self, summary: WorkerSummary) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self.counters.finish(summary, self._waiting(fresh=True))
        self._print(summary_line(summary))


class _RemainingColumn(ProgressColumn):
    """Time left at the worker's pace, recomputed at every refresh (Rich's own column only
    moves when a task advances, so it froze while elapsed time grew)."""

    def __init__(self, counters: Counters, overall_id) -> None:
        super().__init__()
        self.counters, self.overall_id = counters, overall_id

    def render(self, task) -> Text:
        pace = self.counters.pace
        if task.id == self.overall_id:
            left = self.counters.remaining
        else:
            left = None if pace is None or task.total is None else (
                max(task.total - task.completed, 0) * pace)
        return Text(f"left {_hms(left)}", style="progress.remaining")


# Document bars shown at once: a worker may hold dozens of documents (up to a batch of
# requests and a batch waiting), and one line for the rest keeps the display on a screen.
MAX_DOCUMENT_BARS = 8


class RichProgress(_Base):
    def __init__(self, console: Console, waiting_questions) -> None:
        super().__init__(console, waiting_questions)
        self.remaining = _RemainingColumn(self.counters, None)
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                             self.remaining, console=console, transient=False)
        self.overall = self.bars.add_task("all answers", total=None, rate="")
        self.remaining.overall_id = self.overall
        self.doc_tasks: dict[int, int] = {}  # every document in flight, in claim order
        self.more: int | None = None  # the last line: the documents past the bars, together
        self.hidden: set[int] = set()  # the ids of those documents
        self.bars.start()

    def _show_documents(self) -> None:
        """The first MAX_DOCUMENT_BARS documents in flight as bars, one bar for the rest."""
        tasks = {t.id: t for t in self.bars.tasks}
        hidden, self.hidden = [], set()
        for i, (doc_id, task) in enumerate(self.doc_tasks.items()):
            self.bars.update(task, visible=i < MAX_DOCUMENT_BARS)
            if i >= MAX_DOCUMENT_BARS:
                hidden.append(tasks[task])
                self.hidden.add(doc_id)
        if self.more is not None:  # drawn again last, after any bar added since
            self.bars.remove_task(self.more)
            self.more = None
        if hidden:
            self.more = self.bars.add_task(
                f"  and {len(hidden)} more document{'s' * (len(hidden) != 1)}",
                total=sum(t.total or 0 for t in hidden),
                completed=sum(t.completed for t in hidden), rate="")

    def _show_totals(self, description: str = "all answers") -> None:
        self.bars.update(self.overall, total=self.counters.total, completed=self.counters.done,
                         description=description)

    def claimed(self, claims) -> None:
        self.counters.claim(claims, self._waiting(claimed=sum(c.answers_wanted for c in claims)))
        self._show_totals()
        self._print(claim_line(claims))
        for c in claims:
            task = self.doc_tasks.get(c.document_id)
            if task is None:
                self.doc_tasks[c.document_id] = self.bars.add_task(
                    f"  {c.document_name[:40]}", total=c.answers_wanted, rate="")
            else:
                total = next(t.total for t in self.bars.tasks if t.id == task)
                self.bars.update(task, total=total + c.answers_wanted)
        self._show_documents()

    def answered(self, claim, answer_tokens: int) -> None:
        self.counters.answer(claim, answer_tokens)
        self.bars.update(self.overall, completed=self.counters.done,
                         rate=f"{self.counters.tokens_per_second:.1f} tok/s")
        task = self.doc_tasks.get(claim.document_id)
        if task is not None:
            self.bars.advance(task)
            if claim.document_id in self.hidden:
                self.bars.advance(self.more)

    def settled(self, outcome: JobOutcome) -> None:
        doc_id = outcome.document_id
        if self.counters.settle(outcome, self._waiting()) and doc_id in self.doc_tasks:
            self.bars.remove_task(self.doc_tasks.pop(doc_id))
            self._show_documents()
        self._show_totals()
        self._print(outcome_line(outcome))

    def waiting(self) -> None:
        self._show_totals("all answers (waiting for jobs)")

    def finished(self, summary: WorkerSummary) -> None:
        self.counters.finish(summary, self._waiting(fresh=True))
        for task in self.doc_tasks.values():
            self.bars.remove_task(task)
        self.doc_tasks.clear()
        self._show_documents()
        stopped = f" (stopped by {summary.stopped_by})" if summary.stopped_by else ""
        self._show_totals(f"all answers{stopped}")
        self.bars.stop()
        self._print(summary_line(summary))


def make_progress(waiting_questions, *, stream=None) -> ProgressSink:
    """Rich bars when stderr is a terminal, else log lines (PPQA_LOG_INTERVAL seconds apart)."""
    stream = stream or sys.stderr
    console = Console(file=stream, highlight=False, soft_wrap=True)
    if console.is_terminal:
        return RichProgress(console, waiting_questions)
    return LogProgress(console, waiting_questions, _log_interval())


def _log_interval(default: float = 10.0) -> float:
    """PPQA_LOG_INTERVAL seconds, or the default for a value that is not a positive number."""
    try:
        value = float(os.environ.get("PPQA_LOG_INTERVAL", default))
    except ValueError:
        return default
    return value if 0 < value < float("inf") else default
