"""What `ppqa bench --e2e` reads back after each run, and how it sums the runs up.

`store_figures(db_path, started_utc)` reads one run's store (SQLite file): the first claim
(start-up = first claim - process start), the jobs by status and the first failed job's
error, the reports' prefill and decode seconds and peak memory, the answers' counts and finish
reasons, and each job's latency from its ingest (`jobs.created_at`) to its last answer
(`answers.created_at`); `all_settled` tells the arrivals run when to stop its worker.
`summarize` turns the runs of a workload into per-mode means and speedups over stock
(geometric mean over passes of stock/mode on process wall and run wall); `markdown_table` and
`plot_speedups` render the results JSON.
"""

from __future__ import annotations

import math
import statistics
from datetime import datetime
from pathlib import Path

GIB = 2**30


def store_figures(db_path: Path, started_utc: datetime) -> dict:
    """One run's figures from its store; see the module doc. Seconds are floats."""
    from sqlalchemy import func, select

    from ppqa.store.db import open_db
    from ppqa.store.models import FAILED, Answer, Job, Question, Report

    db = open_db(db_path)
    try:
        with db.read() as conn:
            first_claim = conn.execute(select(func.min(Job.started_at))).scalar()
            statuses = dict(conn.execute(select(Job.status, func.count()).group_by(Job.status)).all())
            failure = conn.execute(select(Job.id, Job.error).where(Job.status == FAILED)
                                   .order_by(Job.id).limit(1)).first()
            per_job = conn.execute(
                select(Job.created_at, func.max(Answer.created_at), func.count(Answer.id))
                .join(Question, Question.job_id == Job.id)
                .outerjoin(Answer, Answer.question_id == Question.id).group_by(Job.id)
                .order_by(Job.id)).all()
            answers = conn.execute(select(func.count(Answer.id), func.sum(Answer.token_count))).one()
            finish = dict(conn.execute(select(Answer.finish_reason, func.count())
                                       .group_by(Answer.finish_reason)).all())
            reports = conn.execute(select(Report.mode, Report.streams, Report.prefill_seconds,
                                          Report.decode_seconds, Report.peak_memory_bytes)).all()
    finally:
        db.close()
    prefill = sum(r.prefill_seconds or 0.0 for r in reports)
    decode = sum(r.decode_seconds or 0.0 for r in reports)
    peak = max((r.peak_memory_bytes or 0 for r in reports), default=0)
    resolved: dict[str, int] = {}
    for r in reports:
        key = r.mode if r.mode != "parallel" else f"parallel/P={r.streams}"
        resolved[key] = resolved.get(key, 0) + 1
    latencies = [(last - created).total_seconds() for created, last, _ in per_job if last]
    created = [c for c, _, _ in per_job]
    last_answer = max((last for _, last, _ in per_job if last), default=None)
    out = {
        "startup_s": (first_claim - started_utc).total_seconds() if first_claim else None,
        "jobs": sum(statuses.values()), "jobs_by_status": statuses,
        "first_failure": f"job {failure.id}: {failure.error}" if failure else None,
        "questions": answers[0], "answer_tokens": int(answers[1] or 0),
        "finish_reasons": finish, "reports": len(reports), "resolved_modes": resolved,
        "prefill_s": prefill, "decode_s": decode, "engine_s": prefill + decode,
        "peak_memory_bytes": peak or None,
        "peak_memory_gib": round(peak / GIB, 2) if peak else None,
        "latency_p50_s": _percentile(latencies, 50), "latency_p95_s": _percentile(latencies, 95),
        "latency_max_s": max(latencies, default=None),
        # each answered job's, in ingest order: whether the slow ones are the first (a fresh
        # worker's first uses) or spread (steps shared with other jobs)
        "latency_by_job_s": [round(x, 4) for x in latencies],
    }
    if created and last_answer:
        out["span_s"] = (last_answer - min(created)).total_seconds()  # first ingest to last answer
    return out


def all_settled(db: Path, total: int) -> bool:
    """Whether `total` jobs of the store are done, failed or cancelled (arrivals: time to stop)."""
    from sqlalchemy import func, select

    from ppqa.store.db import open_db
    from ppqa.store.models import CANCELLED, DONE, FAILED, Job

    store = open_db(db)
    try:
        with store.read() as conn:
            settled = conn.execute(select(func.count()).where(
                Job.status.in_([DONE, FAILED, CANCELLED]))).scalar()
    finally:
        store.close()
    return settled >= total


def _percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear between ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _geomean(values: list[float]) -> float | None:
    if not values or any(v <= 0 for v in values):
        return None
    return math.exp(sum(map(math.log, values)) / len(values))


# Figures averaged per mode over the passes (the table shows the first ones).
MEAN_FIELDS = ("process_s", "run_s", "startup_s", "prefill_s", "decode_s", "worker_s",
               "answers_per_s", "peak_memory_gib", "latency_p50_s", "latency_p95_s",
               "throughput_answers_per_s", "setup_s", "ingest_s", "export_s", "answer_tokens")


def summarize(runs: list[dict], modes: list[str], floor_s: float | None = None) -> dict:
    """Per mode: the mean of MEAN_FIELDS over its good runs, speedups over stock (geometric mean
    over passes of stock/mode; for arrivals also p50 latency and throughput), how many of its
    answers equal stock's in the same pass, and its mean run over the workload's floor
    (bench/floor.py), where given."""
    good = [r for r in runs if not r.get("error")]
    by_pass = {(r["pass"], r["mode"]): r for r in good}
    out: dict[str, dict] = {}
    for mode in modes:
        mine = [r for r in good if r["mode"] == mode]
        row: dict = {"runs": len(mine), "failed": sum(1 for r in runs if r["mode"] == mode) - len(mine)}
        for name in MEAN_FIELDS:
            values = [r[name] for r in mine if r.get(name) is not None]
            row[name] = statistics.fmean(values) if values else None
        row["resolved_modes"] = sorted({m for r in mine for m in r.get("resolved_modes", {})})
        pairs = [(by_pass[(r["pass"], "stock")], r) for r in mine if (r["pass"], "stock") in by_pass]
        for name in ("process_s", "run_s", "latency_p50_s"):
            ratios = [s[name] / r[name] for s, r in pairs if s.get(name) and r.get(name)]
            row[f"speedup_{name.removesuffix('_s')}"] = _geomean(ratios)
        ratios = [r["throughput_answers_per_s"] / s["throughput_answers_per_s"] for s, r in pairs
                  if s.get("throughput_answers_per_s") and r.get("throughput_answers_per_s")]
        row["speedup_throughput"] = _geomean(ratios)
        compared = [r for r in mine if r.get("answers_compared")]
        row["answers_match_stock"] = sum(r["answers_match_stock"] for r in compared)
        row["answers_compared"] = sum(r["answers_compared"] for r in compared)
        row["run_over_floor"] = (row["run_s"] / floor_s
                                 if floor_s and row.get("run_s") is not None else None)
        out[mode] = row
    return out


def merge(results: list[dict]) -> list[dict]:
    """The workloads of several results JSONs, runs of the same workload and model joined (a
    benchmark split over calls: other passes, other modes) and summed up again; a run keeps its
    pass number, so stock and a mode of the same pass number are paired."""
    merged: dict[tuple[str, str], dict] = {}
    for result in results:
        for w in result["workloads"]:
            key = (w["workload"]["name"], w["model"])
            if key not in merged:
                merged[key] = {**w, "runs": [], "modes": []}
            into = merged[key]
            into["runs"] += w["runs"]
            into["modes"] += [m for m in w["modes"] if m not in into["modes"]]
    for w in merged.values():
        w["modes"].sort(key=lambda m: m != "stock")  # the baseline's row first
        w["summary"] = summarize(w["runs"], w["modes"],
                                 w["workload"].get("floor", {}).get("total_s"))
    return list(merged.values())


def _cell(value, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def markdown_table(workloads: list[dict]) -> str:
    """One row per (workload, mode) of a results JSON: means over passes, speedups over stock.
    answers/s is over the process wall, or for arrivals over first ingest to last answer."""
    arrivals = any(w["workload"].get("arrivals") for w in workloads)
    head = ("| workload | model | mode | process s | run s | start-up s | prefill s | decode s "
            "| worker s | answers/s | peak GiB | x process | x run | run / floor |")
    if arrivals:
        head += " p50 s | p95 s | x p50 |"
    head += " same answers |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for w in workloads:
        for mode, s in w["summary"].items():
            base = mode == "stock"
            cells = [w["workload"]["name"], w["model"].removeprefix("dummy:"), mode,
                     _cell(s["process_s"], 1), _cell(s["run_s"], 1), _cell(s["startup_s"], 1),
                     _cell(s["prefill_s"], 1), _cell(s["decode_s"], 1), _cell(s["worker_s"], 1),
                     _cell(s["throughput_answers_per_s" if w["workload"].get("arrivals")
                             else "answers_per_s"], 1), _cell(s["peak_memory_gib"], 1),
                     "1" if base else _cell(s["speedup_process"], 2, "x"),
                     "1" if base else _cell(s["speedup_run"], 2, "x"),
                     _cell(s.get("run_over_floor"), 2, "x")]
            if arrivals:
                cells += [_cell(s["latency_p50_s"], 1), _cell(s["latency_p95_s"], 1),
                          "1" if base else _cell(s["speedup_latency_p50"], 2, "x")]
            cells.append("-" if base or not s["answers_compared"]
                         else f"{s['answers_match_stock']}/{s['answers_compared']}")
            if s["failed"]:
                cells[2] += f" ({s['failed']} failed)"
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_speedups(workloads: list[dict], path: Path) -> bool:
    """Bars of speedup over stock per workload and mode (process wall solid, run wall hatched);
    False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = [m for m in dict.fromkeys(m for w in workloads for m in w["summary"]) if m != "stock"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads) * max(1, len(modes)) / 2), 4))
    width = 0.8 / max(1, 2 * len(modes))
    for i, mode in enumerate(modes):
        for k, (field, hatch) in enumerate((("speedup_process", None), ("speedup_run", "//"))):
            xs = [j + (2 * i + k) * width for j in range(len(workloads))]
            ys = [w["summary"].get(mode, {}).get(field) or 0 for w in workloads]
            ax.bar(xs, ys, width, color=f"C{i}", hatch=hatch, edgecolor="white",
                   label=f"{mode} ({'process' if k == 0 else 'run'})")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))],
                  [w["workload"]["name"] for w in workloads])
    ax.set_ylabel("speedup over stock (x)")
    ax.set_title("ppqa bench --e2e: ingest -> ppqa run -> export")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
