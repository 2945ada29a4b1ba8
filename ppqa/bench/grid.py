"""`ppqa bench`: the paper's synthetic workload, timed paired and seeded on one engine.

Data flow: a seed draws a document (a slice of text the project generates, `synthetic_text`) of
exactly N tokens and Q questions from the template "Summarize the main point of paragraph i.";
every mode answers the same questions with the same greedy budget (EOS ignored) on one `Engine`,
after the document is cached; the wall time from submitting the questions to the last answer is
recorded per (mode, seed, pass). Two passes run the modes in opposite orders; a seed's time for a
mode is the mean of its passes, a cell's speedup is the geometric mean over seeds of
stock / mode. Results go to JSON after every cell (`write_results`), then to a Markdown table and,
when matplotlib is importable, a PNG plot.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

# The bench times every engine mode, plus stock on FlashInfer's decode kernel.
BENCH_MODES = ("stock", "stock-flashinfer", "cascade", "parallel", "auto")
# Columns that run `stock` on a second engine with another attention backend (the same dummy
# weights: the same seed), each a baseline beside ours: label -> EngineConfig.attention_backend.
SECOND_BASELINES = {"stock-flashinfer": "flashinfer"}


def engine_mode(label: str) -> str:
    """The `Engine.run` mode behind a column label."""
    return "stock" if label in SECOND_BASELINES else label

_SUBJECTS = ("the river", "the council", "the old mill", "the harbour master", "the school",
             "the weavers", "the northern road", "the lighthouse", "the orchard", "the archive",
             "the bridge builders", "the market", "the winter fair", "the glassworks", "the ferry")
_VERBS = ("recorded", "rebuilt", "questioned", "celebrated", "measured", "abandoned", "restored",
          "described", "argued over", "planned", "taxed", "mapped", "guarded", "sold", "renamed")
_OBJECTS = ("the grain stores", "a new charter", "the flood of that spring", "the eastern wall",
            "twelve fishing boats", "the copper mine", "a quarrel about tolls", "the bell tower",
            "the first printing press", "a census of every household", "the salt trade",
            "a long drought", "the southern wells", "a festival of lanterns", "the stone quay")
_TIMES = ("in the spring", "before the harvest", "after the storm", "during the long winter",
          "in the year of the comet", "at the turn of the century", "within a decade",
          "while the roads were closed", "under the third mayor", "on a single night")


def synthetic_text(seed: int, paragraphs: int = 400) -> str:
    """Prose-like text, deterministic in `seed`, made of numbered paragraphs (our own words)."""
    rng = random.Random(seed)
    out = []
    for i in range(1, paragraphs + 1):
        sentences = []
        for _ in range(rng.randint(4, 8)):
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TIMES)}"
            sentences.append(s[0].upper() + s[1:] + ".")
        out.append(f"Paragraph {i}. " + " ".join(sentences))
    return "\n\n".join(out)


def make_workload(tokenizer, doc_tokens: int, questions: int, seed: int) -> tuple[str, list[str]]:
    """A document of exactly `doc_tokens` tokens of our text (a seeded slice) and Q questions."""
    text = synthetic_text(seed)
    ids = tokenizer.encode(text)
    while len(ids) < doc_tokens + 64:
        text = text + "\n\n" + synthetic_text(seed + len(ids))
        ids = tokenizer.encode(text)
    start = random.Random(seed).randrange(0, len(ids) - doc_tokens)
    document = tokenizer.decode(ids[start:start + doc_tokens])
    qs = [f"Summarize the main point of paragraph {i}." for i in range(1, questions + 1)]
    return document, qs


@dataclass
class Cell:
    model: str
    doc_tokens: int
    questions: int
    max_new_tokens: int
    seeds: list[int]
    streams: int
    wall_s: dict[str, list[float]] = field(default_factory=dict)  # mode -> per-seed mean of passes
    runs: list[dict] = field(default_factory=list)  # every timed run: mode, seed, pass, wall_s
    peak_mem_gib: dict[str, float] = field(default_factory=dict)  # the process's peak
    # the peak during a mode's runs above what was allocated when they started (weights and
    # KV pools are allocated up front): activations, graphs' pool, scratch
    peak_work_gib: dict[str, float] = field(default_factory=dict)
    chosen: dict[str, str] = field(default_factory=dict)  # what `auto` resolved to
    speedups: dict[str, float] = field(default_factory=dict)
    warmup_s: dict[str, float] = field(default_factory=dict)  # untimed run capturing graphs

    def summarize(self) -> None:
        base = self.wall_s.get("stock")
        if not base:
            return
        for mode, times in self.wall_s.items():
            if mode != "stock" and len(times) == len(base):
                ratios = [b / t for b, t in zip(base, times)]
                self.speedups[mode] = math.exp(sum(map(math.log, ratios)) / len(ratios))

    def to_json(self) -> dict:
        d = asdict(self)
        for mode, value in self.speedups.items():
            d[f"speedup_{mode}_vs_stock"] = value
        return d


def warm_cell(engine, cell: Cell, modes: list[str], log: Callable[[str], None] = print,
              others: dict | None = None) -> None:
    """Run the cell once untimed so that its CUDA graph shapes (batch, P, row-length buckets)
    are captured before timing: in full for every mode but stock, whose graphs depend on the
    batch and a row length that grows by one token a step, so a few tokens capture them.
    others: column label -> the engine that runs it (SECOND_BASELINES), else `engine`."""
    from ppqa import SamplingParams

    document, questions = make_workload(engine.tokenizer, cell.doc_tokens, cell.questions,
                                        cell.seeds[0])
    for label in modes:
        mode = engine_mode(label)
        budget = min(8, cell.max_new_tokens) if mode == "stock" else cell.max_new_tokens
        t0 = time.perf_counter()
        (others or {}).get(label, engine).answer(
            document, questions, mode=mode, streams=None if mode == "auto" else cell.streams,
            sampling=SamplingParams(max_new_tokens=budget, ignore_eos=True))
        cell.warmup_s[label] = time.perf_counter() - t0
        log(f"  warm-up {label:8s} {cell.warmup_s[label]:8.3f} s ({budget} tokens)")


def time_cell(engine, cell: Cell, modes: list[str], passes: int = 2,
              log: Callable[[str], None] = print, warm: bool = True,
              others: dict | None = None) -> Cell:
    """Time every mode on every seed of one cell; modes run in reverse order on odd passes.
    others: column label -> the engine that runs it (SECOND_BASELINES), else `engine`."""
    import torch

    from ppqa import QuestionRequest, SamplingParams

    others = others or {}
    if warm:
        warm_cell(engine, cell, modes, log, others)
    sampling = SamplingParams(max_new_tokens=cell.max_new_tokens, ignore_eos=True)
    per_seed: dict[str, dict[int, list[float]]] = {m: {s: [] for s in cell.seeds} for m in modes}
    cuda = engine.device.type == "cuda"
    engines = [engine] + [e for e in others.values() if e is not engine]
    for p in range(passes):
        order = modes if p % 2 == 0 else list(reversed(modes))
        for seed in cell.seeds:
            document, questions = make_workload(engine.tokenizer, cell.doc_tokens, cell.questions, seed)
            # Cache the document outside the timed region (the paper times cached documents).
            for eng in engines:
                eng.answer(document, questions[:1], mode="stock",
                           sampling=SamplingParams(max_new_tokens=1, ignore_eos=True))
            for label in order:
                mode, eng = engine_mode(label), others.get(label, engine)
                resident = 0
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    resident = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                answers: dict[int, object] = {}
                stats = eng.run(
                    [QuestionRequest(key=i, document=document, question=q, sampling=sampling)
                     for i, q in enumerate(questions)],
                    mode=mode, streams=None if mode == "auto" else cell.streams,
                    on_answer=lambda req, ans: answers.__setitem__(req.key, ans))
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                assert len(answers) == cell.questions
                per_seed[label][seed].append(wall)
                cell.runs.append({"mode": label, "seed": seed, "pass": p, "wall_s": wall,
                                  "resolved": stats.mode, "streams": stats.streams})
                if mode == "auto":
                    cell.chosen[str(seed)] = f"{stats.mode}/P={stats.streams}"
                if cuda:
                    # Both engines' weights and pools count: this is the process's peak.
                    peak = torch.cuda.max_memory_allocated()
                    cell.peak_mem_gib[label] = max(cell.peak_mem_gib.get(label, 0.0), peak / 2**30)
                    work = (peak - resident) / 2**30
                    cell.peak_work_gib[label] = max(cell.peak_work_gib.get(label, 0.0), work)
                log(f"  pass {p} seed {seed} {label:8s} {wall:8.3f} s")
    for mode in modes:
        cell.wall_s[mode] = [sum(v) / len(v) for v in (per_seed[mode][s] for s in cell.seeds)]
    cell.summarize()
    return cell


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(path: Path, gpu: str, command: str, cells: list[Cell]) -> None:
    """Write the results JSON atomically (called after every cell so a cut-off run keeps its data)."""
    payload = {"gpu": gpu, "commit": git_commit(), "command": command,
               "cells": [c.to_json() for c in cells]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def markdown_table(cells: list[dict]) -> str:
    """One row per cell: mean wall seconds per mode and speedups over stock."""
    modes = [m for m in BENCH_MODES if any(m in c["wall_s"] for c in cells)]
    head = "| model | doc | Q | tokens | " + " | ".join(f"{m} s" for m in modes)
    head += " | " + " | ".join(f"{m} x" for m in modes if m != "stock") + " |"
    sep = "|" + "---|" * (4 + len(modes) + len(modes) - 1)
    rows = [head, sep]
    for c in cells:
        secs = [f"{sum(c['wall_s'][m]) / len(c['wall_s'][m]):.2f}" if m in c["wall_s"] else "-"
                for m in modes]
        ups = [f"{c['speedups'][m]:.2f}" if m in c.get("speedups", {}) else "-"
               for m in modes if m != "stock"]
        model = c["model"].removeprefix("dummy:")
        rows.append(f"| {model} | {c['doc_tokens']} | {c['questions']} | {c['max_new_tokens']} | "
                    + " | ".join(secs) + " | " + " | ".join(ups) + " |")
    return "\n".join(rows)


def plot_speedups(cells: list[dict], path: Path) -> bool:
    """A bar chart of speedups over stock per cell; False when matplotlib is missing."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = [m for m in BENCH_MODES if m != "stock" and any(m in c.get("speedups", {}) for c in cells)]
    def tokens(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 else str(n)

    labels = [f"{c['model'].removeprefix('dummy:')}\n{tokens(c['doc_tokens'])}/{c['questions']}"
              f"/{c['max_new_tokens']}" for c in cells]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cells)), 4))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(cells))]
        ax.bar(xs, [c.get("speedups", {}).get(mode, 0) for c in cells], width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))], labels, fontsize=7)
    ax.set_ylabel("speedup over stock (x)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
