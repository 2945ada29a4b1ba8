"""`ppqa report`: the per-run speed reports the worker writes (`ppqa.store.reports`)."""

from typing import Annotated

import typer

from ppqa.cli.common import MAX_ID, JsonOption, open_store, print_json, say
from ppqa.cli.render import console, reports_table

app = typer.Typer()

# Runs the table lists without --all (--json lists every one).
REPORT_ROWS = 50


@app.command(help="Show speed reports: one row per job run (wall, prefill and decode seconds, "
                  "tokens/s, questions/s, peak memory).\n\nThe table lists the latest "
                  f"{REPORT_ROWS} runs, oldest first (--all for every one); --json lists every "
                  "run.\n\nExamples:\n\n  ppqa report\n\n  ppqa report --job 3 --json")
def report(
    ctx: typer.Context,
    job: Annotated[int | None, typer.Option(
        min=1, max=MAX_ID, help="Only this job's reports, e.g. --job 3.",
        show_default=False)] = None,
    every: Annotated[bool, typer.Option(
        "--all", help=f"List every run in the table (it shows the latest {REPORT_ROWS}).")
    ] = False,
    json_out: JsonOption = False,
) -> None:
    from ppqa.store.reports import count_reports, list_reports
    from ppqa.store.views import job_detail

    db = open_store(ctx)
    if job is not None:
        job_detail(db, job)  # refuses an unknown job id with a clear error
    capped = not every and not json_out
    rows = list_reports(db, job, last=REPORT_ROWS + 1 if capped else None)
    if json_out:
        print_json(rows)
    elif not rows:
        say("no reports yet: a report is written when a worker finishes a job (ppqa run)")
    else:
        console().print(reports_table(rows[-REPORT_ROWS:] if capped else rows))
        if capped and len(rows) > REPORT_ROWS:
            say(f"the latest {REPORT_ROWS} of {count_reports(db, job):,} runs; --all lists "
                "every one")
