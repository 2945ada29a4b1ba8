"""A worker's progress as JSON lines, so that one process can show many workers' progress.

A worker started by `ppqa run --gpus` (worker/pool.py) reports through `EventSink`: every
`ProgressSink` call becomes one JSON line on its stdout (claims reduced to the figures a display
needs: job, document, name, question and answer counts). The parent reads each child's lines and `replay`s
them on its own renderer, so several workers share one progress display, and `summary_of` turns
a child's final line back into the `WorkerSummary` the parent merges into one. No torch here.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass

from ppqa.worker.report import JobOutcome, ProgressSink, WorkerSummary


@dataclass(frozen=True)
class ClaimView:
    """What a progress display knows of a claim made in another process."""

    job_id: int
    document_id: int
    document_name: str
    questions: range  # only its length is shown
    answers_wanted: int  # one per question, or per missing sample


def _claim(c) -> dict:
    return {"job_id": c.job_id, "document_id": c.document_id,
            "document_name": c.document_name, "questions": len(c.questions),
            "answers_wanted": c.answers_wanted}


class EventSink(ProgressSink):
    """Writes each event as one JSON line on `stream` (from the worker and its lease thread)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def _emit(self, event: str, **data) -> None:
        line = json.dumps({"event": event, **data}, ensure_ascii=False)
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()

    def started(self, options) -> None:
        self._emit("started", worker_id=options.worker_id, device=options.device)

    def claimed(self, claims) -> None:
        self._emit("claimed", claims=[_claim(c) for c in claims])

    def answered(self, claim, answer_tokens: int) -> None:
        self._emit("answered", claim=_claim(claim), tokens=answer_tokens)

    def settled(self, outcome: JobOutcome) -> None:
        self._emit("settled", outcome=asdict(outcome))

    def waiting(self) -> None:
        self._emit("waiting")

    def message(self, text: str) -> None:
        self._emit("message", text=text)

    def finished(self, summary: WorkerSummary) -> None:
        self._emit("finished", summary=summary.to_dict(), last_error=summary.last_error)


def _view(data: dict) -> ClaimView:
    return ClaimView(data["job_id"], data["document_id"], data["document_name"],
                     range(data["questions"]), data["answers_wanted"])


def summary_of(event: dict) -> WorkerSummary:
    """The `WorkerSummary` a child's "finished" line describes."""
    data = event["summary"]
    return WorkerSummary(worker_id=data["worker"], model=data["model"], device=data["device"],
                         jobs=[JobOutcome(**job) for job in data["jobs"]],
                         wall_seconds=data["wall_seconds"], stopped_by=data["stopped_by"],
                         last_error=event.get("last_error"))


def replay(line: str, sink: ProgressSink, label: str) -> dict | None:
    """Show one child's line on `sink` (its own messages prefixed with `label`); returns the
    event. A line that is not an event (a stray print) is shown as a message."""
    try:
        event = json.loads(line)
        kind = event["event"]
    except (ValueError, KeyError, TypeError):
        sink.message(f"[{label}] {line.rstrip()}")
        return None
    if kind == "started":
        sink.message(f"[{label}] worker {event['worker_id']} started on {event['device']}")
    elif kind == "claimed":
        sink.claimed([_view(c) for c in event["claims"]])
    elif kind == "answered":
        sink.answered(_view(event["claim"]), event["tokens"])
    elif kind == "settled":
        sink.settled(JobOutcome(**event["outcome"]))
    elif kind == "message":
        sink.message(f"[{label}] {event['text']}")
    # "waiting" and "finished" are the parent's to show, once for all workers
    return event
