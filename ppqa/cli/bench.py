"""`ppqa bench`: the paper's grid (or any part of it), timed paired and seeded (ppqa/bench/grid.py);
`--e2e WORKLOAD,...`: the main job timed as users run it, ingest -> `ppqa run` -> export, in
subprocesses on fresh stores (ppqa/bench/e2e.py, workloads in ppqa/bench/workloads.py)."""

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from ppqa.cli.common import fail, say

app = typer.Typer()


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"{what} must be comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        fail(f"{what} must be positive integers, got {text!r}")
    return values


@app.command(help=(
    "Time stock, cascade, parallel and auto on the paper's synthetic workload: seeded documents of "
    "N tokens, Q questions 'Summarize the main point of paragraph i.', a fixed answer budget with "
    "EOS ignored. Every mode answers the same seeds in one process, in two passes of opposite order "
    "after a warm-up; the JSON (written after every cell) holds per-run wall times, geometric-mean "
    "speedups over stock and peak GPU memory.\n\nExamples:\n\n"
    "  ppqa bench --model dummy:codellama-7b --doc-tokens 8192,16384 --questions 64,128,256\n\n"
    "  ppqa bench --model dummy:tiny-mha --device cpu --doc-tokens 256 --questions 8 "
    "--max-new-tokens 8 --out bench.json\n\n"
    "  ppqa bench --from benchmarks/results/grid.json --plot grid.png\n\n"
    "With --e2e WORKLOAD[,WORKLOAD...] it times the product instead: for each mode and pass a "
    "fresh store, `ppqa ingest --batch`, `ppqa run --gpu 0 --once --mode MODE`, `ppqa export`, "
    "all subprocesses; process and run wall, start-up, prefill, decode, worker time, answers/s, "
    "peak memory, speedups over stock, whether answers equal stock's, and the run over the "
    "workload's floor (its FLOPs at 790 TFLOP/s and its decode bytes at 4.3 TB/s, an H200's "
    "rates). Workloads: "
    "paper, labeling, labeling-short, quality, loogle, arrivals; answers by choosing, JSON "
    "and samples: quality-choices against quality-letters, labeling-short-labels against "
    "labeling-short, labeling-json against labeling, labeling-samples8 against "
    "labeling-copies8 (e.g. --modes auto); tiny and tiny-arrivals for the CPU. Runs too long for one "
    "call split with --first-pass or per mode, then merge with --from a.json,b.json.\n\n"
    "  ppqa bench --e2e paper,labeling --plot e2e.png\n\n"
    "  ppqa bench --e2e tiny --device cpu --modes stock,parallel --out e2e_tiny.json"))
def bench(
    model: Annotated[str | None, typer.Option(
        help="Model: a dummy preset (dummy:<preset>, dummy:<preset>+bpe for SmolLM2's BPE "
             "tokenizer), smollm2, a .gguf or HF dir. Default: dummy:codellama-7b; with --e2e "
             "each workload's own.", show_default=False)] = None,
    device: Annotated[str | None, typer.Option(
        help="cuda, cuda:N or cpu. Default: the GPU if there is one.", show_default=False)] = None,
    doc_tokens: Annotated[str, typer.Option(help="Document lengths in tokens, comma-separated.")]
    = "8192,16384",
    questions: Annotated[str, typer.Option(help="Questions per document, comma-separated.")]
    = "64,128,256",
    max_new_tokens: Annotated[str, typer.Option(help="Answer budgets, comma-separated.")] = "128",
    seeds: Annotated[str, typer.Option(help="Workload seeds, comma-separated.")] = "0,1",
    modes: Annotated[str | None, typer.Option(
        help="Modes to time; stock is the baseline. stock-flashinfer: stock on FlashInfer's "
             "decode kernel (a second engine of the same weights; needs CUDA and the flashinfer "
             "package). Default: stock,cascade,parallel,auto; with --e2e "
             "stock,auto,cascade,parallel.", show_default=False)] = None,
    streams: Annotated[int, typer.Option(help="P for parallel mode.")] = 32,
    passes: Annotated[int, typer.Option(help="Passes, alternating the order of modes.")] = 2,
    kv_tokens: Annotated[int | None, typer.Option(
        help="KV pool size in tokens (default: the engine's: a fraction of free GPU memory).",
        show_default=False)] = None,
    warm_cells: Annotated[bool, typer.Option(
        help="Before timing a cell, run it once untimed (stock: a few tokens) so that CUDA "
             "graph capture of its shapes is not timed.")] = True,
    cuda_graphs: Annotated[bool, typer.Option(
        help="Replay decode steps from CUDA graphs (GPU, Triton backend).")] = True,
    share_opening: Annotated[bool, typer.Option(
        help="Cache the questions' common opening with the document (the engine's default); "
             "--no-share-opening keeps it in every question (prefilled and read per "
             "question).")] = True,
    out: Annotated[Path | None, typer.Option(
        help="Results JSON (rewritten after every cell or run). Default: bench.json; with "
             "--e2e benchmarks/results/e2e_<workloads>.json.", show_default=False)] = None,
    plot: Annotated[Path | None, typer.Option(help="Also write a PNG plot of speedups here.",
                                              show_default=False)] = None,
    from_json: Annotated[str | None, typer.Option(
        "--from", help="Render the table (and --plot) of an earlier results JSON; time nothing. "
                       "--e2e results: several files, comma-separated, are merged (a benchmark "
                       "split over calls).", show_default=False)] = None,
    e2e: Annotated[str | None, typer.Option(
        "--e2e", metavar="WORKLOAD[,WORKLOAD...]", show_default=False,
        help="Time these named workloads end to end through the CLI (see above).")] = None,
    run_args: Annotated[str, typer.Option(
        help="--e2e: extra `ppqa run` options, e.g. --run-args '--max-jobs 64 --streams 32'.")]
    = "",
    work_dir: Annotated[Path | None, typer.Option(
        help="--e2e: keep the stores, batches, exports and worker logs here (default: a "
             "temporary folder, removed at the end).", show_default=False)] = None,
    arrival_seconds: Annotated[float, typer.Option(
        help="--e2e arrivals: ingest the jobs at a steady rate over this many seconds.")] = 60.0,
    max_docs: Annotated[int | None, typer.Option(
        min=1, help="--e2e: at most this many documents per document group (a quick trial).",
        show_default=False)] = None,
    first_pass: Annotated[int, typer.Option(
        min=0, help="--e2e: number the passes from this one (odd passes run the modes "
                    "reversed), to split a long benchmark over calls; merge with --from.")] = 0,
) -> None:
    import json

    from ppqa.bench import grid as b

    if from_json is not None:
        try:
            results = [json.loads(Path(f).read_text()) for f in from_json.split(",") if f]
            if all(r.get("kind") == "e2e" for r in results):
                from ppqa.bench.e2e_report import merge

                return _show_e2e(merge(results), plot)
            if len(results) != 1:
                fail("--from takes one grid results file (several only for --e2e results)")
            cells = results[0]["cells"]
        except (OSError, ValueError, KeyError) as exc:
            fail(f"cannot read results from {from_json}: {exc}")
        print(b.markdown_table(cells))
        if plot is not None and not b.plot_speedups(cells, plot):
            say("matplotlib is not installed: no plot written (pip install matplotlib)")
        return
    if e2e is not None:
        return _run_e2e(e2e, model=model, device=device, modes=modes, passes=passes, out=out,
                        plot=plot, run_args=run_args, work_dir=work_dir,
                        arrival_seconds=arrival_seconds, max_docs=max_docs,
                        first_pass=first_pass)
    model = model or "dummy:codellama-7b"
    modes = modes or "stock,cascade,parallel,auto"
    out = out or Path("bench.json")

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in mode_list if m not in b.BENCH_MODES]
    if unknown or "stock" not in mode_list:
        fail(f"--modes must include stock and only {', '.join(b.BENCH_MODES)}; got {modes!r}")
    grid = [(d, q, t) for t in _ints(max_new_tokens, "--max-new-tokens")
            for d in _ints(doc_tokens, "--doc-tokens") for q in _ints(questions, "--questions")]
    seed_list = [int(s) for s in seeds.split(",") if s.strip()]

    import torch

    from ppqa import Engine, EngineConfig, SamplingParams

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config_kwargs = {"device": dev, "cuda_graphs": cuda_graphs and dev.startswith("cuda"),
                     "share_question_prefix": share_opening}
    if kv_tokens is not None:
        config_kwargs["kv_token_budget"] = kv_tokens
    seconds = [m for m in mode_list if m in b.SECOND_BASELINES]
    if seconds:  # each engine's KV pool takes a share of the memory left after its weights
        config_kwargs["mem_fraction"] = 0.8 / (1 + len(seconds))
    try:
        engine = Engine(model, device=dev, config=EngineConfig(**config_kwargs))
        others = {label: Engine(model, device=dev, config=EngineConfig(
            **{**config_kwargs, "cuda_graphs": False, "mem_fraction": 0.8 / (len(seconds) - i),
               "attention_backend": b.SECOND_BASELINES[label]}))
            for i, label in enumerate(seconds)}
    except ValueError as exc:
        fail(str(exc))
    gpu = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    command = "ppqa bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    say(f"bench: {model} on {gpu}; {len(grid)} cells x {len(seed_list)} seeds x {passes} passes")

    # Warm-up: every mode once on a small workload (kernel compilation, graph capture).
    doc, qs = b.make_workload(engine.tokenizer, min(d for d, _, _ in grid), 4, seed=12345)
    for label in mode_list:
        others.get(label, engine).answer(doc, qs, mode=b.engine_mode(label), streams=streams,
                                         sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))

    cells: list[b.Cell] = []
    for d, q, t in grid:
        say(f"cell: doc {d} tokens, {q} questions, {t} answer tokens")
        cell = b.Cell(model=model, doc_tokens=d, questions=q, max_new_tokens=t, seeds=seed_list,
                      streams=streams)
        b.time_cell(engine, cell, mode_list, passes=passes, log=say, warm=warm_cells,
                    others=others)
        cells.append(cell)
        b.write_results(out, gpu, command, cells)
    table_cells = [c.to_json() for c in cells]
    print(b.markdown_table(table_cells))
    if plot is not None and not b.plot_speedups(table_cells, plot):
        say("matplotlib is not installed: no plot written (pip install matplotlib)")
    say(f"results written to {out}")


def _run_e2e(workloads: str, *, model, device, modes, passes, out, plot, run_args, work_dir,
             arrival_seconds, max_docs, first_pass) -> None:
    from ppqa.bench import e2e

    names = [w.strip() for w in workloads.split(",") if w.strip()]
    try:
        opts = e2e.E2EOptions(
            workloads=names, modes=[m.strip() for m in (modes or ",".join(e2e.E2E_MODES))
                                    .split(",") if m.strip()],
            model=model, device=device, passes=passes, run_args=shlex.split(run_args),
            work_dir=work_dir, arrival_seconds=arrival_seconds, max_docs=max_docs,
            first_pass=first_pass)
    except ValueError as exc:
        fail(str(exc))
    out = out or Path("benchmarks/results") / f"e2e_{'_'.join(names)}.json"
    command = "ppqa " + " ".join(shlex.quote(a) for a in sys.argv[1:])  # argv[1] is "bench"
    results = e2e.run_e2e(opts, out, command, say)
    _show_e2e(results["workloads"], plot)
    say(f"results written to {out}")


def _show_e2e(workloads: list[dict], plot: Path | None) -> None:
    from ppqa.bench import e2e_report

    print(e2e_report.markdown_table(workloads))
    if plot is not None and not e2e_report.plot_speedups(workloads, plot):
        say("matplotlib is not installed: no plot written (pip install matplotlib)")
