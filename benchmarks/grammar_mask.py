"""Grammar libraries for JSON answers, measured side by side: xgrammar, llguidance, outlines-core.

For each library installed: the cost of one decode step's token masks for N streams (default
256) under a 5-field JSON schema on SmolLM2's vocabulary (49,152 tokens), split into compiling
the schema (once per job), filling the streams' bitmasks (per step, on the host), accepting
the streams' sampled tokens (per step), and applying the bitmask to [N, V] float32 logits
(ppqa's own `apply_token_bitmask`, the same for every library, out of place); and the schema features each
library compiles, and whether it enforces them (a valid instance is accepted and an invalid
one is not). The streams follow real JSON texts (one per stream, different values), tokenized
by SmolLM2's tokenizer, so each step's masks come from grammar states a model would reach.

    python benchmarks/grammar_mask.py --out benchmarks/results/cpu/grammar_mask.json

The libraries need not all be installed: a missing one is reported as such. `--lib-path` adds
a folder (a `pip install --target` of the libraries ppqa does not depend on) to sys.path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# The 5-field record of the e2e JSON workloads, one definition for every benchmark.
from ppqa.bench.workloads import JSON_SCHEMA as SCHEMA  # noqa: E402
SEPARATORS = (", ", ": ")  # json.dumps' defaults; every library is set to this fixed layout
WORDS = ["alpha", "harbor", "Zürich", "quiet", "north", "paper", "x", "data", "labels", "judge"]

# (feature, schema, a valid instance, an invalid instance or None)
FEATURES = [
    ("string", {"type": "string"}, "ok", 3),
    ("integer", {"type": "integer"}, 12, 1.5),
    ("number", {"type": "number"}, -1.25e3, "x"),
    ("boolean", {"type": "boolean"}, True, 1),
    ("null", {"type": "null"}, None, 0),
    ("enum", {"enum": ["a", "b", 3]}, "b", "c"),
    ("const", {"const": "yes"}, "yes", "no"),
    ("object required", {"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"], "additionalProperties": False}, {"a": 1}, {}),
    ("optional property", {"type": "object", "properties": {"a": {"type": "integer"},
                                                            "b": {"type": "string"}},
                           "required": ["a"], "additionalProperties": False}, {"a": 1}, {"b": "x"}),
    ("array items", {"type": "array", "items": {"type": "integer"}}, [1, 2], ["a"]),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                           "maxItems": 2}, [1], [1, 2, 3]),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "AB-123", "ab-123"),
    ("format date", {"type": "string", "format": "date"}, "2026-12-02", "yesterday"),
    ("format email", {"type": "string", "format": "email"}, "a@b.org", "not an email"),
    ("minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 5}, 3, 7),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 10, 7),
    ("type list", {"type": ["string", "null"]}, None, 1),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x", True),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, 2, "x"),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, 4, 1),
    ("$ref/$defs", {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}},
                                    "required": ["x"], "additionalProperties": False}},
                    "type": "array", "items": {"$ref": "#/$defs/p"}}, [{"x": 1}], [{"y": 1}]),
    ("recursive $ref", {"$defs": {"n": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
        "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/n"},
        {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"v": "x", "kids": []}]}),
    ("additionalProperties schema", {"type": "object", "additionalProperties":
                                     {"type": "integer"}}, {"k": 1}, {"k": "v"}),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "items": False}, [1, "a"], ["a", 1]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     [1, 2], [1, 1]),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                           "additionalProperties": False}, {"x1": 1}, {"y": 1}),
    ("not", {"not": {"type": "string"}}, 1, "s"),
    ("if/then/else", {"if": {"type": "integer"}, "then": {"minimum": 0},
                      "else": {"type": "string"}}, 1, -1),
    ("empty schema (any JSON)", {}, {"a": [1, None]}, None),
]


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=SEPARATORS)


def instance(rng: random.Random) -> dict:
    return {"name": " ".join(rng.sample(WORDS, rng.randint(1, 3))), "age": rng.randint(0, 150),
            "label": rng.choice(SCHEMA["properties"]["label"]["enum"]),
            "score": round(rng.uniform(-100, 100), rng.randint(0, 4)),
            "tags": rng.sample(WORDS, rng.randint(0, 4))}


# ---- the libraries, behind one small interface ------------------------------------------------

class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int, eos: list[int]) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1,
                                            cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=SEPARATORS)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers, tokens) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def can_end(self, m, eos: int) -> bool:
        return m.accept_token(eos)


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False, "item_separator": SEPARATORS[0],
                               "key_separator": SEPARATORS[1]})
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        template = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())
        return template

    def matcher(self, compiled):
        return compiled.deep_copy()  # as ppqa does: a copy of the compiled matcher per stream

    def fill(self, matchers, bitmask) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              bitmask.data_ptr(), bitmask.shape[1] * 4,
                                              bitmask.shape[0])

    def accept(self, matchers, tokens) -> list[bool]:
        return self.executor.consume_token_par(list(zip(matchers, tokens)))

    def can_end(self, m, eos: int) -> bool:
        return m.is_accepting()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf, vocab: int, eos: list[int]) -> None:
        import outlines_core
        self.oc = outlines_core
        table = {v: bytes([k]) for k, v in _byte_level_chars().items()}
        tokens: dict[bytes, list[int]] = {}
        special = set(hf.all_special_ids)
        for text, i in hf.get_vocab().items():
            if i in special or i in eos:
                continue
            data = bytes(b for ch in text for b in table.get(ch, ch.encode()))
            tokens.setdefault(data, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos[0], tokens)

    def compile(self, schema: dict):
        from outlines_core.json_schema import build_regex_from_schema
        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern="[ ]?")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matchers, bitmask) -> None:
        row = bitmask.shape[1]
        for i, m in enumerate(matchers):  # no batch call: one stream at a time
            m.write_mask_into(bitmask[i].data_ptr(), row, 4)

    def accept(self, matchers, tokens) -> list[bool]:
        out = []
        for m, t in zip(matchers, tokens):
            try:
                m.advance(t)
                out.append(True)
            except ValueError:
                out.append(False)
        return out

    def can_end(self, m, eos: int) -> bool:
        return m.is_finished() or eos in m.get_tokens()


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies are written in it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


LIBRARIES = {"xgrammar": Xgrammar, "llguidance": Llguidance, "outlines-core": OutlinesCore}


# ---- measurements ----------------------------------------------------------------------------

def step_costs(lib, hf, vocab: int, eos: int, streams: int, seed: int) -> dict:
    from ppqa.engine.runtime.sampling import apply_token_bitmask

    rng = random.Random(seed)
    texts = [dumps(instance(rng)) for _ in range(streams)]
    paths = [hf.encode(t, add_special_tokens=False) + [eos] for t in texts]
    began = time.perf_counter()
    compiled = lib.compile(SCHEMA)
    compile_s = time.perf_counter() - began
    began = time.perf_counter()
    matchers = [lib.matcher(compiled) for _ in range(streams)]
    matchers_s = time.perf_counter() - began
    bitmask = torch.zeros(streams, (vocab + 31) // 32, dtype=torch.int32)
    logits = torch.randn(streams, vocab)
    fill, accept, apply, allowed_counts = [], [], [], []
    steps = max(len(p) for p in paths)
    for t in range(steps):
        live = [i for i in range(streams) if t < len(paths[i])]
        ms = [matchers[i] for i in live]
        rows = bitmask[:len(live)]
        began = time.perf_counter()
        lib.fill(ms, rows)
        fill.append(time.perf_counter() - began)
        bits = _allowed(rows, vocab)
        tokens = [paths[i][t] for i in live]
        for j, tok in enumerate(tokens):
            if not bits[j, tok]:
                raise AssertionError(f"{lib.name}: step {t}: the mask forbids token {tok} of "
                                     f"stream {live[j]}: {texts[live[j]]!r}")
        allowed_counts.append(float(bits.sum(dim=1).float().mean()))
        x = logits[:len(live)].clone()
        began = time.perf_counter()
        apply_token_bitmask(x, rows)
        apply.append(time.perf_counter() - began)
        # EOS ends a stream: its mask was checked above, the matcher need not take it.
        taking = [(m, tok) for m, tok in zip(ms, tokens) if tok != eos]
        began = time.perf_counter()
        ok = lib.accept([m for m, _ in taking], [tok for _, tok in taking]) if taking else []
        accept.append(time.perf_counter() - began)
        if not all(ok):
            raise AssertionError(f"{lib.name}: step {t}: a valid token was refused")
    full = [i for i in range(steps) if all(i < len(p) for p in paths)]  # steps with every stream

    def ms_of(xs, idx):
        return round(1e3 * statistics.median([xs[i] for i in idx]), 4)
    return {"compile_s": round(compile_s, 4), "matchers_s": round(matchers_s, 5),
            "steps": steps, "full_steps": len(full),
            "fill_ms_median_full": ms_of(fill, full), "fill_ms_max": round(1e3 * max(fill), 3),
            "accept_ms_median_full": ms_of(accept, full),
            "apply_ms_median_full": ms_of(apply, full),
            "fill_us_per_stream": round(1e3 * ms_of(fill, full) / streams, 3),
            "allowed_tokens_mean": round(statistics.mean(allowed_counts), 1)}


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]


def coverage(lib, hf, eos: int) -> dict:
    out = {}
    for name, schema, good, bad in FEATURES:
        began = time.perf_counter()
        try:
            compiled = lib.compile(schema)
            lib.matcher(compiled)
        except Exception as exc:  # noqa: BLE001 - a library's refusal is the result
            out[name] = {"compiles": False, "error": str(exc).strip().splitlines()[0][:160]}
            continue
        entry = {"compiles": True, "compile_s": round(time.perf_counter() - began, 4),
                 "accepts_valid": _accepts(lib, compiled, hf, eos, good)}
        if bad is not None:
            entry["refuses_invalid"] = not _accepts(lib, compiled, hf, eos, bad)
        out[name] = entry
    return out


def _accepts(lib, compiled, hf, eos: int, value) -> bool:
    m = lib.matcher(compiled)
    ids = hf.encode(dumps(value), add_special_tokens=False)
    for tok in ids:
        if not all(lib.accept([m], [tok])):
            return False
    return lib.can_end(m, eos)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--libs", default=",".join(LIBRARIES))
    parser.add_argument("--lib-path", default=None)
    parser.add_argument("--models-root", default=None,
                        help="model cache holding SmolLM2 (default: ppqa's home)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.lib_path:
        sys.path.insert(0, args.lib_path)
    from ppqa.engine.loading import model_cache
    from ppqa.engine.loading.bpe import bpe_tokenizer, transformers_tokenizer

    root = Path(args.models_root) if args.models_root else None
    model_cache.ensure("smollm2", root=root)
    tokenizer = bpe_tokenizer(root)
    hf, vocab, eos = transformers_tokenizer(root), tokenizer.vocab_size, tokenizer.eos_token_ids
    result = {"what": "grammar mask cost per decode step and schema coverage",
              "commit": _commit(), "python": platform.python_version(),
              "torch": torch.__version__, "cpus": os.cpu_count(), "vocab": vocab,
              "streams": args.streams, "schema": SCHEMA, "separators": SEPARATORS,
              "libraries": {}}
    for name in args.libs.split(","):
        began = time.perf_counter()
        try:
            lib = LIBRARIES[name](hf, vocab, eos)
        except ImportError as exc:
            result["libraries"][name] = {"installed": False, "error": str(exc)}
            continue
        entry = {"installed": True, "version": _version(name),
                 "tokenizer_setup_s": round(time.perf_counter() - began, 3)}
        entry["step"] = step_costs(lib, hf, vocab, eos[0], args.streams, args.seed)
        entry["coverage"] = coverage(lib, hf, eos[0])
        entry["features_compiled"] = sum(c["compiles"] for c in entry["coverage"].values())
        entry["features_enforced"] = sum(
            c["compiles"] and c["accepts_valid"] and c.get("refuses_invalid", True)
            for c in entry["coverage"].values())
        result["libraries"][name] = entry
        print(name, json.dumps(entry["step"]), entry["features_compiled"],
              entry["features_enforced"], file=sys.stderr)
    text = json.dumps(result, indent=2, ensure_ascii=False)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


def _version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
