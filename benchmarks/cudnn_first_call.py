"""What a process's first cuDNN attention call costs, and how much of it another thread can pay.

A fresh `ppqa run` process meets cuDNN first in its first document's prefill (torch's fused
causal attention, then the chunk path's calls with their log-sum-exp). That first call loads
the library and builds its state (~0.6 s in results/h200/sdpa_lengths_s14c1.json), and each
new shape builds a plan. Some of that is process-wide and some per thread (torch keeps a cuDNN
handle per thread). Each case runs in a fresh process:
  main:   the first call, at a document chunk's shape, on the main thread;
  thread: a tiny cuDNN call on a background thread first (as while the model loads), then
          the same first call at the chunk's shape on the main thread.
Both then time a second call at a new length (a plan) and a third at the same one.

    python3 benchmarks/cudnn_first_call.py --out cudnn_first_call.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def child(case: str) -> dict:
    import threading

    import torch

    dev = torch.device("cuda")
    torch.zeros(1, device=dev)  # the CUDA context, as the engine has it by then
    torch.cuda.synchronize()

    def call(tokens: int, heads: int = 32) -> float:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(1, heads, tokens, 128, dtype=torch.bfloat16, device=dev)
        t0 = time.perf_counter()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    out = {"case": case}
    if case == "thread":
        t0 = time.perf_counter()
        worker = threading.Thread(target=lambda: out.setdefault("thread_call_s", call(64, 1)))
        worker.start()
        worker.join()
        out["thread_wall_s"] = time.perf_counter() - t0
    out["first_s"] = call(2048)
    out["new_length_s"] = call(3072)
    out["again_s"] = call(3072)
    return out


def in_fresh_processes(script: str, cases: tuple[str, ...], repeats: int) -> list[dict]:
    """Each case of `script` (`--child CASE`, which prints its result as JSON last) in a
    fresh process, all cases `repeats` times in turn; each result printed as it comes."""
    results = []
    for _ in range(repeats):
        for case in cases:
            run = subprocess.run([sys.executable, script, "--child", case], check=True,
                                 capture_output=True, text=True)
            result = json.loads(run.stdout.strip().splitlines()[-1])
            results.append(result)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()},
                  flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="cudnn_first_call.json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    results = in_fresh_processes(__file__, ("main", "thread"), args.repeats)
    with open(args.out, "w") as f:
        json.dump({"runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
