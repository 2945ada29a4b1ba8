"""The job store: documents, jobs, questions, answers and reports in SQLite or PostgreSQL.

Open it with `open_db(location)`; add work with `jobs.ingest`; the worker drains it through
`queue` (claim, heartbeat, record_answer, finish/fail/release); the CLI reads it through
`views`, `reports` and `export`. Nothing here imports torch.
"""

from ppqa.store.db import Database, open_db, ppqa_home, resolve_url
from ppqa.store.errors import DatabaseUnavailable, InputError, StoreError
from ppqa.store.jobs import IngestRequest, IngestResult, cancel_job, ingest, retry_job
from ppqa.store.params import MODES, GenerationParams
from ppqa.store.queue import (ClaimedJob, ClaimedQuestion, claim_jobs, fail_job, finish_job,
                              heartbeat, record_answer, release_jobs, requeue_expired)
from ppqa.store.reports import JobReport, list_reports

__all__ = [
    "Database", "open_db", "ppqa_home", "resolve_url",
    "DatabaseUnavailable", "InputError", "StoreError",
    "IngestRequest", "IngestResult", "cancel_job", "ingest", "retry_job",
    "MODES", "GenerationParams",
    "ClaimedJob", "ClaimedQuestion", "claim_jobs", "fail_job", "finish_job", "heartbeat",
    "record_answer", "release_jobs", "requeue_expired",
    "JobReport", "list_reports",
]
