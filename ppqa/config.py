"""User-facing configuration: `EngineConfig` (how the engine runs) and `SamplingParams` (how one
question is answered).

Both are plain dataclasses checked in `__post_init__`; this module never imports torch, so the CLI
and the job store can build and validate them cheaply. The engine (`engine/engine.py`) resolves
"auto" values (device, dtype, attention backend) when it starts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
# Tokens in one prefill forward when EngineConfig leaves it to the device. On an H200 a 16k
# chunk prefills a 16k document 3-5% faster than two of 8k (one fused causal call, no merge;
# benchmarks/results/h200/prefill_chunk_*_s28c3.json); the CPU's attention materialises a
# chunk's scores against the whole document, which at 16k rows is gigabytes a layer.
GPU_PREFILL_TOKENS, CPU_PREFILL_TOKENS = 16384, 8192


def default_prefill_tokens(device_type: str) -> int:
    """`max_prefill_tokens` where EngineConfig leaves it None, for a device type ("cuda", "cpu")."""
    return GPU_PREFILL_TOKENS if device_type == "cuda" else CPU_PREFILL_TOKENS


def dtype_name(dtype: object) -> str | None:
    """'float32' for torch.float32 or 'float32'/'fp32'/'bf16'...; None stays None (engine default)."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.").lower()
    name = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or None for the device's "
                         f"default), got {dtype!r}")
    return name


@dataclass(frozen=True)
class SamplingParams:
    """How to generate one answer. temperature 0 is greedy; seed makes sampling reproducible."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None  # None: drawn from the engine's seeded generator
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any of these
    ignore_eos: bool = False
    # A JSON schema's text (ppqa/json_schema.py): every token is masked to its grammar, EOS
    # comes only where the JSON may end, and the answer ends when the JSON is complete.
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an integer >= 1, "
                             f"got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"SamplingParams.seed must be None or an integer >= 0, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")
        if self.json_schema is not None:
            self._check_schema()

    def _check_schema(self) -> None:
        if not isinstance(self.json_schema, str) or not self.json_schema.lstrip().startswith("{"):
            raise ValueError(f"SamplingParams.json_schema must be a JSON object's text, "
                             f"got {self.json_schema!r:.80}")
        if self.stop or self.ignore_eos:
            raise ValueError("SamplingParams.json_schema cannot be combined with stop strings "
                             "or ignore_eos: the answer ends where its JSON does")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a question whose seed is `seed`: the seed itself for
    sample 0 (so one sample is the plain answer), else a 63-bit hash of (seed, index), so that
    the samples draw unrelated noise (engine/runtime/sampling.py) and each is reproducible on
    its own, whichever of them a run draws."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. Fields left at None/"auto" are resolved from the device."""

    device: str = "auto"  # "auto" (cuda if present), "cpu", "cuda", "cuda:1", ...
    dtype: str | None = None  # None: bfloat16 on a GPU, float32 on the CPU
    # "auto" = triton on CUDA, torch otherwise; "flashinfer": triton with FlashInfer's decode
    # kernel for stock decode steps (a second baseline; needs the flashinfer package)
    attention_backend: str = "auto"
    kv_token_budget: int = 65536  # KV pool size in tokens on the CPU
    mem_fraction: float = 0.85  # GPU: fraction of the free memory (after weights) for the KV pool
    # Requests decoded together. Not 512 for every step: what it gains on work queued up
    # front, arriving work loses to more step shapes (each run eagerly before its capture),
    # and long documents with 512 requests' reservations crowd an 80 GB pool:
    # benchmarks/results/h100/wtimeline*_b{256,512}_s40c{1,2}.json.
    max_batch_requests: int = 256
    # Past max_batch_requests, up to this many (rows of the req_to_token table), only by whole
    # cascade groups of at least half of max_batch_requests whose document the KV pool holds
    # as one run beside the requests running: two 16k-token documents of 256 questions decode
    # in one step of 512 (the weights read once for both), while small groups and arriving
    # work keep the shapes of max_batch_requests
    # (benchmarks/results/h100/wtimeline_paper_worker_b256{,w256}_s41c2.json).
    # None: twice max_batch_requests; equal to it: never past it.
    max_wide_requests: int | None = None
    default_streams: int = 32  # P when a parallel run is given streams=None
    # Decode steps captured as CUDA graphs, B padded to a power of two (None: on CUDA only).
    cuda_graphs: bool | None = None
    seed: int = 0  # dummy weights, and the seeds of sampled questions that give none
    # Tokens in one prefill forward (document chunks, question batches); None: the device's
    # default (default_prefill_tokens: 16384 on a GPU, 8192 on the CPU).
    max_prefill_tokens: int | None = None
    max_row_tokens: int | None = None  # req_to_token row length; None: min(pool, 4 x context)
    # Keep one decode step in flight: build and launch step t+1 before reading step t's tokens
    # (the host work hides behind the GPU). False reads every step back before the next.
    overlap_steps: bool = True
    # Cascade decode (Triton backend, GPU): the document product runs on a side stream beside
    # the suffix decode, one bound by tensor cores and the other by memory. False: in sequence.
    overlap_cascade: bool = True
    # The tokens that every question of a document opens with (the template's "Question: ",
    # a shared instruction) join the document's cached prefix: prefilled once, read once per
    # step by cascade and parallel, instead of once per question. False keeps them per question.
    share_question_prefix: bool = True
    # Ranks the model is split over (Megatron-style, engine/parallel/): N > 1 needs one process
    # per rank in an initialized torch.distributed group; rank 0 runs sessions, the others
    # call Engine.follow(). The model's heads and KV heads must divide by N.
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "device", str(self.device))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineConfig.attention_backend must be one of "
                             f"{', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if not isinstance(self.kv_token_budget, int) or self.kv_token_budget < 16:
            raise ValueError(f"EngineConfig.kv_token_budget must be an integer >= 16 tokens, "
                             f"got {self.kv_token_budget!r}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"EngineConfig.mem_fraction must be in (0, 1], got {self.mem_fraction!r}")
        for name in ("max_batch_requests", "default_streams", "tensor_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_wide_requests is not None and (
                not isinstance(self.max_wide_requests, int)
                or self.max_wide_requests < self.max_batch_requests):
            raise ValueError(f"EngineConfig.max_wide_requests must be None or an integer >= "
                             f"max_batch_requests ({self.max_batch_requests}), "
                             f"got {self.max_wide_requests!r}")
        if self.max_prefill_tokens is not None and (not isinstance(self.max_prefill_tokens, int)
                                                    or self.max_prefill_tokens < 1):
            raise ValueError(f"EngineConfig.max_prefill_tokens must be None or an integer >= 1, "
                             f"got {self.max_prefill_tokens!r}")
        if self.max_row_tokens is not None and (not isinstance(self.max_row_tokens, int)
                                                or self.max_row_tokens < 16):
            raise ValueError(f"EngineConfig.max_row_tokens must be None or an integer >= 16, "
                             f"got {self.max_row_tokens!r}")

    @property
    def wide_requests(self) -> int:
        """max_wide_requests resolved: the most requests one step may hold."""
        if self.max_wide_requests is None:
            return 2 * self.max_batch_requests
        return self.max_wide_requests
