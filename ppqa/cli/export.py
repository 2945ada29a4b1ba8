"""`ppqa export FILE`: answers to CSV, JSONL or JSON (`ppqa.files.export`), written atomically."""

from typing import Annotated

import typer

from ppqa.cli.common import MAX_ID, open_store, say
from ppqa.store.errors import InputError

app = typer.Typer()


@app.command(help="Export answers, one row per question: job, document, question_id, "
                  "question, answer, finish_reason, tokens, model, mode, finished_at. By "
                  "default the questions of finished (done) jobs.\n\nExamples:\n\n"
                  "  ppqa export answers.csv\n\n  ppqa export - --format jsonl --job 3 --job 4\n\n"
                  "  ppqa export everything.json --all")
def export(
    ctx: typer.Context,
    file: Annotated[str, typer.Argument(
        help="Output file (.csv, .jsonl or .json), or - for standard output.")],
    format: Annotated[str | None, typer.Option(
        "--format", help="csv, jsonl or json; default: from FILE's extension (csv for -), "
                         "e.g. --format jsonl.", show_default=False)] = None,
    job: Annotated[list[int] | None, typer.Option(
        "--job", min=1, max=MAX_ID, show_default=False,
        help="Only this job, any status (repeat for several), e.g. --job 3 --job 4.")] = None,
    all_jobs: Annotated[bool, typer.Option(
        "--all", help="Every job, finished or not (unanswered questions have an empty "
                      "answer).")] = False,
) -> None:
    from ppqa.files.export import check_destination, export_format, write_export
    from ppqa.store.export import export_rows

    if job and all_jobs:
        raise InputError("give --job or --all, not both")
    check_destination(file)
    fmt = export_format(file, format)
    rows = export_rows(open_store(ctx), job_ids=job or None, include_all=all_jobs)
    write_export(rows, file, fmt)
    answered = sum(1 for r in rows if r["answer"] is not None)
    n_jobs = len({r["job"] for r in rows})
    where = "stdout" if file == "-" else file
    if not rows:
        say(f"nothing to export (no {'jobs' if all_jobs or job else 'finished jobs'}); "
            f"wrote an empty {fmt} to {where}")
    else:
        say(f"wrote {len(rows)} rows ({answered} answered) of {n_jobs} job"
            f"{'s' if n_jobs != 1 else ''} to {where} as {fmt}")
