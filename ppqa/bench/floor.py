"""The floor of an end-to-end workload: the least time one GPU could answer it in, from its
matrix FLOPs and the bytes its decode steps must read, for `ppqa bench --e2e`'s `x floor`.

    prefill: every document's tokens once (its questions share it) and every question's, at
        2 x the projection parameters a token, plus attention: causal over the document
        (2 x L^2 x query width a layer), each question token over the document and the question
        tokens before it, and the LM head for each question's first answer token.
    decode: the answer tokens' matrix and attention FLOPs (the LM head included), or, where
        more, the bytes the steps must read: the weights once a step, each document's KV once
        a step while its questions decode (as cascade reads it), each request's own KV. A
        step holds at most `max_batch` requests, so there are at least ceil(answer tokens /
        max_batch) steps, and at least as many as the longest answer has tokens.
    total: prefill + decode (the compute-bound and the memory-bound parts one after the other).

The rates are the cost model's for the H200 (`cost_model.DeviceRates.for_device("cuda")`: 790
TFLOP/s, what cuBLAS's bf16 GEMMs reach, and 4.3 TB/s, its device-to-device copy), what this
engine's kernels are measured against. Answers are taken at their full budgets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ppqa.engine.runtime.cost_model import DeviceRates

_H200 = DeviceRates.for_device("cuda")
PEAK_FLOPS, COPY_BYTES_PER_S = _H200.matmul, _H200.bandwidth


@dataclass
class DocumentWork:
    """One document's part of a workload: its prompt prefix, its questions' suffixes and their
    answer budgets (tokens)."""

    prefix_tokens: int
    question_tokens: list[int]
    answer_tokens: list[int]


def floor_seconds(config, documents: Sequence[DocumentWork], *, max_batch: int = 256,
                  dtype_bytes: int = 2, flops: float = PEAK_FLOPS,
                  bandwidth: float = COPY_BYTES_PER_S) -> dict[str, float]:
    """{"prefill_s", "decode_s", "total_s"} for `documents` on a model of `config`
    (a ModelConfig); see the module doc."""
    layers, hidden = config.num_layers, config.hidden_size
    q_width = config.num_heads * config.head_dim
    per_layer = config.projection_params_per_layer()
    matrix = 2 * layers * per_layer  # FLOPs a token through the projections
    head = 2 * hidden * config.vocab_size  # FLOPs a logit row
    kv_token_bytes = config.kv_bytes_per_token(dtype_bytes)
    weight_bytes = (layers * per_layer + hidden * config.vocab_size) * dtype_bytes

    def attention(queries: int, keys_before: int) -> float:
        """FLOPs of `queries` consecutive tokens each attending to the `keys_before` before
        them and to the earlier of themselves (causal)."""
        keys = queries * keys_before + queries * (queries + 1) / 2
        return 4 * q_width * layers * keys

    prefill = decode_flops = kv_bytes = 0.0
    answer_total = longest = 0
    for doc in documents:
        length = doc.prefix_tokens
        prefill += length * matrix + attention(length, 0)
        for q, a in zip(doc.question_tokens, doc.answer_tokens):
            prefill += q * matrix + attention(q, length) + head
            decode_flops += (a - 1) * (matrix + head) + attention(a - 1, length + q + 1)
            kv_bytes += sum(q + i for i in range(1, a)) * kv_token_bytes  # its own tokens
        steps_here = max(doc.answer_tokens, default=1) - 1
        kv_bytes += steps_here * length * kv_token_bytes  # the document, once a step
        answer_total += sum(a - 1 for a in doc.answer_tokens)
        longest = max(longest, steps_here)
    steps = max(math.ceil(answer_total / max_batch), longest)
    decode_bytes = steps * weight_bytes + kv_bytes
    prefill_s = prefill / flops
    decode_s = max(decode_flops / flops, decode_bytes / bandwidth)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "total_s": prefill_s + decode_s}


def workload_documents(jobs, tokenizer) -> list[DocumentWork]:
    """The drawn workload's documents as the worker prefills them: each document's jobs'
    questions in one prompt (bench/workloads.Jobs), tokenized as the engine tokenizes. A
    question of several samples decodes each (its prompt counted once: the later samples'
    question tokens are 0)."""
    by_doc: dict[int, list] = {}
    for job in jobs.jobs:
        by_doc.setdefault(job.document, []).append(job)
    out = []
    for index, doc_jobs in by_doc.items():
        questions = [(q, job.max_new_tokens, job.params.get("samples", 1))
                     for job in doc_jobs for _, q in job.questions]
        prompt = tokenizer.prompt(doc_jobs[0].template, jobs.documents[index],
                                  [q for q, _, _ in questions])
        doc = DocumentWork(len(prompt.prefix_ids), [], [])
        for suffix, (_, budget, samples) in zip(prompt.suffix_ids, questions):
            doc.question_tokens += [len(suffix)] + [0] * (samples - 1)
            doc.answer_tokens += [budget] * samples
        out.append(doc)
    return out
