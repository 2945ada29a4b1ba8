"""The decode-step cost of JSON answers in the engine: the same workload with a JSON schema's
mask and without it.

N questions about one seeded document (`ppqa bench`'s synthetic text), greedy. First every
question is answered under the 5-field schema (`ppqa.bench.workloads.JSON_SCHEMA`; each
step's forward launched behind the step in flight, whose tokens the matchers then consume, the
mask filled on the host while the forward runs and applied to its logits); then the same
questions without a schema, each given exactly its constrained answer's length as its budget
with EOS ignored, so both runs decode the same streams for the same number of steps and the
ratio of their decode seconds is the ratio of their step costs. The document is cached and a
warm-up run compiles and captures before timing; passes alternate the order. Each run also
reports `overlapped_steps` (decode steps launched before the one in flight was read back).

    python benchmarks/grammar_step.py --model dummy:qwen2.5-1.5b+bpe --device cuda \
        --questions 256 --doc-tokens 2000 --out benchmarks/results/h200/grammar_step.json
    .venv/bin/python benchmarks/grammar_step.py --model dummy:tiny-gqa+bpe --questions 64 --threads 1

Prints and writes {mode: {constrained_decode_s, free_decode_s, ratio, ...}}, each the fastest
of its passes (every pass is in `runs`).

`--profile` instead runs each workload once under cProfile (after the warm-up) and reports the
host's milliseconds per decode step in the pieces of a constrained step (`HOST_PIECES`): on the
CPU, where the forward is synchronous, this is where a step's host time goes.

    .venv/bin/python benchmarks/grammar_step.py --model dummy:tiny-gqa+bpe --questions 256 \
        --max-new-tokens 32 --threads 1 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import sys
import time
import pstats
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ppqa import Engine, QuestionRequest, SamplingParams  # noqa: E402
from ppqa.bench.grid import git_commit, make_workload  # noqa: E402
from ppqa.bench.workloads import JSON_SCHEMA  # noqa: E402
from ppqa.json_schema import schema_text  # noqa: E402


# (file ending, function) -> label: the host pieces of a decode step, cumulative times.
HOST_PIECES = {
    ("runtime/scheduler.py", "decode_step"): "step building (decode_step)",
    ("runtime/batching.py", "grammar_rows"): "  of which grammar rows",
    ("runtime/runner.py", "run"): "forwards (runner.run, prefill too)",
    ("runtime/grammar.py", "bitmask"): "mask fill (GrammarRows.bitmask)",
    ("runtime/sampling.py", "apply_token_bitmask"): "mask applied (apply_token_bitmask)",
    ("runtime/sampling.py", "sample"): "sample (mask fill and apply included)",
    ("engine/session.py", "_finish"): "read back + postprocess (_finish, prefill too)",
    ("runtime/request.py", "accept"): "  of which Request.accept",
    ("runtime/grammar.py", "accept_token"): "    of which matchers consume",
    ("engine/session.py", "_decode"): "decode step in all (_decode)",
}


def run(engine: Engine, requests: list[QuestionRequest], mode: str) -> tuple[dict, object]:
    answers = {}
    stats = engine.run(requests, mode=mode, on_answer=lambda r, a: answers.__setitem__(r.key, a))
    return answers, stats


def profile_host(engine: Engine, requests: list[QuestionRequest], mode: str) -> dict:
    """One run under cProfile: milliseconds per decode step of each of HOST_PIECES."""
    profile = cProfile.Profile()
    profile.enable()
    _, stats = run(engine, requests, mode)
    profile.disable()
    totals = {label: 0.0 for label in HOST_PIECES.values()}
    steps = 0
    for (path, _, name), row in pstats.Stats(profile).stats.items():
        for (ending, function), label in HOST_PIECES.items():
            if name == function and path.endswith(ending):
                totals[label] += row[3]
                if function == "_decode":
                    steps += row[1]
    return {"decode_steps": steps, "decode_s": round(stats.decode_s, 4),
            "ms_per_step": {k: round(1000 * v / max(steps, 1), 3) for k, v in totals.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:tiny-gqa+bpe")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--modes", nargs="+", default=["stock", "cascade"])
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 avoids OpenMP spin-waits on a busy machine)")
    parser.add_argument("--profile", action="store_true",
                        help="host ms per decode step by piece (cProfile); no timed passes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)

    engine = Engine(args.model, device=args.device, dtype=args.dtype)
    document, questions = make_workload(engine.tokenizer, args.doc_tokens, args.questions, args.seed)
    schema = JSON_SCHEMA
    constrained = [QuestionRequest(i, document, q, SamplingParams(
        max_new_tokens=args.max_new_tokens, json_schema=schema_text(schema)))
        for i, q in enumerate(questions)]
    result = {"what": "decode seconds with a JSON schema's mask against without, same steps",
              "commit": git_commit(), "model": args.model, "device": str(engine.device),
              "dtype": str(engine.dtype), "python": platform.python_version(),
              "questions": args.questions, "doc_tokens": args.doc_tokens, "schema": schema,
              "modes": {}}
    for mode in args.modes:
        answers, _ = run(engine, constrained, mode)  # warm-up: compile, capture, cache
        lengths = {k: max(1, len(a.token_ids)) for k, a in answers.items()}
        free = [QuestionRequest(r.key, document, r.question, SamplingParams(
            max_new_tokens=lengths[r.key], ignore_eos=True)) for r in constrained]
        run(engine, free, mode)
        if args.profile:
            result["modes"][mode] = {kind: profile_host(engine, reqs, mode) for kind, reqs in
                                     (("constrained", constrained), ("free", free))}
            for kind, got in result["modes"][mode].items():
                print(mode, kind, json.dumps(got, indent=1), file=sys.stderr)
            continue
        timed = {"constrained": [], "free": []}
        for p in range(args.passes):
            order = ("constrained", "free") if p % 2 == 0 else ("free", "constrained")
            for kind in order:
                begin = time.perf_counter()
                got, stats = run(engine, constrained if kind == "constrained" else free, mode)
                timed[kind].append({"wall_s": time.perf_counter() - begin,
                                    "decode_s": stats.decode_s, "steps": stats.steps,
                                    "overlapped_steps": stats.overlapped_steps,
                                    "answer_tokens": stats.answer_tokens})
        valid = sum(1 for a in answers.values() if a.finish_reason == "stop")
        # The fastest pass of each: the least disturbed by whatever else the machine runs.
        best = {k: min(t["decode_s"] for t in v) for k, v in timed.items()}
        result["modes"][mode] = {
            "constrained_decode_s": round(best["constrained"], 4),
            "free_decode_s": round(best["free"], 4),
            "ratio": round(best["constrained"] / best["free"], 3),
            "answers_completed": valid, "answer_tokens_mean": round(
                sum(lengths.values()) / len(lengths), 1), "runs": timed}
        print(mode, json.dumps({k: v for k, v in result["modes"][mode].items() if k != "runs"}),
              file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
