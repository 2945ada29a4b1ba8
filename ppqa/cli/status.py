"""`ppqa status`: the queue at a glance, per document (from `ppqa.store.views.queue_status`)."""

from typing import Annotated

import typer

from ppqa.cli.common import JsonOption, open_store, print_json, say
from ppqa.cli.render import console, status_table

app = typer.Typer()

# Documents the table shows without --all: a queue of thousands stays a glance (and Rich
# takes seconds to lay out a table of thousands of rows).
STATUS_ROWS = 20


@app.command(help="Show the queue at a glance: jobs by status and questions answered, per "
                  f"document.\n\nPast {STATUS_ROWS} documents the table shows the "
                  f"{STATUS_ROWS} with "
                  "the most open work (running, then queued, then failed jobs; the newest "
                  "first) and one row for the rest; --all lists every one, and --json always "
                  "holds every document.\n\nExamples:\n\n  ppqa status\n\n"
                  "  ppqa status --all\n\n  ppqa --db jobs.db status --json")
def status(
    ctx: typer.Context,
    every: Annotated[bool, typer.Option(
        "--all", help="List every document in the table, however many.")] = False,
    json_out: JsonOption = False,
) -> None:
    from ppqa.store.views import queue_status

    data = queue_status(open_store(ctx))
    if json_out:
        print_json(data)
    elif not data["documents"]:
        say("the queue is empty; add work with: ppqa ingest DOCUMENT QUESTIONS")
    else:
        console().print(status_table(data, None if every else STATUS_ROWS))
        if not every and len(data["documents"]) > STATUS_ROWS:
            say(f"{STATUS_ROWS} of {len(data['documents']):,} documents listed, those with the "
                "most open work; --all lists every one")
