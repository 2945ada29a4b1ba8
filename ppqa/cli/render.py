"""Rich rendering of store views (dicts from `ppqa.store.views` / `reports`) for the terminal.

Tables go to stdout (they are the data); colour follows Rich's terminal detection and NO_COLOR.
Commands with `--json` skip this module and print the same dicts as JSON.
"""

import json

from rich import box
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


def _compact() -> Table:
    """A borderless table: wide listings fit an 80-column terminal."""
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))


def status_table(data: dict, limit: int | None = None) -> Table:
    """One row per document, then the totals. With more documents than `limit`, the rows are
    the `limit` with the most open work (running jobs, then queued, then failed; the newest
    first among equals), in document order, and one row adds up the others, so that the
    columns still sum to the totals."""
    table = _compact()
    table.add_column("Doc", justify="right")
    table.add_column("Name", overflow="fold")
    for status in ("queued", "running", "done", "failed", "cancelled"):
        table.add_column(status.capitalize(), justify="right")
    table.add_column("Answered", justify="right")
    documents, rest = data["documents"], []
    if limit is not None and len(documents) > limit:
        ranked = sorted(documents, key=_open_work, reverse=True)
        shown = {id(doc) for doc in ranked[:limit]}
        rest = [doc for doc in documents if id(doc) not in shown]
        documents = [doc for doc in documents if id(doc) in shown]
    for doc in documents:
        jobs = doc["jobs"]
        table.add_row(str(doc["document"]), doc["name"],
                      *[Text(str(jobs[s]), style=STATUS_STYLE[s] if jobs[s] else "dim") for s in jobs],
                      f"{doc['answered']}/{doc['questions']}")
    if rest:
        counts = {s: sum(doc["jobs"][s] for doc in rest) for s in rest[0]["jobs"]}
        answered = f"{sum(d['answered'] for d in rest)}/{sum(d['questions'] for d in rest)}"
        table.add_row("", *[Text(cell, style="dim") for cell in (
            f"{len(rest):,} more", *map(str, counts.values()), answered)])
    totals = data["totals"]
    table.add_section()
    table.add_row("", "all documents", *[str(n) for n in totals["jobs"].values()],
                  f"{totals['answered']}/{totals['questions']}")
    return table


def _open_work(doc: dict) -> tuple:
    jobs = doc["jobs"]
    return (jobs["running"] > 0, jobs["queued"] > 0, jobs["failed"] > 0, doc["document"])


def jobs_table(jobs: list[dict]) -> Table:
    table = _compact()
    for name, justify in (("Job", "right"), ("Document", "left"), ("Status", "left"),
                          ("Answered", "right"), ("Prio", "right"), ("Tries", "right"),
                          ("Created (UTC)", "left"), ("Worker", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for job in jobs:
        table.add_row(str(job["job"]), job["document_name"], _status(job["status"]),
                      f"{job['answered']}/{job['questions']}", str(job["priority"]),
                      str(job["attempts"]), (job["created_at"] or "").replace("T", " ")[:16],
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
    table.add_row("Parameters", ", ".join(f"{k}={_param(v)}" for k, v in params.items()))
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
    table = _compact()
    table.add_column("Id", justify="right")
    table.add_column("Question", ratio=1)
    table.add_column("Answer", ratio=2)
    table.add_column("Finish")
    table.add_column("Tokens", justify="right")
    for q in questions:
        answer = Text(q["answer"]) if q["answer"] is not None else Text("(not yet)", style="dim")
        if q.get("choice_scores"):
            answer.append("\n" + choice_line(q["choice_scores"]), style="dim")
        if q.get("vote") is not None:
            answer.append(f"\nvote {q['vote']} {q['vote_share']:.2f}", style="dim")
        qid = q["question_id"] if "sample" not in q else f"{q['question_id']} #{q['sample']}"
        table.add_row(qid, q["question"], answer, q["finish_reason"] or "",
                      _num(q["tokens"]))
    return table


def choice_line(scores: list[dict]) -> str:
    """Every choice with its probability, most likely first: "yes 0.91 · no 0.07"."""
    ranked = sorted(scores, key=lambda s: -s["prob"])
    return " · ".join(f"{s['choice']} {s['prob']:.2f}" for s in ranked)


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def reports_table(reports: list[dict]) -> Table:
    """One row per run, the figures that fit 80 columns (all of them are in --json)."""
    table = _compact()
    for title in ("Job", "Model", "Mode", "Device", "P", "Wall s", "Q", "Tokens",
                  "Tok/s", "Q/s", "Peak MiB"):
        if title in ("Model", "Mode", "Device"):
            table.add_column(title, overflow="fold", min_width=8)
        else:
            table.add_column(title, justify="right", no_wrap=True)
    for r in reports:
        table.add_row(str(r["job_id"]), r["model"], r["mode"], r["device"], _num(r["streams"]),
                      _num(r["wall_seconds"]), _num(r["questions"]), _num(r["answer_tokens"]),
                      _num(r["tokens_per_second"], 1), _num(r["questions_per_second"]),
                      _mib(r["peak_memory_bytes"]))
    return table


def report_details(reports: list[dict]) -> Table:
    """Every figure of each run, one line per kind (for `ppqa show`)."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for n, r in enumerate(reports, start=1):
        table.add_row(f"Run {n}", f"{r['created_at']} by {r['worker']} on {r['device']}: "
                      f"{r['model']}, mode {r['mode']}, {_num(r['streams'])} streams, "
                      f"batch {_num(r['batch_size'])}")
        table.add_row("", f"wall {_num(r['wall_seconds'])} s (prefill "
                      f"{_num(r['prefill_seconds'])} s, decode {_num(r['decode_seconds'])} s); "
                      f"{r['questions']} questions, {r['prompt_tokens']:,} prompt + "
                      f"{r['answer_tokens']:,} answer tokens")
        table.add_row("", f"{_num(r['tokens_per_second'], 1)} tokens/s, "
                      f"{_num(r['questions_per_second'])} questions/s, peak memory "
                      f"{_mib(r['peak_memory_bytes'])} MiB")
    return table


def _param(value) -> str:
    """A job parameter as a user wrote it: JSON for objects and lists (a JSON schema)."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)
