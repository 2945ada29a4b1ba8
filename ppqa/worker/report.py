"""The worker's bookkeeping: per-job progress in a cycle, speed reports, outcomes and the summary.

`JobRun` follows one claimed job from its claim (answers saved, tokens, device time, errors, a
lost lease); `job_report` turns it into the `JobReport` stored by `finish_job`;
`JobOutcome` is how each job ended, collected into the `WorkerSummary` that `ppqa run --json`
prints. `ProgressSink` is what the worker tells whoever watches it (the base ignores it all).
No torch, no terminal here.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ppqa.choices import score_records
from ppqa.store import queue
from ppqa.store.db import Database, error_reason
from ppqa.store.queue import ClaimedJob
from ppqa.store.reports import JobReport


@dataclass
class JobRun:
    claim: ClaimedJob
    started_at: float = 0.0  # perf_counter time of the claim
    # An answer wanted is a (question id, sample) pair (sample 0 when the job draws one).
    pending: set[tuple[int, int]] = field(default_factory=set)  # without a saved answer
    outstanding: set[tuple[int, int]] = field(default_factory=set)  # not answered or rejected
    answered: int = 0
    prompt_tokens: int = 0  # as the engine counts them per question (document + question)
    answer_tokens: int = 0
    prefill_seconds: float = 0.0  # the engine's device time charged to this job's answers
    decode_seconds: float = 0.0
    modes: set[str] = field(default_factory=set)
    streams: int = 0
    last_answer_at: float | None = None
    error: str | None = None
    permanent: bool = False  # retrying cannot help (the prompt does not fit the model)
    lost: bool = False  # cancelled or taken over: not ours to finish
    unsaved: list = field(default_factory=list)  # ((question id, sample), answer, exception)

    def __post_init__(self) -> None:
        self.pending = {(q.id, s) for q in self.claim.questions for s in q.samples}
        self.outstanding = set(self.pending)

    @property
    def complete(self) -> bool:
        return not self.pending

    @property
    def settleable(self) -> bool:
        """Nothing of it is left in the engine: every question answered or rejected, or lost."""
        return self.lost or not self.outstanding

    def reject(self, wanted: tuple[int, int], error: str, *, permanent: bool) -> None:
        """The engine will not give this answer; the first reason is the one shown."""
        self.outstanding.discard(wanted)
        if self.error is None:
            self.error, self.permanent = error, permanent

    def add_answer(self, wanted: tuple[int, int], answer, at: float) -> None:
        self.outstanding.discard(wanted)
        if wanted in self.pending:
            self.pending.discard(wanted)
            self.answered += 1
            self.answer_tokens += len(answer.token_ids)
            self.prompt_tokens += answer.prompt_tokens
            self.prefill_seconds += getattr(answer, "prefill_s", 0.0)
            self.decode_seconds += getattr(answer, "decode_s", 0.0)
            self.modes.add(getattr(answer, "mode", None) or "stock")
            self.streams = max(self.streams, getattr(answer, "streams", 1))
            self.last_answer_at = at

    def save_unsaved(self, db: Database, worker_id: str) -> None:
        """Second try for answers whose first write failed (a database briefly unreachable)."""
        still = []
        for wanted, answer, _ in self.unsaved:
            tokens = len(answer.token_ids)
            try:
                queue.record_answer(db, wanted[0], answer.text, tokens, answer.finish_reason,
                                    total_seconds=answer.latency_s, worker_id=worker_id,
                                    choice_scores=choice_scores(answer), sample=wanted[1])
            except Exception as exc:  # noqa: BLE001 - the job is then released, not finished
                still.append((wanted, answer, exc))
                continue
            self.add_answer(wanted, answer, time.perf_counter())
        self.unsaved = still
        if still and self.error is None:
            self.error = (f"{len(still)} answer(s) could not be saved: "
                          f"{error_reason(still[-1][2])}")


def answer_row(wanted: tuple[int, int], answer) -> tuple:
    """The row `queue.record_answers` stores for an engine `Answer` of (question id, sample)."""
    return (wanted[0], answer.text, len(answer.token_ids), answer.finish_reason,
            answer.latency_s, choice_scores(answer), wanted[1])


def choice_scores(answer) -> list[dict] | None:
    """A chosen answer's per-choice scores as the store keeps them; None for a generated one."""
    if getattr(answer, "choices", None) is None:
        return None
    return score_records(answer.choices, answer.choice_logprobs, answer.choice_probs)


def job_report(run: JobRun, options, peak_memory_bytes: int = 0,
               batch_size: int | None = None) -> JobReport:
    """The speed report of one job: wall time from its claim to its last answer; prefill and
    decode seconds are the engine's device time charged to this job's own answers (a step
    shared by several jobs is split between them), so the rows of one run add up. Prompt
    tokens count document + question per question, as the engine's `Answer.prompt_tokens`."""
    end = run.last_answer_at or time.perf_counter()
    wall = max(end - run.started_at, 1e-9)
    mode = run.modes.pop() if len(run.modes) == 1 else ("mixed" if run.modes else options.mode)
    return JobReport(
        device=options.device, model=options.model, mode=mode,
        wall_seconds=wall, questions=run.answered, prompt_tokens=run.prompt_tokens,
        answer_tokens=run.answer_tokens, streams=run.streams or None,
        batch_size=batch_size or None, prefill_seconds=run.prefill_seconds,
        decode_seconds=run.decode_seconds,
        peak_memory_bytes=peak_memory_bytes or None)  # 0: not measured (CPU)


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


@dataclass
class JobOutcome:
    job_id: int
    document_id: int
    document: str
    status: str  # done | queued (to retry) | failed | released | lost | cancelled
    answered: int  # questions answered in this run
    questions: int  # all of the job's questions
    answer_tokens: int = 0  # generated in this run
    error: str | None = None
    report: dict | None = None

    @classmethod
    def of(cls, run: JobRun, status: str, *, error: str | None = None,
           report: JobReport | None = None) -> JobOutcome:
        return cls(run.claim.job_id, run.claim.document_id, run.claim.document_name, status,
                   run.answered, run.claim.question_count, run.answer_tokens, error,
                   report.to_dict() if report else None)


@dataclass
class WorkerSummary:
    worker_id: str
    model: str
    device: str
    jobs: list[JobOutcome] = field(default_factory=list)
    wall_seconds: float = 0.0
    stopped_by: str | None = None
    last_error: str | None = None

    def add(self, outcome: JobOutcome) -> None:
        self.jobs.append(outcome)

    def count(self, status: str) -> int:
        return sum(1 for j in self.jobs if j.status == status)

    @property
    def questions(self) -> int:
        return sum(j.answered for j in self.jobs)

    @property
    def answer_tokens(self) -> int:
        return sum(j.answer_tokens for j in self.jobs)

    def to_dict(self) -> dict:
        wall = self.wall_seconds
        return {
            "worker": self.worker_id, "model": self.model, "device": self.device,
            "jobs_done": self.count("done"), "jobs_failed": self.count("failed"),
            "jobs_retried": self.count("queued"), "jobs_released": self.count("released"),
            "questions_answered": self.questions, "answer_tokens": self.answer_tokens,
            "wall_seconds": round(wall, 3),
            "questions_per_second": round(self.questions / wall, 3) if wall > 0 else 0.0,
            "tokens_per_second": round(self.answer_tokens / wall, 3) if wall > 0 else 0.0,
            "stopped_by": self.stopped_by, "jobs": [asdict(j) for j in self.jobs],
        }


class ProgressSink:
    """What a worker reports while it runs; subclasses render it (see `ppqa/cli/run_progress.py`)."""

    def started(self, options) -> None: ...

    def claimed(self, claims: list[ClaimedJob]) -> None: ...

    def answered(self, claim: ClaimedJob, answer_tokens: int) -> None: ...

    def settled(self, outcome: JobOutcome) -> None: ...

    def waiting(self) -> None: ...

    def message(self, text: str) -> None: ...

    def finished(self, summary: WorkerSummary) -> None: ...
