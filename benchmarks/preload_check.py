"""Does a kernel variant compiled through `JITFunction.preload` from its recorded specialization
data land under the same Triton cache key as the launch that recorded it? One process, a fresh
TRITON_CACHE_DIR: a two-layer engine runs one warm-up phase with a `jit_cache_hook` that records
each variant's data (and lets it compile), then each recorded variant is preloaded; every
`triton.compiler.compile` call is logged with the parts of its cache key, and the parts that
differ between a launch and its preload are printed.

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/preload_check.py --out preload_check.json
"""

from __future__ import annotations

import argparse
import json


def parts(compiler, src, target, options, env_vars) -> dict:
    backend = compiler.make_backend(target or compiler.driver.active.get_current_target())
    parsed = backend.parse_options(dict(options or {}, **src.parse_options()))
    env = compiler.get_cache_invalidating_env_vars() if env_vars is None else env_vars
    return {"kernel": src.name, "key": compiler.get_cache_key(src, backend, parsed, env),
            "fn_key": src.fn.cache_key, "attrs": str(src.attrs),
            "signature": str(sorted(src.signature.items())),
            "constants": str(sorted(src.constants.items())),
            "options": {k: str(v) for k, v in sorted(parsed.__dict__.items())},
            "env": str(sorted(env.items()))}


def compare(launched: list[dict], preloaded: list[dict]) -> list[dict]:
    rows = []
    for a, b in zip(launched, preloaded):
        diff = {k: [a[k], b[k]] for k in a if k != "options" and a[k] != b[k]}
        diff.update({f"options.{k}": [a["options"][k], b["options"].get(k)]
                     for k in a["options"] if a["options"][k] != b["options"].get(k)})
        rows.append({"kernel": a["kernel"], "same_key": a["key"] == b["key"], "diff": diff})
        print(a["kernel"], "same key" if a["key"] == b["key"] else f"DIFFERS: {diff}")
    return rows


def log_compiles() -> list[dict]:
    """A list that every Triton compile from now on appends its cache key's parts to.
    JITFunction takes `compile` from triton.compiler when its binder is made (first launch)."""
    import triton.compiler
    import triton.compiler.compiler as compiler

    logged: list[dict] = []
    original = compiler.compile

    def logging_compile(src, target=None, options=None, _env_vars=None):
        logged.append(parts(compiler, src, target, options, _env_vars))
        return original(src, target=target, options=options, _env_vars=_env_vars)

    compiler.compile = triton.compiler.compile = logging_compile
    return logged


def role(name: str, model: str, phase: str, folder: str) -> None:
    """One process of the cross-process check: `record` (the recorder helper's run, variants
    skipped), `preload` (a compiler helper: the recorded variants preloaded) or `launch` (a
    worker's warm-up phase); each logs its compile calls' key parts to FOLDER/NAME.json."""
    from pathlib import Path

    from ppqa.engine import precompile

    logged = log_compiles()
    folder = Path(folder)
    if name == "record":
        engine = precompile.shadow_engine(model, "cuda", {})
        phases = dict(engine.warmup_phases())
        engine.warmup_phases = lambda: [(phase, phases[phase])]
        precompile.record_variants(engine, folder)
    elif name == "preload":
        precompile._imports_for_compiling("cuda")
        precompile.compile_listed(folder)
    else:
        engine = precompile.shadow_engine(model, "cuda", {})
        dict(engine.warmup_phases())[phase]()
    (folder / f"{name}.json").write_text(json.dumps(logged))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:tiny-gqa")
    ap.add_argument("--phase", default="few-stock")
    ap.add_argument("--out", default="preload_check.json")
    ap.add_argument("--role", default=None, help="record | preload | launch (one process of "
                    "the cross-process check; FOLDER is --out)")
    args = ap.parse_args()
    if args.role:
        role(args.role, args.model, args.phase, args.out)
        return

    from triton import knobs

    from ppqa.engine import precompile

    logged = log_compiles()
    engine = precompile.shadow_engine(args.model, "cuda", {})
    recorded: dict[str, dict] = {}

    def hook(*, fn, compile, **_):
        recorded.setdefault(compile["specialization_data"],
                            {"module": fn.module, "name": fn.name})
        return None  # compile as usual

    knobs.runtime.jit_cache_hook = hook
    dict(engine.warmup_phases())[args.phase]()
    knobs.runtime.jit_cache_hook = None
    launched = list(logged)
    logged.clear()
    for spec, where in recorded.items():
        precompile.jit_function(where["module"], where["name"]).preload(spec)
    preloaded = list(logged)
    print("-- one process: launched, then preloaded")
    rows = compare(launched, preloaded)
    # Across processes, as the helpers and the worker run: each with its own empty cache.
    import os
    import subprocess
    import sys
    import tempfile

    folder = tempfile.mkdtemp(prefix="preload-check-")
    for name in ("record", "preload", "launch"):
        env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix=f"cache-{name}-")}
        subprocess.run([sys.executable, __file__, "--role", name, "--model", args.model,
                        "--phase", args.phase, "--out", folder], env=env, check=True)
    logs = {n: json.loads(open(os.path.join(folder, f"{n}.json")).read())
            for n in ("preload", "launch")}
    print("-- across processes: a worker's launch against a compiler's preload")
    by_kernel = {}
    for entry in logs["preload"]:
        by_kernel.setdefault(entry["kernel"], []).append(entry)
    pairs = []
    for a in logs["launch"]:
        near = by_kernel.get(a["kernel"], [])
        same = [b for b in near if b["key"] == a["key"]]
        pairs.append((a, same[0] if same else (near[0] if near else a)))
    cross = compare([a for a, _ in pairs], [b for _, b in pairs])
    with open(args.out, "w") as f:
        json.dump({"launched": len(launched), "preloaded": len(preloaded), "rows": rows,
                   "cross": cross, "cross_counts": {k: len(v) for k, v in logs.items()}}, f,
                  indent=1)


if __name__ == "__main__":
    main()
