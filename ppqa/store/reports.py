"""Per-run speed reports: the `JobReport` a worker hands to `queue.finish_job`, and listing them.

The worker measures a job's run (wall, prefill and decode seconds, tokens, peak memory) and
builds a `JobReport`; `finish_job` stores it as a `reports` row; `ppqa report` and `ppqa show`
read them back with `list_reports`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from sqlalchemy import func, select

from ppqa.store.db import Database
from ppqa.store.timefmt import iso
from ppqa.store.models import Report


@dataclass
class JobReport:
    device: str
    model: str
    mode: str
    wall_seconds: float
    questions: int
    prompt_tokens: int
    answer_tokens: int
    streams: int | None = None
    batch_size: int | None = None
    prefill_seconds: float | None = None
    decode_seconds: float | None = None
    tokens_per_second: float | None = None  # default: answer_tokens / wall_seconds
    questions_per_second: float | None = None  # default: questions / wall_seconds
    peak_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("device", "model", "mode"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"JobReport.{name} must be a non-empty string, got {value!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("device", "model", "mode") or value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"JobReport.{f.name} must be a number >= 0, got {value!r}")
        if self.tokens_per_second is None:
            self.tokens_per_second = _rate(self.answer_tokens, self.wall_seconds)
        if self.questions_per_second is None:
            self.questions_per_second = _rate(self.questions, self.wall_seconds)

    @classmethod
    def from_dict(cls, data: dict) -> JobReport:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown report field(s): {', '.join(unknown)}")
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


REPORT_COLUMNS = ("id", "job_id", "worker", "device", "model", "mode", "streams", "batch_size",
                  "wall_seconds", "prefill_seconds", "decode_seconds", "questions",
                  "prompt_tokens", "answer_tokens", "tokens_per_second", "questions_per_second",
                  "peak_memory_bytes", "created_at")


def list_reports(db: Database, job_id: int | None = None, last: int | None = None
                 ) -> list[dict]:
    """Report rows as JSON-ready dicts, oldest first (all jobs, or one); `last`: only the
    latest that many."""
    stmt = select(*[getattr(Report, c) for c in REPORT_COLUMNS]).order_by(Report.id.desc())
    if job_id is not None:
        stmt = stmt.where(Report.job_id == job_id)
    if last is not None:
        stmt = stmt.limit(last)
    with db.read() as conn:
        rows = conn.execute(stmt).mappings().all()
    return [{**row, "created_at": iso(row["created_at"])} for row in reversed(rows)]


def count_reports(db: Database, job_id: int | None = None) -> int:
    """How many reports the store holds (of one job)."""
    stmt = select(func.count(Report.id))
    if job_id is not None:
        stmt = stmt.where(Report.job_id == job_id)
    with db.read() as conn:
        return int(conn.execute(stmt).scalar_one())
