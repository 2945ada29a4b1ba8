"""Host bookkeeping beside a busy tokenizer: torch's intra-op threads against one.

A GPU worker's main thread builds each step with small CPU tensor ops (a step's token-to-row
map by `repeat_interleave`, sorts, concatenations of a few thousand elements), while the
session's tokenizer thread encodes the next claims with the `tokenizers` library, whose pool
takes every core. With torch's default intra-op threads an op that goes parallel waits for
threads the tokenizer's pool keeps off the cores, and the GPU idles meanwhile (stretches of
10-40 ms with `aten::repeat_interleave` or `aten::sort` among the host's ops, in
results/h200/gprof_labeling_auto_s24c2.json). This times those ops on the main thread, alone
and while a thread encodes a `labeling`-sized claim (a 2k-token document and 16 questions)
over and over, with torch's default thread count and with one (what `engine/setup.py` sets for
a GPU engine).

    python3 benchmarks/host_threads.py --out benchmarks/results/cpu/host_threads.json

Writes every number to --out and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch


def step_ops(rows: int, generator: torch.Generator) -> None:
    """The shapes of one step's host bookkeeping (ModelRunner.prepare, the scheduler)."""
    lens = torch.randint(1, 40, (rows,), generator=generator)
    token_req = torch.repeat_interleave(torch.arange(rows), lens)
    order = torch.sort(torch.randint(0, 1 << 20, (rows,), generator=generator)).indices
    torch.cat([token_req, order, torch.cumsum(lens, 0)]).to(torch.int64)


def timed(calls: int, rows: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    took = []
    for _ in range(calls):
        begin = time.perf_counter()
        step_ops(rows, generator)
        took.append(time.perf_counter() - begin)
    took.sort()
    return {"p50_us": took[len(took) // 2] * 1e6, "p99_us": took[int(len(took) * 0.99)] * 1e6,
            "max_ms": took[-1] * 1e3, "total_ms": sum(took) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--out", default="/tmp/host_threads.json")
    args = ap.parse_args()
    from ppqa.engine.loading.bpe import bpe_tokenizer

    tokenizer = bpe_tokenizer()
    claim = (["The harbor of Velm opened in 1901 and has three piers. " * 160]
             + [f"Is statement {i} about the harbor true?" for i in range(16)])
    default_threads = torch.get_num_threads()
    rows = []
    for threads in (default_threads, 1):
        torch.set_num_threads(threads)
        for busy in (False, True):
            stop = threading.Event()
            encoder = threading.Thread(
                target=lambda: [tokenizer.encode_many(claim) for _ in iter(stop.is_set, True)])
            if busy:
                encoder.start()
                time.sleep(0.2)
            row = {"threads": threads, "tokenizer_busy": busy, **timed(args.calls, args.rows)}
            stop.set()
            if busy:
                encoder.join()
            rows.append(row)
            print(f"threads {threads:3d}  tokenizer {'busy' if busy else 'idle'}:  p50 "
                  f"{row['p50_us']:7.1f} us  p99 {row['p99_us']:8.1f} us  max {row['max_ms']:6.2f}"
                  f" ms  {args.calls} steps {row['total_ms']:7.1f} ms")
    result = {"kind": "host_threads", "cpus": os.cpu_count(), "calls": args.calls,
              "rows": args.rows, "default_threads": default_threads, "rows_timed": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
