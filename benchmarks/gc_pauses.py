"""What one full garbage collection costs a process that holds an engine, and after the freeze.

Imports what `ppqa run` imports, builds the engine (and, with --warmup, runs its warm-up, which
compiles kernels and captures graphs on a GPU), answers one small job through a session, then
times `gc.collect()` over the heap as it is (the walk a generation-2 collection makes at
whatever line allocates next) and again after `gc.freeze()` (what vLLM and SGLang do to their
serving processes after start-up: later collections skip the objects alive then). Prints the
tracked objects and milliseconds; writes them to --out.

    python benchmarks/gc_pauses.py --model dummy:tiny-gqa --device cpu --out gc.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time


def collect_ms(repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:tiny-gqa")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup", action="store_true", help="run the engine's warm-up first")
    ap.add_argument("--out", default="gc_pauses.json")
    args = ap.parse_args()

    import ppqa.cli.app  # noqa: F401  (the CLI's own imports, as `ppqa run` has them)
    import ppqa.worker.loop  # noqa: F401
    from ppqa import Engine

    engine = Engine(args.model, device=args.device)
    if args.warmup:
        engine.warmup()
    engine.answer("The ferry to Velm leaves every hour from the north pier.",
                  ["When does the ferry leave?"])
    result = {"model": engine.model_name, "device": str(engine.device), "warmup": args.warmup,
              "tracked_objects": len(gc.get_objects()), "full_collection_ms": collect_ms()}
    gc.freeze()  # collect_ms has just collected: nothing dead is frozen
    result.update(frozen_objects=gc.get_freeze_count(),
                  full_collection_after_freeze_ms=collect_ms())
    gc.unfreeze()
    print(f"{result['model']} on {result['device']}: {result['tracked_objects']} tracked objects, "
          f"a full collection {result['full_collection_ms']:.1f} ms; after the freeze "
          f"({result['frozen_objects']} frozen) {result['full_collection_after_freeze_ms']:.2f} ms")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
