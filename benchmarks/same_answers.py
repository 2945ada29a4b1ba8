"""Same answers with real weights: each mode's greedy answers against stock's, per dtype.

SmolLM2-135M-Instruct (the embedded model, real weights) answers questions about a real text
(examples/harrowmere.txt) greedily in every mode; each mode's token ids are compared question by
question with stock's, run over all the questions at once. Beside them, stock against itself
with the questions in another batch composition (two halves, one run each): in fp32 every row
should be all equal; in bf16 greedy tokens depend on the batch (reduction order in the kernels),
stock's included, and the halves row says how much of a mode's difference that alone explains
(README, "Same answers"). Writes JSON and prints a table.

    python3 benchmarks/same_answers.py --device cuda [--dtypes float32,bfloat16]
        [--modes stock,cascade,parallel] [--questions 20] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ppqa import Engine, QuestionRequest, SamplingParams  # noqa: E402
from ppqa.bench.grid import git_commit  # noqa: E402
from ppqa.config import EngineConfig  # noqa: E402

# Beyond examples/questions.txt's twelve: more questions about the same text, of other shapes.
MORE_QUESTIONS = [
    "Summarise the history of Harrowmere in two sentences.",
    "Which industries has Harrowmere depended on over time?",
    "List three events from the text in the order they happened.",
    "What role does Lake Tessel play in the town's life?",
    "Describe the Candle Fire and its consequences.",
    "Who are the people named in the text, and what did each do?",
    "What rules apply to fishing in Lake Tessel?",
    "How did the railway change Harrowmere?",
]


def questions(count: int) -> list[str]:
    listed = [line.strip() for line in (ROOT / "examples" / "questions.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    pool = listed + MORE_QUESTIONS
    if count > len(pool):
        raise SystemExit(f"--questions: at most {len(pool)}")
    return pool[:count]


def answer(engine: Engine, requests: list[QuestionRequest], mode: str) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    engine.run(requests, mode=mode, on_answer=lambda r, a: got.__setitem__(r.key, a.token_ids))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="stock,cascade,parallel")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "same_answers.json")
    args = ap.parse_args()

    document = (ROOT / "examples" / "harrowmere.txt").read_text()
    asked = questions(args.questions)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)  # greedy, ends at EOS
    requests = [QuestionRequest(i, document, q, sampling) for i, q in enumerate(asked)]
    half = len(requests) // 2
    rows = []
    for dtype in args.dtypes.split(","):
        began = time.perf_counter()
        engine = Engine(args.model, device=args.device, config=EngineConfig(dtype=dtype))
        whole = answer(engine, requests, "stock")
        halves = {**answer(engine, requests[:half], "stock"), **answer(engine, requests[half:], "stock")}
        runs = {"stock in two halves": halves}
        for mode in args.modes.split(","):
            if mode != "stock":
                runs[mode] = answer(engine, requests, mode)
        for name, got in runs.items():
            same = sum(got[i] == whole[i] for i in range(len(requests)))
            # How far the answers agree: the first token where each differs (None: equal).
            first = [next((t for t, (a, b) in enumerate(zip(got[i], whole[i])) if a != b),
                          None if got[i] == whole[i] else min(len(got[i]), len(whole[i])))
                     for i in range(len(requests))]
            rows.append({"dtype": dtype, "run": name, "same": same, "questions": len(requests),
                         "first_difference": first})
            print(f"{dtype:9s} {name:20s} {same}/{len(requests)} equal to stock run whole",
                  flush=True)
        print(f"{dtype}: {time.perf_counter() - began:.1f} s", flush=True)
        del engine

    payload = {"what": "greedy answers per mode against stock's, real weights, per dtype",
               "commit": git_commit(), "command": " ".join(sys.argv), "model": args.model,
               "device": args.device, "questions": len(requests),
               "max_new_tokens": args.max_new_tokens, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print("\n| dtype | run | equal to stock run whole |\n|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['run']} | {r['same']}/{r['questions']} |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
