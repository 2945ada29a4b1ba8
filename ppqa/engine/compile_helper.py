"""A compile helper: the child process `precompile.start` launches (`python -m
ppqa.engine.compile_helper`), in one of three roles. `--record` runs every warm-up phase on a
two-layer copy of the model (`shadow_engine`) with a Triton hook that lists each kernel variant
a launch asks for instead of compiling it (`record_variants`), writes the list, then compiles
like the others; `--compile` waits for that list and compiles the variants no other helper has
claimed (`compile_listed`); `--phases` runs a group of warm-up phases for real. Each prints a
timing report as its last line, which `precompile.wait` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

from ppqa.engine.precompile import WAIT_SECONDS

LIST_NAME = "variants.json"  # the recorder's list, in the helpers' folder


def shadow_engine(model: str, device: str, fields: dict):
    """An Engine with the model's dimensions, tokenizer and configuration but two layers of
    random weights, and a KV pool large enough for the warm-up (not a share of the GPU)."""
    import torch

    from ppqa.config import EngineConfig, default_prefill_tokens
    from ppqa.engine.engine import Engine
    from ppqa.engine.loading import presets
    from ppqa.engine.loading.loader import load_model
    from ppqa.engine.loading.types import LazyWeights, LoadedModel
    from ppqa.engine.runtime.kv_cache import KVPool

    config = EngineConfig(**fields)
    dtype = getattr(torch, config.dtype or ("bfloat16" if device.startswith("cuda")
                                            else "float32"))
    loaded = load_model(model, device=device, dtype=dtype)  # config and tokenizer; weights lazy
    # Two layers: the second meets what only layers after the first do (the residual norm).
    shadow = dataclasses.replace(loaded.config, num_layers=min(2, loaded.config.num_layers))
    weights = LazyWeights(lambda: presets.dummy_weights(shadow, 0.02, device=torch.device(device),
                                                        dtype=dtype, seed=0),
                          sum(1 for _ in presets.weight_shapes(shadow)))
    if torch.device(device).type == "cuda":
        # The req_to_token rows keep the length the worker's large pool gives them (their
        # stride is part of what a kernel is compiled for); the pool holds the warm-up's tokens.
        row = config.max_row_tokens or 4 * shadow.max_position_embeddings
        chunk = config.max_prefill_tokens or default_prefill_tokens("cuda")
        tokens = row + 2 * chunk + 64 * config.max_batch_requests
        slot_bytes = KVPool.bytes_per_slot(1, shadow.num_kv_heads, shadow.head_dim, dtype)
        free, _ = torch.cuda.mem_get_info(torch.device(device))  # other helpers take some
        config = dataclasses.replace(config, max_row_tokens=row, mem_fraction=min(
            1.0, tokens * slot_bytes / max(free // 2, 1)))
    return Engine.from_loaded(LoadedModel(shadow, weights, loaded.tokenizer,
                                          source=f"{loaded.source}, two layers for compiling"),
                              device=device, config=config, model_name=model)


# Warm-up phases that launch no Triton kernel: the recorder runs them after its list is out
# (beside its compiling), since the compilers wait for the list.
UNRECORDED = ("cudnn",)


def record_variants(engine, folder: Path) -> dict:
    """Run every warm-up phase of `engine` but UNRECORDED with a Triton hook that records each
    kernel variant a launch asks for and skips it (neither compiled nor launched), then write
    the list to `folder` for the compiling helpers. Returns {"variants": count, "failed":
    [phase: error]}: a phase that trips on the garbage the skipped kernels leave ends early,
    the next still run, and the list is written whatever happens."""
    from triton import knobs

    variants: dict[str, dict] = {}

    def hook(*, fn, compile, **_) -> bool:
        spec = compile["specialization_data"]
        variants.setdefault(spec, {"module": fn.module, "name": fn.name, "spec": spec})
        return True  # skip it

    failed = []
    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    try:
        for name, phase in engine.warmup_phases():
            if name in UNRECORDED:
                continue
            try:
                phase()
            except Exception as exc:  # noqa: BLE001 - recorded; the list is still useful
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
    finally:
        knobs.runtime.jit_cache_hook = previous
        write_list(folder, list(variants.values()))
    return {"variants": len(variants), "failed": failed}


def run_unrecorded(engine) -> None:
    """The UNRECORDED warm-up phases of `engine`, run for real."""
    for name, phase in engine.warmup_phases():
        if name in UNRECORDED:
            phase()


def write_list(folder: Path, variants: list[dict]) -> None:
    """The recorder's list of variants ({"module", "name", "spec"}: where the kernel is and
    Triton's specialization data), written so that compilers see the whole list or none."""
    partial = folder / (LIST_NAME + ".part")
    partial.write_text(json.dumps(variants))
    os.replace(partial, folder / LIST_NAME)


def imports_for_compiling(device: str) -> None:
    """What compiling needs before the list is out: torch and Triton imported, the device's
    context and Triton's driver up, the kernel modules loaded."""
    import importlib
    import pkgutil

    import torch
    from triton.runtime import driver

    import ppqa.kernels

    torch.cuda.set_device(torch.device(device).index or 0)  # 'cuda' names the first GPU
    driver.active.get_current_target()
    for module in pkgutil.iter_modules(ppqa.kernels.__path__):
        importlib.import_module(f"ppqa.kernels.{module.name}")


def jit_function(module: str, name: str):
    """The Triton JIT function `name` (a qualified name) of `module`, as a jit_cache_hook names
    it; a wrapper's (autotune, heuristics) is unwrapped."""
    import importlib

    kernel = importlib.import_module(module)
    for part in name.split("."):
        kernel = getattr(kernel, part)
    while not hasattr(kernel, "preload") and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def compile_listed(folder: Path, wait_seconds: float = WAIT_SECONDS) -> list:
    """Compile the variants of the recorder's list in `folder` (waiting for it) that no other
    helper has claimed, each claimed by creating its claim file; [[kernel, seconds or error]]."""
    path = folder / LIST_NAME
    deadline = time.monotonic() + wait_seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no list of kernel variants in {folder} after {wait_seconds} s")
        time.sleep(0.02)
    done = []
    for i, variant in enumerate(json.loads(path.read_text())):
        try:
            os.close(os.open(folder / f"claim-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another helper has it
        t0 = time.perf_counter()
        try:
            compiled = jit_function(variant["module"], variant["name"]).preload(variant["spec"])
            # Loading it builds its launcher, a C module per signature that Triton keeps in
            # the cache as well; a worker would otherwise build each at its first launch.
            compiled._init_handles()
            done.append([variant["name"], round(time.perf_counter() - t0, 3)])
        except Exception as exc:  # noqa: BLE001 - the worker's warm-up compiles it instead
            done.append([variant["name"], f"{type(exc).__name__}: {exc}"])
    return done


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Run warm-up phases on a two-layer copy of a "
                                             "model, filling the Triton cache (a compile helper).")
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", required=True)
    role = ap.add_mutually_exclusive_group(required=True)
    role.add_argument("--phases", help="warm-up phase names, comma-separated (layout `phases`)")
    role.add_argument("--record", metavar="FOLDER",
                      help="record the warm-up's kernel variants into FOLDER, then compile")
    role.add_argument("--compile", metavar="FOLDER",
                      help="compile the variants FOLDER's recorder lists")
    ap.add_argument("--fields", default="{}", help="EngineConfig fields as JSON")
    ap.add_argument("--started", type=float, default=None,
                    help="when the worker started the helpers (epoch seconds): the report's origin")
    args = ap.parse_args(argv)
    origin = time.time() if args.started is None else args.started
    imported = time.time() - origin  # torch is not imported yet: `shadow_engine` does that
    if args.compile:
        imports_for_compiling(args.device)
        built = time.time() - origin
        compiled = compile_listed(Path(args.compile))
        print(json.dumps({"python_s": round(imported, 3), "built_s": round(built, 3),
                          "compiled": compiled, "done_s": round(time.time() - origin, 3)}))
        return 0
    try:
        engine = shadow_engine(args.model, args.device, json.loads(args.fields))
    except BaseException:
        if args.record:
            write_list(Path(args.record), [])  # the compilers stop waiting
        raise
    if args.record:
        built = time.time() - origin
        recorded = record_variants(engine, Path(args.record))
        listed = time.time() - origin
        rest = threading.Thread(target=run_unrecorded, args=(engine,), name="ppqa-unrecorded")
        rest.start()  # cuDNN's kernels built beside this helper's share of the compiling
        compiled = compile_listed(Path(args.record))
        rest.join()
        print(json.dumps({"python_s": round(imported, 3), "built_s": round(built, 3),
                          "listed_s": round(listed, 3), **recorded, "compiled": compiled,
                          "done_s": round(time.time() - origin, 3)}))
        return 0
    phases = dict(engine.warmup_phases())
    wanted = args.phases.split(",")
    unknown = [name for name in wanted if name not in phases]
    if unknown:
        print(f"unknown warm-up phases {unknown}; known: {list(phases)}", file=sys.stderr)
        return 2
    built = time.time() - origin
    seconds = []
    for name in wanted:
        t0 = time.perf_counter()
        phases[name]()
        seconds.append([name, round(time.perf_counter() - t0, 3)])
    # The last line is the report `wait` reads: seconds since the worker started the helpers.
    print(json.dumps({"python_s": round(imported, 3), "built_s": round(built, 3),
                      "phase_s": seconds, "done_s": round(time.time() - origin, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
