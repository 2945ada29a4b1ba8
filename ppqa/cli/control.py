"""`ppqa cancel JOB` and `ppqa retry JOB`: change a job's state by hand (`ppqa.store.jobs`)."""

import typer

from ppqa.cli.common import JobArg, open_store, say

app = typer.Typer()


@app.command(help="Cancel a queued or running job; a worker on it stops at its next "
                  "heartbeat. Answers so far are kept.\n\nExample:\n\n  ppqa cancel 3")
def cancel(ctx: typer.Context, job: JobArg) -> None:
    from ppqa.store.jobs import cancel_job

    say(f"job {job}: {cancel_job(open_store(ctx), job)}")


@app.command(help="Queue a failed or cancelled job again with fresh attempts; only its "
                  "unanswered questions are run.\n\nExample:\n\n  ppqa retry 3")
def retry(ctx: typer.Context, job: JobArg) -> None:
    from ppqa.store.jobs import retry_job

    say(f"job {job}: {retry_job(open_store(ctx), job)}")
