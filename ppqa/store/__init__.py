"""The job store: documents, jobs, questions, answers and reports in SQLite or PostgreSQL.

Open it with `open_db(location)`; add work with `jobs.ingest`; the worker drains it through
`queue` (claim, heartbeat, record_answer, finish/fail/release); the CLI reads it through
`views`, `reports` and `export`. Nothing here imports torch. Names below load on first use, so
that `ppqa --help` and the error classes do not pay for importing SQLAlchemy.
"""

import importlib

_EXPORTS = {
    "db": ("Database", "open_db", "resolve_url"),
    "errors": ("DatabaseUnavailable", "InputError", "StoreError"),
    "jobs": ("IngestRequest", "IngestResult", "cancel_job", "ingest", "retry_job"),
    "params": ("GenerationParams",),
    "queue": ("ClaimedJob", "ClaimedQuestion", "claim_jobs", "fail_job", "finish_job",
              "heartbeat", "record_answer", "release_jobs", "requeue_expired"),
    "reports": ("JobReport", "list_reports"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"ppqa.store.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ppqa.store' has no attribute {name!r}")
