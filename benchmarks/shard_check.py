"""Which kernel variants a worker's warm-up still compiles after the compile helpers ran, and
why none of the helpers did (GPU).

On an empty Triton cache: starts the shard helpers (`engine/precompile.py`), each recording
every variant it met (PPQA_SHARD_KEYS), waits for them, then warms an engine up in this
process and times each variant it builds. A variant that takes more than 50 ms was compiled
here, i.e. missed by the helpers: for each, the script prints its owner shard, whether that
shard met the same key, and the nearest key any helper met for the same kernel (a diff of the
two key texts), which names the argument whose specialisation differs.

    python3 benchmarks/shard_check.py --models dummy:tiny-gqa,dummy:codellama-7b+bpe --out /tmp/shards.json
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import triton
from triton.runtime.jit import JITFunction
built = []
original = JITFunction._do_compile
def timed(self, key, *args, **kwargs):
    began = time.perf_counter()
    out = original(self, key, *args, **kwargs)
    built.append([self.__name__, str(key), time.perf_counter() - began])
    return out
JITFunction._do_compile = timed
from ppqa import Engine
engine = Engine(sys.argv[1], device="cuda")
engine.warmup()
print("BUILT " + json.dumps(built))
"""


def check(model: str) -> dict:
    cache, keys = tempfile.mkdtemp(prefix="triton-"), tempfile.mkdtemp(prefix="keys-")
    env = {**os.environ, "TRITON_CACHE_DIR": cache, "PPQA_SHARD_KEYS": keys}
    env.pop("TRITON_INTERPRET", None)
    helpers = subprocess.run(
        [sys.executable, "-c", "from ppqa.engine import precompile; "
         f"precompile.start({model!r}, 'cuda:0'); print('WAIT', precompile.wait(), "
         "precompile.SHARDS)"], env=env, capture_output=True, text=True, timeout=300)
    worker = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True,
                            text=True, timeout=300)
    line = [x for x in worker.stdout.splitlines() if x.startswith("BUILT ")]
    if worker.returncode or not line:
        return {"model": model, "error": worker.stderr[-2000:], "helpers": helpers.stdout}
    built = json.loads(line[0][6:])
    from ppqa.engine import precompile

    met: dict[int, list] = {}
    for name in sorted(os.listdir(keys)):
        met[int(name.split("-")[1].split(".")[0])] = json.load(open(os.path.join(keys, name)))
    shards = len(met)
    missed = []
    for kernel, key, seconds in built:
        if seconds < 0.05:
            continue
        own = precompile.owner(key, precompile.SHARDS)
        seen_by = [i for i, pairs in met.items() if [kernel, key] in pairs]
        same_kernel = [k for pairs in met.values() for n, k in pairs if n == kernel]
        nearest = max(same_kernel, key=lambda k: difflib.SequenceMatcher(None, k, key).ratio(),
                      default="")
        diff = [d for d in difflib.ndiff(key.replace("), (", "),\n(").splitlines(),
                                         nearest.replace("), (", "),\n(").splitlines())
                if d[0] in "+-"]
        missed.append({"kernel": kernel, "seconds": round(seconds, 3), "owner": own,
                       "seen_by": seen_by, "key": key, "nearest": nearest,
                       "diff": diff[:40]})
    return {"model": model, "helpers": helpers.stdout.strip(), "shards": shards,
            "variants_built": len(built), "missed": missed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dummy:tiny-gqa")
    ap.add_argument("--out", default="/tmp/shard_check.json")
    args = ap.parse_args()
    results = [check(m) for m in args.models.split(",")]
    json.dump(results, open(args.out, "w"), indent=1)
    for r in results:
        print(r["model"], r.get("helpers"), "built", r.get("variants_built"),
              "missed", len(r.get("missed", [])), r.get("error", "")[-500:])
        for m in r.get("missed", []):
            print(f"  {m['kernel']} {m['seconds']} s owner {m['owner']} seen by {m['seen_by']}")
            for d in m["diff"][:12]:
                print("     ", d[:160])


if __name__ == "__main__":
    main()
