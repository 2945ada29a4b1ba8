"""Where a worker's start-up goes: imports, the device, weights, the KV pool, warm-up.

Times each phase of what `ppqa run` does before its first claim, in one process, then profiles
`Engine(...)` and `Engine.warmup()` with cProfile (the functions with the most cumulative time).
Run it twice, once with an empty Triton cache (TRITON_CACHE_DIR=$(mktemp -d)), to see what
compiling costs. The warm-up is timed phase by phase (`Engine.warmup_phases`), with the Triton
compilations each phase met: kernel, seconds, specialisation.

    python3 benchmarks/startup_profile.py --model dummy:codellama-7b+bpe --out startup.json
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402


def top(profile: cProfile.Profile, n: int = 25) -> list[str]:
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats("cumulative").print_stats(n)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-n:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:codellama-7b+bpe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="startup.json")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--helpers", action="store_true",
                    help="start compile helpers first, as `ppqa run` does (engine/precompile.py; "
                         "none start where the Triton cache holds this model's marker)")
    ap.add_argument("--warmup", default="cold", choices=["always", "cold"],
                    help="as `ppqa run --warmup`: 'cold' skips the warm-up where the Triton "
                         "cache holds the model's marker")
    ap.add_argument("--job", default=None, metavar="DOC,QUESTIONS,TOKENS",
                    help="after ready, run one job (a synthetic document of DOC tokens, QUESTIONS "
                         "questions, TOKENS answer tokens, cascade) twice and time both: what "
                         "the first use of the GPU libraries and kernels costs a run, e.g. "
                         "2048,16,16")
    ap.add_argument("--layout", default=None, choices=["record", "phases"],
                    help="with --helpers: how they split the compiling (engine/precompile.py; "
                         "default: precompile.default_layout(), as `ppqa run`)")
    ap.add_argument("--groups", default=None,
                    help="with --helpers: the warm-up phases per helper, to compare layouts "
                         "(e.g. 'long|many|few-stock,mixed'; default precompile.HELPER_PHASES)")
    args = ap.parse_args()
    phases = {}
    if args.helpers:
        from ppqa.engine import precompile

        if args.groups:
            precompile.HELPER_PHASES = tuple(tuple(g.split(",")) for g in args.groups.split("|"))
        args.layout = args.layout or precompile.default_layout()
        phases["helper_layout"] = args.layout
        phases["helper_groups"] = [list(g) for g in precompile.HELPER_PHASES]
        phases["helpers_started"] = len(precompile.start(args.model, args.device,
                                                         layout=args.layout))
    t = time.perf_counter()
    import torch

    phases["import_torch_s"] = time.perf_counter() - t
    t = time.perf_counter()
    from ppqa.engine.engine import Engine  # noqa: F401
    from ppqa.config import EngineConfig

    phases["import_ppqa_engine_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if args.device.startswith("cuda"):
        torch.zeros(1, device=args.device).add_(1).item()
    phases["device_init_s"] = time.perf_counter() - t
    prof = cProfile.Profile()
    t = time.perf_counter()
    if not args.no_profile:
        prof.enable()
    engine = Engine(args.model, device=args.device, config=EngineConfig())
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    prof.disable()
    phases["engine_build_s"] = time.perf_counter() - t
    phases["first_use_s"] = dict(engine.parts.first_use.seconds)  # the thread's steps
    if args.helpers:
        phases["helpers_wait"] = precompile.last_wait  # (finished well, started, seconds)
        phases["helpers"] = precompile.last_reports  # each helper's phases and own timing
    build_top = top(prof) if not args.no_profile else []
    compiles = count_compiles()
    prof2 = cProfile.Profile()
    t = time.perf_counter()
    if not args.no_profile:
        prof2.enable()
    by_phase = {}
    phases["warmup_skipped"] = args.warmup == "cold" and engine.kernels_cached()
    for name, phase in [] if phases["warmup_skipped"] else engine.warmup_phases():
        began, seen = time.perf_counter(), len(compiles)
        phase()
        by_phase[name] = {"seconds": round(time.perf_counter() - began, 3),
                          "compiles": compiles[seen:]}
        print(f"warm-up phase {name}: {by_phase[name]['seconds']:.2f} s, "
              f"{len(compiles) - seen} compilations "
              f"({sum(c[1] for c in compiles[seen:]):.2f} s)", flush=True)
    prof2.disable()
    if args.device.startswith("cuda"):  # as Engine.warmup does: the next start needs no helpers
        from ppqa.engine import precompile

        precompile.mark_warm(engine.model_name, vars(engine.config))
    phases["warmup_s"] = time.perf_counter() - t
    warm_top = top(prof2) if not args.no_profile else []
    phases["process_to_ready_s"] = time.perf_counter() - T0
    phases["graphs"] = engine.captured_graphs
    phases["triton_cache_dir"] = os.environ.get("TRITON_CACHE_DIR", "default")
    if args.job:
        phases["job"] = time_job(engine, args.job, compiles)
    print(json.dumps(phases, indent=1))
    print("--- Engine() by cumulative time")
    print("\n".join(build_top))
    print("--- warmup() by cumulative time")
    print("\n".join(warm_top))
    with open(args.out, "w") as f:
        json.dump({"phases": phases, "warmup_phases": by_phase, "build_top": build_top,
                   "warmup_top": warm_top}, f, indent=1)


def time_job(engine, spec: str, compiles: list) -> dict:
    """The same small job run twice right after ready: seconds of each (the device synchronised)
    and the compilations the first met."""
    import torch

    from ppqa import SamplingParams
    from ppqa.engine.engine import _synthetic_text

    doc_tokens, questions, tokens = (int(x) for x in spec.split(","))
    doc = _synthetic_text(engine.tokenizer, doc_tokens)
    asked = [f"What happened in paragraph {i}?" for i in range(questions)]
    sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    seconds, seen = [], len(compiles)
    for _ in range(2):
        t0 = time.perf_counter()
        engine.answer(doc, asked, mode="cascade", sampling=sampling)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(round(time.perf_counter() - t0, 3))
    return {"spec": spec, "first_s": seconds[0], "again_s": seconds[1],
            "first_compiles": compiles[seen:], "graphs_after": engine.captured_graphs}


def count_compiles() -> list:
    """A list that each Triton compilation from now on appends [kernel, seconds, key] to (a
    compilation served from the disk cache takes milliseconds)."""
    seen: list = []
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return seen
    original = JITFunction._do_compile

    def counted(self, *a, **k):
        t0 = time.perf_counter()
        out = original(self, *a, **k)
        seen.append([getattr(self, "__name__", str(self)), round(time.perf_counter() - t0, 3),
                     str(a[3])[:200]])
        return out

    JITFunction._do_compile = counted
    return seen


if __name__ == "__main__":
    main()
