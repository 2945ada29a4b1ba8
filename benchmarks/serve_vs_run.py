"""One OpenAI Batch file two ways: `ppqa ingest --openai-batch` + `ppqa run --once` + `ppqa
export --format openai-batch`, against `ppqa serve --worker` driven over HTTP (upload the file,
create a batch, poll it, download the output file). Each path starts from a fresh store and a
fresh process, as a user would; wall time from the first command to the output file in hand.

The requests are an e2e workload (`ppqa/bench/workloads.py`, default `labeling`) written as chat
requests: the document in a system message, the question as the user's, its answer budget as
max_tokens. ppqa groups them back by their shared prefix on both paths. Paths alternate over
`--passes` (run, serve, serve, run, ...), and the JSON records each wall time, the output lines'
custom_ids and how many answers agree between the paths.

    python3 benchmarks/serve_vs_run.py --workload labeling --max-docs 25 --gpu 0 --out sv.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SOURCE = str(Path(__file__).resolve().parents[1])
SYSTEM = "Read the document below, then answer the user's question about it.\n\n"


def batch_lines(workload_name: str, max_docs: int | None, model: str | None) -> tuple[str, list[str]]:
    from ppqa.bench.workloads import get_workload, make_jobs
    from ppqa.engine.loading.loader import load_model

    workload = get_workload(workload_name)
    model = model or workload.model
    jobs = make_jobs(workload, load_model(model).tokenizer, max_docs)
    lines = []
    for job in jobs.jobs:
        for qid, question in job.questions:
            body = {"model": model, "max_tokens": job.max_new_tokens,
                    "messages": [{"role": "system", "content": SYSTEM + jobs.documents[job.document]},
                                 {"role": "user", "content": question}]}
            lines.append(json.dumps({"custom_id": f"{job.name}-{qid}", "method": "POST",
                                     "url": "/v1/chat/completions", "body": body}))
    return model, lines


class Paths:
    def __init__(self, model: str, device_args: list[str], folder: Path, batch: Path) -> None:
        self.model, self.device_args, self.folder, self.batch = model, device_args, folder, batch
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [SOURCE, os.environ.get("PYTHONPATH")]))}

    def cli(self, db: Path, *args: str) -> list[str]:
        return [sys.executable, "-m", "ppqa", "--db", str(db), *args]

    def _check(self, cmd: list[str], log) -> None:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[3:6])} exited {proc.returncode}")

    def run_path(self, tag: str) -> dict:
        db, out = self.folder / f"{tag}.db", self.folder / f"{tag}.out.jsonl"
        with open(self.folder / f"{tag}.log", "w") as log:
            t0 = time.perf_counter()
            self._check(self.cli(db, "ingest", "--openai-batch", str(self.batch), "--model", self.model),
                        log)
            t1 = time.perf_counter()
            self._check(self.cli(db, "run", "--once", "--model", self.model, *self.device_args), log)
            t2 = time.perf_counter()
            self._check(self.cli(db, "export", "--format", "openai-batch", str(out)), log)
            t3 = time.perf_counter()
        return {"path": "run", "wall_s": t3 - t0, "ingest_s": t1 - t0, "run_s": t2 - t1,
                "export_s": t3 - t2, "output": out}

    def serve_path(self, tag: str) -> dict:
        db, out = self.folder / f"{tag}.db", self.folder / f"{tag}.out.jsonl"
        port = _free_port()
        base = f"http://127.0.0.1:{port}/v1"
        log = open(self.folder / f"{tag}.log", "w")
        t0 = time.perf_counter()
        server = subprocess.Popen(self.cli(db, "serve", "--worker", "--port", str(port), "--model",
                                           self.model, *self.device_args),
                                  stdout=log, stderr=log, text=True, env=self.env)
        try:
            with httpx.Client(timeout=60) as client:
                while True:
                    if server.poll() is not None:
                        raise RuntimeError(f"ppqa serve exited {server.returncode}")
                    try:
                        client.get(f"{base}/models").raise_for_status()
                        break
                    except httpx.TransportError:
                        time.sleep(0.1)
                t_up = time.perf_counter()
                with open(self.batch, "rb") as f:
                    file_id = client.post(f"{base}/files", data={"purpose": "batch"},
                                          files={"file": ("requests.jsonl", f)}).json()["id"]
                batch = client.post(f"{base}/batches", json={
                    "input_file_id": file_id, "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"}).json()
                while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
                    time.sleep(0.2)
                    batch = client.get(f"{base}/batches/{batch['id']}").json()
                if batch["status"] != "completed":
                    raise RuntimeError(f"batch {batch['status']}: {batch.get('errors')}")
                out.write_bytes(client.get(f"{base}/files/{batch['output_file_id']}/content").content)
                t_done = time.perf_counter()
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
        return {"path": "serve", "wall_s": t_done - t0, "server_up_s": t_up - t0,
                "request_counts": batch.get("request_counts"), "output": out}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(path: Path) -> dict[str, str | None]:
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        body = (row.get("response") or {}).get("body") or {}
        choices = body.get("choices") or [{}]
        out[row["custom_id"]] = (choices[0].get("message") or {}).get("content")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="labeling")
    ap.add_argument("--max-docs", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gpu", type=int, default=None)
    ap.add_argument("--device", default=None, help="e.g. cpu (default: --gpu 0)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", default="serve_vs_run.json")
    args = ap.parse_args()
    device_args = (["--device", args.device] if args.device
                   else ["--gpu", str(args.gpu if args.gpu is not None else 0)])
    folder = Path(tempfile.mkdtemp(prefix="ppqa-serve-"))
    model, lines = batch_lines(args.workload, args.max_docs, args.model)
    batch = folder / "requests.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    paths = Paths(model, device_args, folder, batch)
    result = {"workload": args.workload, "max_docs": args.max_docs, "model": model,
              "requests": len(lines), "runs": []}
    order = []
    for p in range(args.passes):
        order += ["run", "serve"] if p % 2 == 0 else ["serve", "run"]
    outputs = {}
    for i, which in enumerate(order):
        record = (paths.run_path if which == "run" else paths.serve_path)(f"{which}-{i}")
        answers = _answers(record.pop("output"))
        record["lines"] = len(answers)
        record["all_custom_ids"] = len(answers) == len(lines)
        outputs.setdefault(which, answers)
        result["runs"].append(record)
        print(f"{which:5s} {record['wall_s']:7.2f} s  ({record['lines']} output lines)", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    walls = {w: [r["wall_s"] for r in result["runs"] if r["path"] == w] for w in ("run", "serve")}
    mean = {w: sum(v) / len(v) for w, v in walls.items() if v}
    if len(mean) == 2:
        result["serve_over_run"] = mean["serve"] / mean["run"]
        same = sum(outputs["run"].get(k) == v for k, v in outputs["serve"].items())
        result["answers_equal"] = f"{same}/{len(outputs['serve'])}"
        print(f"serve / run = {result['serve_over_run']:.3f} (mean walls {mean['serve']:.2f} / "
              f"{mean['run']:.2f} s); answers equal {result['answers_equal']}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
