"""The decode steps an e2e workload makes through the real scheduler, on the CPU.

The engine's session and scheduler (admission by rows and KV, a cascade group's room rule,
chunked prefill, requests leaving as their answers end) decide each decode step's requests,
padded rows and documents from the workload's shape alone: question counts, answer budgets and
the order of arrival, not the model or the document's words. So a tiny dummy model on the CPU,
with each document's text cut to 1/`--scale` of its tokens and each question to 20
characters, makes the steps the GPU would. For `loogle` at 8 documents it gives the 399 steps, mean rows and padding histogram of the H100's
profiled worker pass (results/h100/gprof_loogle_auto_s45c2.json).

Per step: requests, padded rows (the graph's batch), documents. The summary adds row-steps
(stock reads a document per row-step) and document-steps (cascade reads one per group).
Timing is not measured here: step costs come from device profiles (NOTES.md).

    python benchmarks/step_shapes.py --workload loogle --max-docs 48 --mode cascade \
        --out benchmarks/results/cpu/step_shapes_loogle48.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import time
from pathlib import Path

from ppqa import Engine, EngineConfig, QuestionRequest
from ppqa.bench.workloads import get_workload, make_jobs, question_requests
from ppqa.engine.loading.bpe import bpe_tokenizer


def workload_requests(name: str, max_docs: int | None, scale: int) -> list[QuestionRequest]:
    """The workload's questions (ids, budgets, order) over documents of 1/scale its length,
    each question cut to its first 20 characters."""
    drawn = make_jobs(get_workload(name), bpe_tokenizer(), max_docs)
    rng = random.Random(0)
    docs = ["".join(rng.choice("abcdefgh ") for _ in range(max(1, n // scale)))
            for n in drawn.doc_tokens]
    return [dataclasses.replace(r, question=r.question[:20])
            for r in question_requests(drawn, docs)]


def decode_steps(requests: list[QuestionRequest], mode: str, max_batch: int) -> list[tuple]:
    """(requests, padded rows, documents) of every decode step of one drained session."""
    config = EngineConfig(kv_token_budget=2_000_000, max_prefill_tokens=16384,
                          max_batch_requests=max_batch, cuda_graphs=True)  # padded as on a GPU
    session = Engine("dummy:tiny-gqa", device="cpu", config=config).session()
    steps = []
    build = session.sched.decode_step

    def recorded(batch, **kwargs):
        steps.append((len(batch), kwargs.get("pad_to", 0), len({r.doc_key for r in batch})))
        return build(batch, **kwargs)

    session.sched.decode_step = recorded
    session.submit(requests, mode=mode)
    session.drain()
    session.close()
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="loogle")
    parser.add_argument("--max-docs", type=int, default=None, help="documents per group")
    parser.add_argument("--mode", default="cascade", choices=("stock", "cascade"))
    parser.add_argument("--max-batch", type=int, default=256, help="max_batch_requests")
    parser.add_argument("--scale", type=int, default=100,
                        help="documents cut to 1/scale of their tokens (shapes do not depend on it)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    requests = workload_requests(args.workload, args.max_docs, args.scale)
    began = time.perf_counter()
    steps = decode_steps(requests, args.mode, args.max_batch)
    rows = sum(s[0] for s in steps)
    summary = {
        "workload": args.workload, "max_docs": args.max_docs, "mode": args.mode,
        "max_batch_requests": args.max_batch, "questions": len(requests),
        "steps": len(steps), "row_steps": rows, "doc_steps": sum(s[2] for s in steps),
        "mean_rows": rows / len(steps), "mean_padded": sum(s[1] for s in steps) / len(steps),
        "steps_by_padded_rows": dict(sorted(collections.Counter(s[1] for s in steps).items())),
        "steps_by_rows_over_128": dict(sorted(collections.Counter(
            (s[0] - 1) // 32 * 32 + 1 for s in steps if s[0] > 128).items())),
        "seconds": time.perf_counter() - began,
    }
    for key, value in summary.items():
        print(f"{key}: {value}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**summary, "step_list": steps}, indent=1) + "\n")


if __name__ == "__main__":
    main()
