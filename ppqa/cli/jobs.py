"""`ppqa jobs` (list jobs) and `ppqa show JOB` (one job with its questions, answers, reports)."""

from typing import Annotated

import typer

from ppqa.cli.common import MAX_ID, JobArg, JsonOption, open_store, print_json, say
from ppqa.cli.render import console, job_summary, jobs_table, questions_table, report_details
from ppqa.store.status import JOB_STATUSES

app = typer.Typer()


# Jobs the table lists without --limit or --all (--json lists every job).
JOBS_ROWS = 50


@app.command(help="List jobs, newest first.\n\nThe table shows the newest "
                  f"{JOBS_ROWS} (--limit N or --all for more); --json lists every job unless "
                  "--limit is given.\n\nExamples:\n\n  ppqa jobs\n\n  ppqa jobs --all\n\n"
                  "  ppqa jobs --status failed --json")
def jobs(
    ctx: typer.Context,
    status: Annotated[str | None, typer.Option(
        help=f"Only jobs of this status ({', '.join(JOB_STATUSES)}), e.g. --status failed.",
        show_default=False)] = None,
    limit: Annotated[int | None, typer.Option(
        max=MAX_ID, help="At most this many jobs, e.g. --limit 20.", show_default=False)] = None,
    every: Annotated[bool, typer.Option(
        "--all", help=f"List every job in the table (it shows the newest {JOBS_ROWS}).")] = False,
    json_out: JsonOption = False,
) -> None:
    from ppqa.store.errors import InputError
    from ppqa.store.views import count_jobs, list_jobs

    if limit is not None and limit < 1:
        raise InputError(f"--limit must be at least 1, got {limit}")
    if limit is not None and every:
        raise InputError("--limit and --all do not go together")
    if status is not None and status not in JOB_STATUSES:
        raise InputError(f"unknown status {status!r}; choose one of {', '.join(JOB_STATUSES)}")
    capped = limit is None and not every and not json_out
    db = open_store(ctx)
    rows = list_jobs(db, status=status, limit=JOBS_ROWS + 1 if capped else limit)
    if json_out:
        print_json(rows)
    elif not rows:
        say("no jobs" + (f" with status {status}" if status else ""))
    else:
        console().print(jobs_table(rows[:JOBS_ROWS] if capped else rows))
        if capped and len(rows) > JOBS_ROWS:
            which = f" with status {status}" if status else ""
            say(f"the newest {JOBS_ROWS} of {count_jobs(db, status=status):,} jobs{which}; "
                "--limit N or --all lists more")


@app.command(help="Show one job: its parameters, questions, answers so far and speed "
                  "reports.\n\nExamples:\n\n  ppqa show 3\n\n  ppqa show 3 --json")
def show(
    ctx: typer.Context,
    job: JobArg,
    json_out: JsonOption = False,
) -> None:
    from ppqa.store.views import job_detail

    detail = job_detail(open_store(ctx), job)
    if json_out:
        print_json(detail)
        return
    out = console()
    out.print(job_summary(detail))
    out.print()
    out.print(questions_table(detail["questions_detail"]))
    if detail["reports"]:
        out.print()
        out.print(report_details(detail["reports"]))
