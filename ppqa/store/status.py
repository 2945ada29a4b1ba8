"""Job statuses, in their own tiny module so the CLI can name them without loading SQLAlchemy.

queued -> running (claimed, leased) -> done | failed | queued again (retry, release, expiry);
queued or running -> cancelled by hand; failed or cancelled -> queued by `ppqa retry`.
"""

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
JOB_STATUSES = (QUEUED, RUNNING, DONE, FAILED, CANCELLED)
