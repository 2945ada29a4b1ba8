"""A cost model of one decode step, used by `mode="auto"` and `streams="auto"`.

Decode is a sum of two parts. The part every mode shares: the weights are read once per step and
every new token goes through every matrix (2 FLOPs per parameter per token). The attention part
is what the modes change, for Q questions of q tokens about an L-token document, a tokens into
their answers (we charge the mean over the answer budget, a = max_new / 2):

    stock     every question reads the document:      bytes ~ Q (L + q + a)
    cascade   the document once, each suffix once:    bytes ~ L + Q (q + a)
    parallel  once per request of P streams; each stream scans its siblings' tokens as well:
              bytes ~ ceil(Q / P) (L + P (q + a)),  FLOPs ~ Q (L + P (q + a))

all times the KV bytes of a token, and FLOPs = 4 x head_dim x query heads per (query, key). Each
part costs max(bytes / bandwidth, FLOPs / matmul rate) over an efficiency measured for our
kernels (benchmarks/RESULTS.md, 'Kernels, one layer'). Where several documents decode in the
same steps, each is charged its share of what they share: the weight reads and overhead of the
step, and cascade's per-layer floor (one document launch a layer serves every cascade group).
A mode other than stock is chosen only when the whole step is predicted at least `MIN_GAIN`
faster, so `auto` falls back to the baseline when the modes are within the model's error (one
question, tiny documents) rather than betting on noise. MIN_GAIN is small because real gains
can be small: on the H200 a 512-token document with 16 questions on CodeLlama-7B runs cascade
and parallel 1.06x faster than stock (benchmarks/RESULTS.md, 'Workloads auto must not lose
on'), and the model predicts parallel 1.03x there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ppqa.engine.model.config import ModelConfig

MIN_GAIN = 1.03  # predicted speedup a mode needs over stock before auto picks it
STREAM_CHOICES = (4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class DeviceRates:
    """Sustained rates of a device, and the fraction of them each mode's kernels reach there.

    GPU efficiencies are fitted to one-layer measurements of our kernels on the H200
    (benchmarks/RESULTS.md, 'Kernels, one layer'): stock decode reads the requested bytes at
    ~2.5x the copy bandwidth (requests in flight together share document tiles in L2; GQA
    models 3.09x); the parallel extend kernel is bound by the masked keys it still computes
    (~12% of the matmul rate) or by bandwidth (~70%); cascade's document part runs its product
    at ~28% of the rate, and takes at least `cascade_layer_floor_s` a layer however small (its
    launch, the merge of its partial states, the side-stream fork and join). That floor, 20 us,
    predicts cascade 1.16x over stock on Qwen2.5-1.5B at 8k/64, where it measures 1.08x
    (benchmarks/RESULTS.md, 'Workloads auto must not lose on').
    """

    bandwidth: float  # bytes/s, measured copy bandwidth
    matmul: float  # FLOP/s, measured dense matrix product rate
    stock_mem_eff: float = 1.0
    stock_gqa_mem_eff: float | None = None  # grouped-query models' own (None: stock_mem_eff)
    parallel_mem_eff: float = 0.7
    parallel_flop_eff: float = 0.12
    cascade_mem_eff: float = 0.8
    cascade_flop_eff: float = 0.28
    cascade_layer_floor_s: float = 0.0  # least time of a layer's document part (small grids)
    step_overhead_s: float = 0.0  # launch and host time per step, shared by all modes

    @staticmethod
    def for_device(kind: str) -> DeviceRates:
        if kind == "cuda":  # the H200: 4.3 TB/s copy, ~790 TFLOP/s bf16 (RESULTS.md's floors)
            return DeviceRates(bandwidth=4.3e12, matmul=7.9e14, stock_mem_eff=2.46,
                               stock_gqa_mem_eff=3.09, cascade_layer_floor_s=20e-6,
                               step_overhead_s=2e-3)
        # The CPU's torch backend: no L2 sharing to speak of, masked keys cost as much as others.
        return DeviceRates(bandwidth=2.0e10, matmul=1.0e11, parallel_mem_eff=1.0,
                           parallel_flop_eff=0.5, cascade_mem_eff=1.0, cascade_flop_eff=0.5)


@dataclass(frozen=True)
class Workload:
    doc_tokens: int
    questions: int
    question_tokens: int  # mean tokens of one question's suffix
    max_new_tokens: int
    # Documents whose questions decode in the same steps as these: they share the step's
    # weight reads and launches, and cascade's per-layer floor (one document launch a layer
    # serves every cascade group of the step).
    documents: int = 1

    @property
    def own_tokens(self) -> float:
        """Mean tokens of a stream's own row part over the answer: question + half the budget."""
        return self.question_tokens + self.max_new_tokens / 2


def _flops_per_pair(cfg: ModelConfig) -> int:
    """FLOPs of one (query token, key token) pair across layers: QK^T and PV, all query heads."""
    return 4 * cfg.head_dim * cfg.num_heads * cfg.num_layers


def attention_seconds(cfg: ModelConfig, w: Workload, mode: str, streams: int,
                      rates: DeviceRates, dtype_bytes: int = 2) -> float:
    """Predicted attention time of one decode step of all Q questions."""
    kv, fp = cfg.kv_bytes_per_token(dtype_bytes), _flops_per_pair(cfg)
    L, Q, s = w.doc_tokens, w.questions, w.own_tokens
    bw, mm = rates.bandwidth, rates.matmul
    if mode == "stock":  # matrix-vector products: bandwidth alone
        eff = rates.stock_mem_eff
        if cfg.num_kv_heads < cfg.num_heads and rates.stock_gqa_mem_eff is not None:
            eff = rates.stock_gqa_mem_eff
        return Q * (L + s) * kv / (bw * eff)
    if mode == "cascade":  # the document as one product, then each suffix read once
        document = max(L * kv / bw, Q * L * fp / (mm * rates.cascade_flop_eff),
                       cfg.num_layers * rates.cascade_layer_floor_s / w.documents)
        return document + Q * s * kv / (bw * rates.cascade_mem_eff)
    if mode == "parallel":
        p = max(1, min(streams, Q))
        bytes_ = math.ceil(Q / p) * (L + p * s) * kv
        flops = Q * (L + p * s) * fp  # every stream's query meets every key of its row
        return max(bytes_ / (bw * rates.parallel_mem_eff), flops / (mm * rates.parallel_flop_eff))
    raise ValueError(f"no cost model for mode {mode!r}")


def shared_seconds(cfg: ModelConfig, w: Workload, rates: DeviceRates, dtype_bytes: int = 2) -> float:
    """Predicted time of everything but attention in one step, the Q questions' share of it:
    the step's weight reads and overhead are shared by its `documents`' questions."""
    params = cfg.num_layers * cfg.projection_params_per_layer() + cfg.vocab_size * cfg.hidden_size
    step = max(params * dtype_bytes / rates.bandwidth,
               2 * params * w.questions * w.documents / rates.matmul) + rates.step_overhead_s
    return step / w.documents


def best_streams(cfg: ModelConfig, w: Workload, rates: DeviceRates, dtype_bytes: int = 2) -> int:
    """P that minimizes parallel's predicted attention time (the paper's U-shaped curve)."""
    choices = sorted({min(p, w.questions) for p in STREAM_CHOICES} | {w.questions})
    return min(choices, key=lambda p: (attention_seconds(cfg, w, "parallel", p, rates, dtype_bytes), p))


def choose(cfg: ModelConfig, w: Workload, rates: DeviceRates, modes: tuple[str, ...],
           dtype_bytes: int = 2) -> tuple[str, int, dict[str, float]]:
    """(mode, streams, predicted step seconds per candidate) for `auto`; stock unless clearly beaten."""
    base = shared_seconds(cfg, w, rates, dtype_bytes)
    p = best_streams(cfg, w, rates, dtype_bytes)
    predicted = {m: base + attention_seconds(cfg, w, m, p if m == "parallel" else 1, rates, dtype_bytes)
                 for m in modes}
    best = min(predicted, key=predicted.get)
    if w.questions < 2 or predicted["stock"] < MIN_GAIN * predicted[best]:
        best = "stock"
    return best, (p if best == "parallel" else 1), predicted
