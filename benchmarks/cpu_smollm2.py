"""CPU benchmark: `parallel` (and `cascade`) against `stock` with SmolLM2-135M on this machine.

32 questions about a ~2,000-token document (the seeded synthetic text of `ppqa bench`), 32 answer
tokens each (EOS ignored, greedy), the document cached before timing as the paper does. Each mode's
wall time is split into question prefill and decode as reported by `Engine.run`; answers are
checked to be identical across modes. Writes benchmarks/results/cpu/smollm2.json (RESULTS.md,
"CPU: SmolLM2-135M") and prints a table.

    .venv/bin/python benchmarks/cpu_smollm2.py [--modes stock parallel cascade] [--passes 1]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ppqa import Engine, QuestionRequest, SamplingParams  # noqa: E402
from ppqa.bench.grid import git_commit, make_workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=None, help="P for parallel (default 32)")
    parser.add_argument("--modes", nargs="+", default=["stock", "parallel", "cascade"])
    parser.add_argument("--passes", type=int, default=1, help="passes; odd ones reverse the order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 avoids OpenMP spin-waits on a busy machine)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu" / "smollm2.json")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    engine = Engine(args.model, device="cpu")
    load_s = time.perf_counter() - started
    document, questions = make_workload(engine.tokenizer, args.doc_tokens, args.questions, args.seed)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    requests = [QuestionRequest(i, document, q, sampling) for i, q in enumerate(questions)]
    begin = time.perf_counter()
    engine.answer(document, questions[:1], mode="stock",
                  sampling=SamplingParams(max_new_tokens=1, ignore_eos=True))
    doc_prefill_s = time.perf_counter() - begin

    runs, answers_by_mode = [], {}
    for p in range(args.passes):
        for mode in (args.modes if p % 2 == 0 else list(reversed(args.modes))):
            got: dict[int, list[int]] = {}
            t0 = time.perf_counter()
            stats = engine.run(requests, mode=mode, streams=args.streams,
                               on_answer=lambda r, a: got.__setitem__(r.key, a.token_ids))
            wall = time.perf_counter() - t0
            answers_by_mode[mode] = [got[i] for i in range(len(questions))]
            runs.append({"mode": mode, "pass": p, "wall_s": wall, "prefill_s": stats.prefill_s,
                         "decode_s": stats.decode_s, "steps": stats.steps, "streams": stats.streams,
                         "prompt_tokens": stats.prompt_tokens, "answer_tokens": stats.answer_tokens})
            print(f"pass {p} {mode:8s} {wall:8.2f} s (prefill {stats.prefill_s:.2f}, "
                  f"decode {stats.decode_s:.2f}, {stats.steps} steps)", flush=True)

    def mean(mode: str, key: str) -> float:
        values = [r[key] for r in runs if r["mode"] == mode]
        return sum(values) / len(values)

    reference = answers_by_mode.get("stock")
    summary = {m: {"wall_s": mean(m, "wall_s"), "prefill_s": mean(m, "prefill_s"),
                   "decode_s": mean(m, "decode_s"),
                   "same_tokens_as_stock": None if reference is None else answers_by_mode[m] == reference}
               for m in args.modes}
    if "stock" in summary:
        for m in args.modes:
            summary[m]["speedup_vs_stock"] = summary["stock"]["wall_s"] / summary[m]["wall_s"]
            summary[m]["decode_speedup_vs_stock"] = summary["stock"]["decode_s"] / summary[m]["decode_s"]
    payload = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                    "load_average": os.getloadavg()},
        "commit": git_commit(), "command": " ".join(sys.argv),
        "model": args.model, "doc_tokens": args.doc_tokens,
        "prompt_prefix_tokens": len(engine.tokenizer.prompt("qa", document, questions[:1]).prefix_ids),
        "questions": args.questions, "max_new_tokens": args.max_new_tokens,
        "load_s": load_s, "doc_prefill_s": doc_prefill_s, "summary": summary, "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))

    print(f"\n{args.model} on CPU ({torch.get_num_threads()} threads): {args.questions} questions, "
          f"document {args.doc_tokens} tokens, {args.max_new_tokens} answer tokens; "
          f"document prefill (cached before timing) {doc_prefill_s:.1f} s")
    print("| mode | wall s | question prefill s | decode s | speedup | decode speedup | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for m, s in summary.items():
        print(f"| {m} | {s['wall_s']:.2f} | {s['prefill_s']:.2f} | {s['decode_s']:.2f} | "
              f"{s.get('speedup_vs_stock', float('nan')):.2f}x | "
              f"{s.get('decode_speedup_vs_stock', float('nan')):.2f}x | {s['same_tokens_as_stock']} |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
