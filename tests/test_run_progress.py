"""`ppqa run`'s progress renderers: the counts they show, Rich bars on a terminal, log lines elsewhere.

Fed by hand with the store's own `ClaimedJob` and the worker's `JobOutcome`, the way the worker
feeds them; output goes to an in-memory console (forced to act as a terminal for Rich).
"""

from __future__ import annotations

import io
import time
from datetime import datetime
from types import SimpleNamespace

import pytest

from rich.console import Console

from ppqa.cli import run_progress
from ppqa.cli.run_progress import LogProgress, RichProgress, make_progress
from ppqa.store.params import GenerationParams
from ppqa.store.queue import ClaimedJob, ClaimedQuestion
from ppqa.worker.loop import WorkerOptions
from ppqa.worker.report import JobOutcome, WorkerSummary


def _claim(job_id: int, document_id: int, questions: int) -> ClaimedJob:
    return ClaimedJob(job_id, document_id, f"doc-{document_id}", "text", "0" * 64,
                      GenerationParams(), 0, 1, questions,
                      [ClaimedQuestion(100 * job_id + i, i, str(i), f"q{i}?")
                       for i in range(questions)], datetime(2026, 1, 1))


def _outcome(claim: ClaimedJob, status: str, answered: int) -> JobOutcome:
    return JobOutcome(claim.job_id, claim.document_id, claim.document_name, status, answered,
                      claim.question_count, answered * 5)


def test_counts_follow_claims_answers_and_settled_jobs(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(run_progress, "time", SimpleNamespace(monotonic=lambda: now[0]))
    sink = LogProgress(Console(file=io.StringIO()), waiting_questions=lambda: 10)
    a, b = _claim(1, 1, 4), _claim(2, 2, 3)
    sink.claimed([a, b])
    c = sink.counters
    assert (c.done, c.total, len(c.in_flight)) == (0, 4 + 3 + 10, 2)
    now[0] = 130.0  # the first answer waited for the prefill
    sink.answered(a, 5)
    assert c.remaining is None  # one answer gives no pace yet (its wait was the prefill)
    for _ in range(3):
        now[0] += 2.0
        sink.answered(a, 5)
    # 2 s an answer since the first, 17 - 4 questions left; the prefill's 30 s are not a pace
    assert c.remaining == pytest.approx((17 - 4) * 2.0)
    assert c.tokens_per_second == pytest.approx(20 / 36.0)
    sink.answered(b, 5)
    sink.settled(_outcome(a, "done", 4))
    # The failed job's two unanswered questions are no longer this worker's to do.
    sink.settled(_outcome(b, "failed", 1))
    assert (c.done, c.tokens, c.total, c.in_flight) == (5, 25, 15, {})


def test_rich_progress_draws_a_bar_per_document_in_flight():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, highlight=False, color_system=None)
    sink = RichProgress(console, lambda: 0)
    sink.started(WorkerOptions(model="dummy:tiny-mha", worker_id="w1"))
    first, second = _claim(1, 1, 2), _claim(2, 7, 2)
    sink.claimed([first, second])
    sink.answered(first, 3)
    assert _shown(sink) == ["all answers", "doc-1", "doc-7"]
    sink.answered(first, 3)
    sink.settled(_outcome(first, "done", 2))
    sink.settled(_outcome(second, "released", 0))
    assert _shown(sink) == ["all answers"]
    summary = WorkerSummary("w1", "dummy:tiny-mha", "cpu", [_outcome(first, "done", 2)])
    sink.finished(summary)
    text = out.getvalue()
    assert "worker w1, model dummy:tiny-mha" in text and "1 job done" in text
    assert "job 2 released with 0 answers saved" in text  # unfinished work is reported
    assert "claimed 2 jobs (1, 2) of doc-1, doc-7: 4 questions" in text  # per-job lines too


def _shown(sink: RichProgress) -> list[str]:
    """The progress lines drawn, in order."""
    return [t.description.strip() for t in sink.bars.tasks if t.visible]


def test_many_documents_in_flight_show_a_few_bars_and_a_line_for_the_rest():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, highlight=False, color_system=None)
    sink = RichProgress(console, lambda: 0)
    claims = [_claim(i, i, 2) for i in range(1, 12)]
    sink.claimed(claims)
    shown = _shown(sink)
    bars = run_progress.MAX_DOCUMENT_BARS
    assert shown == ["all answers", *[f"doc-{i}" for i in range(1, bars + 1)],
                     f"and {11 - bars} more documents"]
    # A document that ends gives its bar to the next one waiting to be shown.
    sink.claimed([_claim(20, 1, 3)])  # a second job of doc-1: its bar's total grows
    assert next(t.total for t in sink.bars.tasks if t.description.strip() == "doc-1") == 5
    sink.settled(_outcome(claims[1], "done", 2))
    shown = _shown(sink)
    assert "doc-2" not in shown and f"doc-{bars + 1}" in shown
    assert shown[-1] == f"and {10 - bars} more document{'s' * (10 - bars != 1)}"
    last = claims[-1]  # past the bars: its answers advance the last line
    sink.answered(last, 4)
    assert next(t.completed for t in sink.bars.tasks if t.description.strip().startswith("and")) == 1
    for claim in claims[2:]:
        sink.settled(_outcome(claim, "done", 2))
    assert _shown(sink) == ["all answers", "doc-1"]


def test_plain_lines_when_stderr_is_not_a_terminal():
    out = io.StringIO()
    sink = make_progress(lambda: 0, stream=out)
    assert isinstance(sink, LogProgress)
    job = _claim(3, 1, 1)
    sink.claimed([job])
    sink.answered(job, 5)
    sink.settled(JobOutcome(3, 1, "doc-1", "failed", 0, 1, 0, error="document too long"))
    lines = out.getvalue().splitlines()
    assert lines[0] == "claimed 1 job (3) of doc-1: 1 question"
    assert lines[-1] == "job 3 failed: document too long"
    assert "\x1b[" not in out.getvalue()  # no terminal escapes in logs


def test_remaining_time_grows_while_nothing_is_answered(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("ppqa.cli.run_progress.time.monotonic", lambda: now[0])
    sink = LogProgress(Console(file=io.StringIO()), waiting_questions=lambda: 0)
    job = _claim(1, 1, 4)
    sink.claimed([job])
    for t in (101.0, 102.0):
        now[0] = t
        sink.answered(job, 5)
    assert sink.counters.remaining == 2.0  # 2 questions left at 1 s each
    now[0] = 110.0  # eight seconds without an answer: the pace so far is slower
    assert sink.counters.remaining == 18.0


def test_a_stopped_run_does_not_read_as_finished():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, highlight=False, color_system=None)
    waiting = [0]
    sink = RichProgress(console, lambda: waiting[0])
    job = _claim(1, 1, 5)
    sink.claimed([job])
    sink.answered(job, 3)
    sink.answered(job, 3)
    waiting[0] = 3  # released: its three open questions are back in the queue
    sink.settled(_outcome(job, "released", 2))
    sink.finished(WorkerSummary("w1", "m", "cpu", [_outcome(job, "released", 2)],
                                stopped_by="SIGINT"))
    overall = sink.bars.tasks[0]
    assert (overall.completed, overall.total) == (2, 5)
    assert "stopped by SIGINT" in overall.description


def test_total_follows_what_other_workers_took():
    # Two workers on one queue: this one claimed 2 questions while 4 more waited; the other
    # worker took those 4, so at the end this worker's bar reads 2/2, not 2/6.
    waiting = [4]
    sink = LogProgress(Console(file=io.StringIO()), waiting_questions=lambda: waiting[0])
    job = _claim(1, 1, 2)
    sink.claimed([job])
    assert sink.counters.total == 6
    sink.answered(job, 1)
    sink.answered(job, 1)
    waiting[0] = 0
    sink.settled(_outcome(job, "done", 2))
    sink.finished(WorkerSummary("w1", "m", "cpu", [_outcome(job, "done", 2)]))
    assert (sink.counters.done, sink.counters.total) == (2, 2)


def test_log_lines_keep_coming_while_nothing_is_answered():
    """A long prefill answers nothing for a while: the log still gets a progress line every
    interval while documents are in flight, and none after the worker has finished."""
    out = io.StringIO()
    sink = LogProgress(Console(file=out, width=200), waiting_questions=lambda: 0, interval=0.05)
    job = _claim(1, 1, 4)
    sink.claimed([job])
    deadline = time.monotonic() + 10
    while out.getvalue().count("progress: 0/4 answers") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert out.getvalue().count("progress: 0/4 answers, 1 document(s) in flight") >= 2
    sink.settled(_outcome(job, "released", 0))
    sink.finished(WorkerSummary("w1", "m", "cpu", [_outcome(job, "released", 0)]))
    ended = out.getvalue()
    time.sleep(0.2)
    assert out.getvalue() == ended and ended.splitlines()[-1].startswith("0 jobs done")


def test_the_queue_is_read_at_most_every_interval_and_claims_come_off_the_last_read(
        monkeypatch):
    """The waiting answers are a sum over the queue: read at the first claim, then at most
    every WAITING_READ_SECONDS; in between, this worker's claims are taken off the last read,
    and the worker's end always reads it again."""
    now = [100.0]
    monkeypatch.setattr(run_progress, "time", SimpleNamespace(monotonic=lambda: now[0]))
    reads, queued = [], [20]

    def waiting():
        reads.append(now[0])
        return queued[0]

    sink = LogProgress(Console(file=io.StringIO()), waiting_questions=waiting)
    a, b, c = _claim(1, 1, 4), _claim(2, 2, 3), _claim(3, 3, 2)
    queued[0] = 16  # the store, read after the claim, no longer holds a's questions
    sink.claimed([a])
    assert reads == [100.0] and sink.counters.total == 4 + 16
    now[0] += run_progress.WAITING_READ_SECONDS / 2
    queued[0] = 13
    sink.claimed([b])
    assert len(reads) == 1 and sink.counters.total == 4 + 3 + 13  # 16 read, less b's 3
    sink.settled(_outcome(a, "done", 0))
    assert len(reads) == 1 and sink.counters.total == 3 + 13
    now[0] += run_progress.WAITING_READ_SECONDS
    queued[0] = 30  # another 19 ingested meanwhile
    sink.claimed([c])
    assert len(reads) == 2 and sink.counters.total == 3 + 2 + 30
    queued[0] = 0
    sink.finished(WorkerSummary("w1", "m", "cpu", []))
    assert len(reads) == 3 and sink.counters.total == 0
