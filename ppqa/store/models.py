"""The job store's schema as SQLAlchemy 2.0 ORM classes: the one description of every table.

Migrations (`migrations.py`) must build exactly this schema (a test compares them); the queue and
the services (`queue.py`, `jobs.py`, `export.py`) query these classes with Core-style statements
on a Connection. Timestamps are naive UTC datetimes. No torch here, ever.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer,
                        LargeBinary, MetaData, String, Text, UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names, so that a migrated database and `create_all` agree and a
# later migration can name what it changes.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

from ppqa.store.status import (CANCELLED, DONE, FAILED, JOB_STATUSES, QUEUED,  # noqa: F401
                               RUNNING)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class MigrationRecord(Base):
    """One applied migration (append-only, by name)."""

    __tablename__ = "ppqa_migrations"
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    applied_at: Mapped[datetime] = mapped_column(DateTime)


class Document(Base):
    """A document's text, stored once however many jobs ask about it."""

    __tablename__ = "documents"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(500))
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class Job(Base):
    """One ingest: a document, a question set and generation parameters, with its queue state."""

    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    document_id: Mapped[int] = mapped_column(ForeignKey("documents.id"), index=True)
    question_count: Mapped[int] = mapped_column(Integer)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    # sha256 of (document, questions, params): finds an identical job at ingest.
    job_key: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16))
    priority: Mapped[int] = mapped_column(Integer)
    attempts: Mapped[int] = mapped_column(Integer)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    started_at: Mapped[datetime | None] = mapped_column(DateTime)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime)
    error: Mapped[str | None] = mapped_column(Text)
    # Added by migration 0003: the model a job asks for (None: whatever the worker runs),
    # a column so that claims can filter on it in SQL.
    model: Mapped[str | None] = mapped_column(String(200), index=True)
    # Added by migration 0007: the text of a user's template (params.template holds its path,
    # for messages), so that editing or deleting the file after ingest changes no queued job
    # and workers on other hosts need no copy. None for built-in templates.
    template_source: Mapped[str | None] = mapped_column(Text)
    # Added by migration 0009: answers wanted per question (params.samples), a column so that
    # the claim's "is anything left to answer" test runs in SQL.
    samples: Mapped[int] = mapped_column(Integer, server_default="1")

    # The claim's index ranges (store/claim_order.py): by priority and age, and for a worker
    # of one model, by model first (added by migration 0010).
    __table_args__ = (Index("ix_jobs_claim_order", "status", "priority", "created_at"),
                      Index("ix_jobs_claim_model", "status", "model", "priority", "created_at"))


class Question(Base):
    __tablename__ = "questions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)  # 0-based order in the questions file
    custom_id: Mapped[str] = mapped_column(String(200))
    text: Mapped[str] = mapped_column(Text)
    # Added by migration 0008: the labels a question is answered from (a JSON list of
    # strings), or None for a question whose answer is generated.
    choices: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))

    __table_args__ = (UniqueConstraint("job_id", "position"), UniqueConstraint("job_id", "custom_id"))


class Answer(Base):
    """Exactly one per question and sample (the unique constraint is what makes re-runs safe);
    a job without samples has sample 0 only."""

    __tablename__ = "answers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    question_id: Mapped[int] = mapped_column(ForeignKey("questions.id", ondelete="CASCADE"))
    text: Mapped[str] = mapped_column(Text)
    token_count: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(32))
    total_seconds: Mapped[float | None] = mapped_column(Float)
    worker: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # Added by migration 0008, for a question with choices: the chosen label, and every
    # choice's log-probability and probability ([{"choice", "logprob", "prob"}], in order).
    choice: Mapped[str | None] = mapped_column(Text)
    choice_scores: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))
    # Added by migration 0009: which of the question's samples (0 .. jobs.samples - 1).
    sample: Mapped[int] = mapped_column(Integer, server_default="0")

    __table_args__ = (UniqueConstraint("question_id", "sample"),)


class Report(Base):
    """Speed figures of one run of one job (a job resumed after a crash has several)."""

    __tablename__ = "reports"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    worker: Mapped[str] = mapped_column(String(200))
    device: Mapped[str] = mapped_column(String(100))
    model: Mapped[str] = mapped_column(String(200))
    mode: Mapped[str] = mapped_column(String(32))
    streams: Mapped[int | None] = mapped_column(Integer)
    batch_size: Mapped[int | None] = mapped_column(Integer)
    wall_seconds: Mapped[float] = mapped_column(Float)
    prefill_seconds: Mapped[float | None] = mapped_column(Float)
    decode_seconds: Mapped[float | None] = mapped_column(Float)
    questions: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    answer_tokens: Mapped[int] = mapped_column(Integer)
    tokens_per_second: Mapped[float] = mapped_column(Float)
    questions_per_second: Mapped[float] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class OpenAIFile(Base):
    """A file uploaded through `ppqa serve`'s /v1/files, or a batch's output or error file.
    Its bytes live here, so the server never reads or writes a path a client names."""

    __tablename__ = "openai_files"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    public_id: Mapped[str] = mapped_column(String(64), unique=True)  # "file-..."
    filename: Mapped[str] = mapped_column(String(500))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(Integer)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class OpenAIBatch(Base):
    """An OpenAI Batch: from /v1/batches, or from `ppqa ingest --openai-batch` (no input file).
    Its requests became jobs (see OpenAIRequest); its status follows theirs."""

    __tablename__ = "openai_batches"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    public_id: Mapped[str] = mapped_column(String(64), unique=True)  # "batch_..."
    endpoint: Mapped[str] = mapped_column(String(100))
    completion_window: Mapped[str] = mapped_column(String(16))
    input_file_id: Mapped[str | None] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(200))  # whose chat template rendered the requests
    status: Mapped[str] = mapped_column(String(16))
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    errors: Mapped[list[Any] | None] = mapped_column(JSON)  # validation errors (status failed)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime)
    failed_at: Mapped[datetime | None] = mapped_column(DateTime)
    expired_at: Mapped[datetime | None] = mapped_column(DateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime)


class OpenAIRequest(Base):
    """One choice of one request line of a batch: the question that answers it. A request
    asking for n choices has n rows (choice 0..n-1), each a question of its own job."""

    __tablename__ = "openai_requests"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    batch_id: Mapped[int] = mapped_column(ForeignKey("openai_batches.id", ondelete="CASCADE"))
    line: Mapped[int] = mapped_column(Integer)  # 1-based line in the input file: output order
    choice: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(Text)
    question_id: Mapped[int] = mapped_column(
        ForeignKey("questions.id", ondelete="CASCADE"), unique=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer)

    __table_args__ = (UniqueConstraint("batch_id", "line", "choice"),)
