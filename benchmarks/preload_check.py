"""Does a kernel variant compiled through `JITFunction.preload` from its recorded specialization
data land under the same Triton cache key as the launch that recorded it? One process, a fresh
TRITON_CACHE_DIR: a two-layer engine runs one warm-up phase with a `jit_cache_hook` that records
each variant's data (and lets it compile), then each recorded variant is preloaded; every
`triton.compiler.compile` call is logged with the parts of its cache key, and the parts that
differ between a launch and its preload are printed. Then the same across processes, as the
record layout's helpers and a worker run (`cross_process`): the variants the recorder lists
(launches skipped) against those real launches ask for, and what a worker compiles after the
compilers preloaded the list.

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/preload_check.py --out preload_check.json
    python3 benchmarks/preload_check.py --cross-only --phase all --out cross.json
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


def key_diff(a: dict, b: dict) -> dict:
    """The parts of two logged compile keys (`parts`) that differ, options one by one."""
    d = {k: [a[k], b[k]] for k in a if k not in ("options", "key") and a[k] != b[k]}
    d.update({f"options.{k}": [a["options"][k], b["options"].get(k)]
              for k in a["options"] if a["options"][k] != b["options"].get(k)})
    return d


def compare(launched: list[dict], preloaded: list[dict]) -> list[dict]:
    rows = []
    for a, b in zip(launched, preloaded):
        diff = key_diff(a, b)
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


def run_phases(engine, phase: str) -> None:
    """The warm-up phase `phase` of `engine`, or every phase in order for `all`."""
    for name, run in engine.warmup_phases():
        if phase in ("all", name):
            run()


def role(name: str, model: str, phase: str, folder: str) -> None:
    """One process of the cross-process check, each on its own TRITON_CACHE_DIR except
    `relaunch`: `record` (the recorder helper's run, variants skipped), `preload` (a compiler
    helper: the recorded variants preloaded), `launch` (a worker's warm-up phases, each variant's
    specialization data noted), `relaunch` (the phases again on `preload`'s cache: what a
    worker compiles after the helpers) and `worker` (as `launch`, on the whole model with a
    worker's pool; it also writes every Triton function's key, `jit_keys`). Each logs its compile calls' key parts to
    FOLDER/NAME.json."""
    from pathlib import Path

    from triton import knobs

    from ppqa.engine import compile_helper

    logged = log_compiles()
    folder = Path(folder)
    if name == "record":
        engine = compile_helper.shadow_engine(model, "cuda", {})
        phases = engine.warmup_phases
        engine.warmup_phases = lambda: [(n, r) for n, r in phases() if phase in ("all", n)]
        report = compile_helper.record_variants(engine, folder)
        (folder / "record_report.json").write_text(json.dumps(report))
    elif name == "preload":
        compile_helper.imports_for_compiling("cuda")
        compile_helper.compile_listed(folder)
    else:
        if name == "worker":  # the whole model and a worker's pool, as the GPU test's worker
            from ppqa import Engine
            from ppqa.config import EngineConfig

            engine = Engine(model, device="cuda", config=EngineConfig(mem_fraction=0.05))
        else:
            engine = compile_helper.shadow_engine(model, "cuda", {})
        specs: dict[str, dict] = {}

        def hook(*, fn, compile, **_):
            spec = compile["specialization_data"]
            specs.setdefault(spec, {"module": fn.module, "name": fn.name, "spec": spec})
            return None  # compile as usual

        knobs.runtime.jit_cache_hook = hook
        run_phases(engine, phase)
        knobs.runtime.jit_cache_hook = None
        (folder / f"{name}_specs.json").write_text(json.dumps(list(specs.values())))
        (folder / f"jitkeys-{name}.json").write_text(json.dumps(jit_keys()))
    (folder / f"{name}.json").write_text(json.dumps(logged))


def spec_diff(a: dict, b: dict) -> dict:
    """The fields of two specialization data objects (parsed) that differ."""
    out = {}
    for k in sorted(set(a) | set(b)):
        if k in ("constant_keys", "constant_vals", "attrs_keys", "attrs_vals"):
            continue
        if a.get(k) != b.get(k):
            if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
                out.update({f"{k}.{f}": [a[k].get(f), b[k].get(f)]
                            for f in sorted(set(a[k]) | set(b[k])) if a[k].get(f) != b[k].get(f)})
            else:
                out[k] = [a.get(k), b.get(k)]
    for keys, vals in (("constant_keys", "constant_vals"), ("attrs_keys", "attrs_vals")):
        da = {str(x): v for x, v in zip(a[keys], a[vals])}
        db = {str(x): v for x, v in zip(b[keys], b[vals])}
        out.update({f"{vals}{k}": [da.get(k), db.get(k)]
                    for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)})
    return out


def nearest(entry: dict, candidates: list[dict], differ) -> tuple[dict | None, dict]:
    """The candidate (of the same kernel) with the fewest differing parts, and those parts."""
    best, best_diff = None, {}
    for c in candidates:
        d = differ(entry, c)
        if best is None or len(d) < len(best_diff):
            best, best_diff = c, d
    return best, best_diff


def read_json(folder: str, name: str):
    with open(f"{folder}/{name}") as f:
        return json.load(f)


def uncompiled_keys(asked: list[dict], compiled: list[dict], label: str) -> list[dict]:
    """The logged compile keys of `asked` that no entry of `compiled` has, each with the parts
    that differ from the nearest compiled key of its kernel, printed."""
    have = {e["key"] for e in compiled}
    rows = []
    for e in asked:
        if e["key"] in have:
            continue
        near = [b for b in compiled if b["kernel"] == e["kernel"]]
        _, diff = nearest(e, near, key_diff)
        rows.append({"kernel": e["kernel"], "nearest_compiled_diff": diff})
        print(f"{label}, not compiled before:", e["kernel"], diff if near else "(kernel never compiled)")
    return rows


def not_listed(asked: list[dict], listed: dict, label: str) -> list[dict]:
    """The variants of `asked` ({"name", "spec"}) missing from `listed` (spec -> variant), each
    with the fields that differ from the nearest listed variant of its kernel, printed."""
    rows = []
    for v in asked:
        if v["spec"] in listed:
            continue
        same_kernel = [json.loads(r["spec"]) for r in listed.values() if r["name"] == v["name"]]
        _, diff = nearest(json.loads(v["spec"]), same_kernel, spec_diff)
        rows.append({"kernel": v["name"], "nearest_listed_diff": diff})
        print(f"{label}, not listed:", v["name"], diff if same_kernel else "(kernel never listed)")
    return rows


def cross_process(model: str, phase: str) -> dict:
    """record, preload, launch and relaunch in separate processes (`role`); what the recorder
    missed or saw differently from real launches, and what a worker compiled after the
    compilers, with the parts that differ from the nearest preloaded variant."""
    import os
    import subprocess
    import sys
    import tempfile

    folder = tempfile.mkdtemp(prefix="preload-check-")
    caches = {n: tempfile.mkdtemp(prefix=f"cache-{n}-")
              for n in ("record", "preload", "launch", "worker")}
    caches["relaunch"] = caches["preload"]
    for name in ("record", "preload", "launch", "relaunch", "worker"):
        env = {**os.environ, "TRITON_CACHE_DIR": caches[name]}
        subprocess.run([sys.executable, __file__, "--role", name, "--model", model,
                        "--phase", phase, "--out", folder], env=env, check=True)

    def load(name):
        return read_json(folder, name)

    recorded = {v["spec"]: v for v in load("variants.json")}
    launched = {v["spec"]: v for v in load("launch_specs.json")}
    only_recorded = [v for s, v in recorded.items() if s not in launched]
    spec_rows = not_listed(list(launched.values()), recorded, "launched")
    print(f"-- specs: recorded {len(recorded)}, launched {len(launched)}, "
          f"launched only {len(spec_rows)}, recorded only {len(only_recorded)}")
    for v in only_recorded:
        print("recorded, not launched:", v["name"])
    worker = load("worker_specs.json")
    worker_rows = not_listed(worker, recorded, "worker")
    print(f"-- the whole model with a worker's pool: {len(worker)} variants, "
          f"{len(worker_rows)} not recorded")

    preload_keys, relaunch_keys = load("preload.json"), load("relaunch.json")
    key_rows = uncompiled_keys(relaunch_keys, preload_keys, "relaunch")
    print(f"-- keys: preloaded {len(preload_keys)}, relaunch compiles {len(relaunch_keys)}, "
          f"not preloaded {len(key_rows)}")
    return {"recorded": len(recorded), "launched": len(launched),
            "record_report": load("record_report.json"), "only_launched": spec_rows,
            "only_recorded": [v["name"] for v in only_recorded], "misses": key_rows,
            "worker": len(worker), "only_worker": worker_rows}


def record_layout(model: str) -> dict:
    """The `record` layout as `ppqa run` starts it (real helpers, on an empty cache), then a
    worker's warm-up (`role` worker) on that cache: the variants it asks for that the list
    lacks, and the cache entries it adds, with their files' names."""
    import os
    import subprocess
    import sys
    import tempfile

    from ppqa.engine import precompile

    cache = tempfile.mkdtemp(prefix="cache-layout-")
    os.environ["TRITON_CACHE_DIR"] = cache  # the helpers inherit it
    # Each helper runs as `start` makes it, through this file, which logs its compile calls'
    # key parts beside its log (`helper_main`).
    real_popen = subprocess.Popen

    def logging_popen(command, **kwargs):
        if command[1:3] == ["-m", "ppqa.engine.compile_helper"]:
            command = [command[0], __file__, "--helper", *command[3:]]
        return real_popen(command, **kwargs)

    precompile.subprocess.Popen = logging_popen
    try:
        helpers = precompile.start(model, "cuda:0", layout="record")
    finally:
        precompile.subprocess.Popen = real_popen
    waited = precompile.wait()
    folder = str(helpers[0].log.parent)

    def entries():
        return {e: sorted(os.listdir(os.path.join(cache, e))) for e in os.listdir(cache)
                if os.path.isdir(os.path.join(cache, e))}

    before = entries()
    subprocess.run([sys.executable, __file__, "--role", "worker", "--model", model,
                    "--phase", "all", "--out", folder], check=True)
    after = entries()
    new = {e: files for e, files in after.items() if e not in before}
    recorded = {v["spec"]: v for v in read_json(folder, "variants.json")}
    worker = read_json(folder, "worker_specs.json")
    rows = not_listed(worker, recorded, "worker")
    print(f"-- {model}: helpers {waited}, listed {len(recorded)}, worker asked {len(worker)}, "
          f"not listed {len(rows)}; cache entries {len(before)} -> {len(after)}")
    for entry, files in new.items():
        print("new entry:", entry[:12], files)
    helper_keys = [e for path in sorted(os.listdir(folder)) if path.startswith("keys-")
                   for e in read_json(folder, path)]
    key_rows = uncompiled_keys(read_json(folder, "worker.json"), helper_keys, "worker")
    worker_jit = read_json(folder, "jitkeys-worker.json")
    for path in sorted(os.listdir(folder)):
        if path.startswith("jitkeys-") and path != "jitkeys-worker.json":
            theirs = read_json(folder, path)
            for fn, mine in worker_jit.items():
                if theirs.get(fn, {}).get("key") != mine["key"]:
                    print(path, fn, "worker", mine, "helper", theirs.get(fn))
    return {"model": model, "helpers": waited, "reports": precompile.last_reports,
            "listed": len(recorded), "worker": len(worker), "not_listed": rows,
            "new_entries": new, "helper_keys": len(helper_keys), "key_misses": key_rows}


def jit_keys() -> dict:
    """Every Triton function of ppqa.kernels: its cache key as this process has it (a key not
    yet computed is computed now) and the constexpr globals it has recorded."""
    import importlib
    import pkgutil

    import ppqa.kernels
    from triton.runtime.jit import JITFunction

    keys = {}
    for info in pkgutil.iter_modules(ppqa.kernels.__path__):
        module = importlib.import_module(f"ppqa.kernels.{info.name}")
        for name, fn in sorted(vars(module).items()):
            if isinstance(fn, JITFunction) and fn.__module__ == module.__name__:
                was = fn.hash
                keys[f"{info.name}.{name}"] = {
                    "key": fn.cache_key, "computed_before": was is not None,
                    "globals": [[n, str(v)] for (n, _), (v, _) in fn.used_global_vals.items()]}
    return keys


def helper_main(argv: list[str]) -> int:
    """A compile helper (`compile_helper.main`) that also writes its compile calls' key parts to
    keys-<pid>.json in its folder."""
    import os
    from pathlib import Path

    from ppqa.engine import compile_helper

    logged = log_compiles()
    folder = Path(argv[argv.index("--record" if "--record" in argv else "--compile") + 1])
    try:
        return compile_helper.main(argv)
    finally:
        (folder / f"keys-{os.getpid()}.json").write_text(json.dumps(logged))
        (folder / f"jitkeys-{os.getpid()}.json").write_text(json.dumps(jit_keys()))


def main() -> None:
    import sys

    if sys.argv[1:2] == ["--helper"]:
        sys.exit(helper_main(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:tiny-gqa")
    ap.add_argument("--phase", default="few-stock")
    ap.add_argument("--out", default="preload_check.json")
    ap.add_argument("--record-layout", action="store_true",
                    help="the record layout's helpers, then a worker on their cache (--model: "
                         "one or more, comma-separated)")
    ap.add_argument("--cross-only", action="store_true",
                    help="only the cross-process check (--phase all: every warm-up phase)")
    ap.add_argument("--role", default=None, help="record | preload | launch (one process of "
                    "the cross-process check; FOLDER is --out)")
    args = ap.parse_args()
    if args.role:
        role(args.role, args.model, args.phase, args.out)
        return
    if args.record_layout:
        with open(args.out, "w") as f:
            json.dump([record_layout(m) for m in args.model.split(",")], f, indent=1)
        return
    if args.cross_only:
        with open(args.out, "w") as f:
            json.dump({"cross": cross_process(args.model, args.phase)}, f, indent=1)
        return

    from triton import knobs

    from ppqa.engine import compile_helper

    logged = log_compiles()
    engine = compile_helper.shadow_engine(args.model, "cuda", {})
    recorded: dict[str, dict] = {}

    def hook(*, fn, compile, **_):
        recorded.setdefault(compile["specialization_data"],
                            {"module": fn.module, "name": fn.name})
        return None  # compile as usual

    knobs.runtime.jit_cache_hook = hook
    run_phases(engine, args.phase)
    knobs.runtime.jit_cache_hook = None
    launched = list(logged)
    logged.clear()
    for spec, where in recorded.items():
        compile_helper.jit_function(where["module"], where["name"]).preload(spec)
    preloaded = list(logged)
    print("-- one process: launched, then preloaded")
    rows = compare(launched, preloaded)
    with open(args.out, "w") as f:
        json.dump({"launched": len(launched), "preloaded": len(preloaded), "rows": rows,
                   "cross": cross_process(args.model, args.phase)}, f, indent=1)


if __name__ == "__main__":
    main()
