"""Append-only, named schema migrations, recorded in the `ppqa_migrations` table.

`migrate(db)` applies, in order and each in the same write transaction as its record, every
migration of `MIGRATIONS` not yet recorded. Never edit or reorder a migration that has shipped:
add a new one. Table definitions here are frozen copies of the schema as it was at that step,
so they do not follow later edits of `models.py`; a test checks that migrating a blank database
gives exactly `models.Base.metadata`, and that a database at migration 0001 upgrades in place.

Several processes may open a new store at once (three workers starting together): the first to
take the write lock (SQLite `BEGIN IMMEDIATE`, PostgreSQL an advisory lock) migrates; the others
then find nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone

from sqlalchemy import (JSON, BigInteger, Column, Connection, DateTime, Float, ForeignKey,
                        ForeignKeyConstraint, Index, Integer, LargeBinary, MetaData,
                        PrimaryKeyConstraint, String, Table, Text, UniqueConstraint, inspect,
                        select, text)

from ppqa.store.models import NAMING_CONVENTION, MigrationRecord

# Any fixed 64-bit number: the PostgreSQL advisory lock that serializes migrations.
_PG_MIGRATION_LOCK = 7_040_911_236


def _m0001_initial(conn: Connection) -> None:
    """documents, jobs, questions, answers."""
    md = MetaData(naming_convention=NAMING_CONVENTION)
    Table("documents", md,
          Column("id", Integer, primary_key=True),
          Column("sha256", String(64), nullable=False, unique=True),
          Column("name", String(500), nullable=False),
          Column("text", Text, nullable=False),
          Column("created_at", DateTime, nullable=False))
    Table("jobs", md,
          Column("id", Integer, primary_key=True),
          Column("document_id", Integer, ForeignKey("documents.id"), nullable=False, index=True),
          Column("question_count", Integer, nullable=False),
          Column("params", JSON, nullable=False),
          Column("job_key", String(64), nullable=False, index=True),
          Column("status", String(16), nullable=False),
          Column("priority", Integer, nullable=False),
          Column("attempts", Integer, nullable=False),
          Column("lease_owner", String(200)),
          Column("lease_expires_at", DateTime),
          Column("created_at", DateTime, nullable=False),
          Column("started_at", DateTime),
          Column("finished_at", DateTime),
          Column("error", Text),
          Index("ix_jobs_claim_order", "status", "priority", "created_at"))
    Table("questions", md,
          Column("id", Integer, primary_key=True),
          Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
          Column("position", Integer, nullable=False),
          Column("custom_id", String(200), nullable=False),
          Column("text", Text, nullable=False),
          UniqueConstraint("job_id", "position"),
          UniqueConstraint("job_id", "custom_id"))
    Table("answers", md,
          Column("id", Integer, primary_key=True),
          Column("question_id", Integer, ForeignKey("questions.id", ondelete="CASCADE"),
                 nullable=False, unique=True),
          Column("text", Text, nullable=False),
          Column("token_count", Integer, nullable=False),
          Column("finish_reason", String(32), nullable=False),
          Column("first_token_seconds", Float),
          Column("total_seconds", Float),
          Column("worker", String(200)),
          Column("created_at", DateTime, nullable=False))
    md.create_all(conn)


def _m0002_reports(conn: Connection) -> None:
    """Per-run speed reports (the worker writes one when it finishes a job)."""
    md = MetaData(naming_convention=NAMING_CONVENTION)
    Table("jobs", md, Column("id", Integer, primary_key=True))  # only for the foreign key
    reports = Table(
        "reports", md,
        Column("id", Integer, primary_key=True),
        Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False,
               index=True),
        Column("worker", String(200), nullable=False),
        Column("device", String(100), nullable=False),
        Column("model", String(200), nullable=False),
        Column("mode", String(32), nullable=False),
        Column("streams", Integer),
        Column("batch_size", Integer),
        Column("wall_seconds", Float, nullable=False),
        Column("prefill_seconds", Float),
        Column("decode_seconds", Float),
        Column("questions", Integer, nullable=False),
        Column("prompt_tokens", Integer, nullable=False),
        Column("answer_tokens", Integer, nullable=False),
        Column("tokens_per_second", Float, nullable=False),
        Column("questions_per_second", Float, nullable=False),
        Column("peak_memory_bytes", BigInteger),
        Column("created_at", DateTime, nullable=False))
    reports.create(conn)


def _m0003_job_model(conn: Connection) -> None:
    """jobs.model: the model a job asks for, as a column so claims can filter on it in SQL."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN model VARCHAR(200)"))
    md = MetaData(naming_convention=NAMING_CONVENTION)
    jobs = Table("jobs", md, Column("model", String(200)))
    Index("ix_jobs_model", jobs.c.model).create(conn)
    # Jobs ingested before this column existed carry their model in params.
    rows = conn.execute(text("SELECT id, params FROM jobs")).all()
    for job_id, params in rows:
        model = _json_value(params).get("model")
        if model:
            conn.execute(text("UPDATE jobs SET model = :m WHERE id = :i"), {"m": model, "i": job_id})


def _m0005_drop_first_token_seconds(conn: Connection) -> None:
    """answers.first_token_seconds goes: nothing ever wrote it (SQLite 3.35+ drops columns)."""
    conn.execute(text("ALTER TABLE answers DROP COLUMN first_token_seconds"))


def _m0006_openai_batches(conn: Connection) -> None:
    """OpenAI Files and Batches (`ppqa serve`, `ppqa ingest --openai-batch`): uploaded and
    generated files, batches, and which question answers each request line's choice."""
    md = MetaData(naming_convention=NAMING_CONVENTION)
    Table("questions", md, Column("id", Integer, primary_key=True))  # only for the foreign key
    Table("openai_files", md,
          Column("id", Integer, primary_key=True),
          Column("public_id", String(64), nullable=False, unique=True),
          Column("filename", String(500), nullable=False),
          Column("purpose", String(32), nullable=False),
          Column("bytes", Integer, nullable=False),
          Column("content", LargeBinary, nullable=False),
          Column("created_at", DateTime, nullable=False))
    Table("openai_batches", md,
          Column("id", Integer, primary_key=True),
          Column("public_id", String(64), nullable=False, unique=True),
          Column("endpoint", String(100), nullable=False),
          Column("completion_window", String(16), nullable=False),
          Column("input_file_id", String(64)),
          Column("model", String(200), nullable=False),
          Column("status", String(16), nullable=False),
          Column("user_metadata", JSON),
          Column("errors", JSON),
          Column("output_file_id", String(64)),
          Column("error_file_id", String(64)),
          Column("created_at", DateTime, nullable=False),
          *(Column(f"{event}_at", DateTime) for event in (
              "expires", "in_progress", "finalizing", "completed", "failed", "expired",
              "cancelling", "cancelled")))
    Table("openai_requests", md,
          Column("id", Integer, primary_key=True),
          Column("batch_id", Integer, ForeignKey("openai_batches.id", ondelete="CASCADE"),
                 nullable=False),
          Column("line", Integer, nullable=False),
          Column("choice", Integer, nullable=False),
          Column("custom_id", Text, nullable=False),
          Column("question_id", Integer, ForeignKey("questions.id", ondelete="CASCADE"),
                 nullable=False, unique=True),
          Column("prompt_tokens", Integer, nullable=False),
          UniqueConstraint("batch_id", "line", "choice"))
    for name in ("openai_files", "openai_batches", "openai_requests"):
        md.tables[name].create(conn)


def _m0007_template_source(conn: Connection) -> None:
    """jobs.template_source: a user template's text, stored with the job at ingest. Jobs
    queued before keep only the path, which the worker still reads."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN template_source TEXT"))


def _m0008_choices(conn: Connection) -> None:
    """questions.choices (the labels of a question answered by choosing), answers.choice and
    answers.choice_scores (the chosen label; each choice's log-probability and probability)."""
    conn.execute(text("ALTER TABLE questions ADD COLUMN choices JSON"))
    conn.execute(text("ALTER TABLE answers ADD COLUMN choice TEXT"))
    conn.execute(text("ALTER TABLE answers ADD COLUMN choice_scores JSON"))


def _m0009_samples(conn: Connection) -> None:
    """jobs.samples (answers wanted per question) and answers.sample: answers are unique per
    (question, sample), no longer per question. SQLite cannot drop a constraint, so there the
    answers table is rebuilt (nothing refers to it) and its rows copied as sample 0."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN samples INTEGER NOT NULL DEFAULT 1"))
    if conn.dialect.name != "sqlite":
        conn.execute(text("ALTER TABLE answers ADD COLUMN sample INTEGER NOT NULL DEFAULT 0"))
        conn.execute(text("ALTER TABLE answers DROP CONSTRAINT uq_answers_question_id"))
        conn.execute(text("ALTER TABLE answers ADD CONSTRAINT uq_answers_question_id_sample "
                          "UNIQUE (question_id, sample)"))
        return
    md = MetaData()
    Table("questions", md, Column("id", Integer, primary_key=True))  # only for the foreign key
    columns = ("id", "question_id", "text", "token_count", "finish_reason", "total_seconds",
               "worker", "created_at", "choice", "choice_scores")
    new = Table("answers_new", md,
                Column("id", Integer, primary_key=True),
                Column("question_id", Integer, nullable=False),
                Column("text", Text, nullable=False),
                Column("token_count", Integer, nullable=False),
                Column("finish_reason", String(32), nullable=False),
                Column("total_seconds", Float),
                Column("worker", String(200)),
                Column("created_at", DateTime, nullable=False),
                Column("choice", Text),
                Column("choice_scores", JSON),
                Column("sample", Integer, nullable=False, server_default=text("0")),
                PrimaryKeyConstraint("id", name="pk_answers"),
                ForeignKeyConstraint(["question_id"], ["questions.id"], ondelete="CASCADE",
                                     name="fk_answers_question_id_questions"),
                UniqueConstraint("question_id", "sample", name="uq_answers_question_id_sample"))
    new.create(conn)
    names = ", ".join(columns)
    conn.execute(text(f"INSERT INTO answers_new ({names}) SELECT {names} FROM answers"))
    conn.execute(text("DROP TABLE answers"))
    conn.execute(text("ALTER TABLE answers_new RENAME TO answers"))


def _m0010_claim_by_model(conn: Connection) -> None:
    """An index of the claim order by model: a worker of one model reads its queued jobs (and
    those of no model) as index ranges, not past every queued job of other models."""
    md = MetaData(naming_convention=NAMING_CONVENTION)
    jobs = Table("jobs", md, Column("status", String(16)), Column("model", String(200)),
                 Column("priority", Integer), Column("created_at", DateTime))
    Index("ix_jobs_claim_model", jobs.c.status, jobs.c.model, jobs.c.priority,
          jobs.c.created_at).create(conn)


def _json_value(raw) -> dict:
    import json

    if isinstance(raw, dict):
        return raw
    return json.loads(raw) if raw else {}


MIGRATIONS: list[tuple[str, Callable[[Connection], None]]] = [
    ("0001_initial", _m0001_initial),
    ("0002_reports", _m0002_reports),
    ("0003_job_model", _m0003_job_model),
    ("0005_drop_first_token_seconds", _m0005_drop_first_token_seconds),
    ("0006_openai_batches", _m0006_openai_batches),
    ("0007_template_source", _m0007_template_source),
    ("0008_choices", _m0008_choices),
    ("0009_samples", _m0009_samples),
    ("0010_claim_by_model", _m0010_claim_by_model),
]


def applied_migrations(conn: Connection) -> list[str]:
    if not inspect(conn).has_table(MigrationRecord.__tablename__):
        return []
    return list(conn.execute(select(MigrationRecord.name)).scalars())


def migrate(db, *, upto: str | None = None) -> list[str]:
    """Apply pending migrations (all, or up to and including `upto`); return the names applied."""
    names = [name for name, _ in MIGRATIONS]
    if upto is not None and upto not in names:
        raise ValueError(f"unknown migration {upto!r}; known: {', '.join(names)}")
    wanted = names if upto is None else names[: names.index(upto) + 1]
    with db.read() as conn:  # the common case: nothing to do, and no write lock taken
        if set(wanted) <= set(applied_migrations(conn)):
            return []
    applied_now: list[str] = []
    with db.write() as conn:
        if db.dialect == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
        MigrationRecord.__table__.create(conn, checkfirst=True)
        done = set(applied_migrations(conn))
        for name, step in MIGRATIONS:
            if name not in wanted or name in done:
                continue
            step(conn)
            conn.execute(MigrationRecord.__table__.insert().values(
                name=name, applied_at=datetime.now(timezone.utc).replace(tzinfo=None)))
            applied_now.append(name)
    return applied_now
