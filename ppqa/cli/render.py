"""Rich rendering of store views (dicts from `ppqa.store.views` / `reports`) for the terminal.

Tables go to stdout (they are the data); colour follows Rich's terminal detection and NO_COLOR.
Commands with `--json` skip this module and print the same dicts as JSON.
"""

from rich.console import Console
from rich.table import Table
from rich.text import Text

STATUS_STYLE = {"queued": "yellow", "running": "cyan", "done": "green", "failed": "red",
                "cancelled": "dim"}


def console() -> Console:
    return Console(highlight=False)


def _status(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


def _num(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def status_table(data: dict) -> Table:
    table = Table(title="ppqa queue", title_justify="left")
    table.add_column("Doc", justify="right")
    table.add_column("Name")
    for status in ("queued", "running", "done", "failed", "cancelled"):
        table.add_column(status.capitalize(), justify="right", style=STATUS_STYLE[status])
    table.add_column("Answered", justify="right")
    for doc in data["documents"]:
        jobs = doc["jobs"]
        table.add_row(str(doc["document"]), doc["name"], *[str(jobs[s]) for s in jobs],
                      f"{doc['answered']}/{doc['questions']}")
    totals = data["totals"]
    table.add_section()
    table.add_row("", "all", *[str(n) for n in totals["jobs"].values()],
                  f"{totals['answered']}/{totals['questions']}")
    return table


def jobs_table(jobs: list[dict]) -> Table:
    table = Table()
    for name, justify in (("Job", "right"), ("Document", "left"), ("Status", "left"),
                          ("Answered", "right"), ("Prio", "right"), ("Tries", "right"),
                          ("Created (UTC)", "left"), ("Worker", "left")):
        table.add_column(name, justify=justify)
    for job in jobs:
        table.add_row(str(job["job"]), job["document_name"], _status(job["status"]),
                      f"{job['answered']}/{job['questions']}", str(job["priority"]),
                      str(job["attempts"]), (job["created_at"] or "").replace("T", " ")[:19],
                      job["lease_owner"] or "")
    return table


def job_summary(job: dict) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    params = job["params"] or {}
    table.add_row("Job", str(job["job"]))
    table.add_row("Document", f"{job['document_name']} (document {job['document']})")
    table.add_row("Status", _status(job["status"]))
    table.add_row("Answered", f"{job['answered']} of {job['questions']}")
    table.add_row("Parameters", ", ".join(f"{k}={v}" for k, v in params.items()))
    table.add_row("Priority / tries", f"{job['priority']} / {job['attempts']}")
    for key in ("created_at", "started_at", "finished_at"):
        if job[key]:
            table.add_row(key.replace("_at", "").capitalize(), job[key])
    if job["lease_owner"]:
        table.add_row("Lease", f"{job['lease_owner']} until {job['lease_expires_at']}")
    if job["error"]:
        table.add_row("Error", Text(job["error"], style="red"))
    return table


def questions_table(questions: list[dict]) -> Table:
    table = Table()
    table.add_column("Id", justify="right")
    table.add_column("Question", ratio=1)
    table.add_column("Answer", ratio=2)
    table.add_column("Finish")
    table.add_column("Tokens", justify="right")
    for q in questions:
        answer = Text(q["answer"]) if q["answer"] is not None else Text("(not yet)", style="dim")
        table.add_row(q["question_id"], q["question"], answer, q["finish_reason"] or "",
                      _num(q["tokens"]))
    return table


REPORT_FIELDS = (("Job", "job_id", 0), ("Model", "model", 0), ("Mode", "mode", 0),
                 ("Device", "device", 0), ("Streams", "streams", 0), ("Batch", "batch_size", 0),
                 ("Wall s", "wall_seconds", 2), ("Prefill s", "prefill_seconds", 2),
                 ("Decode s", "decode_seconds", 2), ("Q", "questions", 0),
                 ("Tokens in/out", None, 0), ("Tok/s", "tokens_per_second", 1),
                 ("Q/s", "questions_per_second", 2), ("Peak MiB", "peak_memory_bytes", 0))


def reports_table(reports: list[dict]) -> Table:
    table = Table()
    for title, key, _ in REPORT_FIELDS:
        table.add_column(title, justify="left" if key in ("model", "mode", "device") else "right")
    for rep in reports:
        cells = []
        for _, key, digits in REPORT_FIELDS:
            if key is None:
                cells.append(f"{rep['prompt_tokens']:,}/{rep['answer_tokens']:,}")
            elif key == "peak_memory_bytes":
                value = rep[key]
                cells.append("-" if value is None else f"{value / 2**20:,.0f}")
            elif isinstance(rep[key], str):
                cells.append(rep[key])
            else:
                cells.append(_num(float(rep[key]) if digits and rep[key] is not None else rep[key],
                                  digits))
        table.add_row(*cells)
    return table
