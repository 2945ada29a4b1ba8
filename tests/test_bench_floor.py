"""The floor of an end-to-end workload (bench/floor.py): the FLOPs and bytes of a toy model
counted by hand, the batch ceiling's bound on decode steps, and a drawn workload's documents
tokenized as the engine's prompts."""

from __future__ import annotations

from ppqa.bench import workloads as w
from ppqa.bench.floor import DocumentWork, floor_seconds, workload_documents
from ppqa.engine.loading.loader import load_model
from ppqa.engine.model.config import ModelConfig

# hidden 4, 2 heads of 2 (query width 4), 1 KV head (KV width 2), MLP 8, 2 layers, vocab 10:
# 4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8 = 144 projection parameters a layer.
TOY = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=2)


def test_a_toy_documents_floor_counted_by_hand() -> None:
    doc = [DocumentWork(prefix_tokens=3, question_tokens=[2], answer_tokens=[3])]
    # matrix 2 * 2 * 144 = 576 a token; LM head 2 * 4 * 10 = 80 a row; attention
    # 4 * 4 * 2 = 32 a (query, key) pair. Prefill: the document 3 * 576 + 32 * 6 (causal),
    # the question 2 * 576 + 32 * (2 * 3 + 3), its first answer token's head 80.
    # Decode: 2 tokens, 2 * (576 + 80) + 32 * (2 * 6 + 3).
    # Bytes: weights (2 * 144 + 4 * 10) * 2 = 656 a step, 2 steps; KV 2 * 2 * 2 * 2 = 16 a
    # token: the document's 3 tokens a step (2 steps) and the request's own 3 then 4 tokens.
    got = floor_seconds(TOY, doc, flops=1.0, bandwidth=1.0)
    assert got["prefill_s"] == 1728 + 192 + 1152 + 288 + 80
    assert got["decode_s"] == 1312 + 480  # the FLOPs, more than the 1312 + 208 bytes
    assert got["total_s"] == got["prefill_s"] + got["decode_s"]
    slow_memory = floor_seconds(TOY, doc, flops=1.0, bandwidth=0.5)
    assert slow_memory["decode_s"] == (1312 + 208) / 0.5


def test_the_batch_ceiling_bounds_the_decode_steps() -> None:
    docs = [DocumentWork(100, [5] * 64, [9] * 64) for _ in range(8)]  # 512 requests, 8 tokens
    memory_bound = {"flops": 1e30, "bandwidth": 1.0}
    wide = floor_seconds(TOY, docs, max_batch=512, **memory_bound)["decode_s"]
    narrow = floor_seconds(TOY, docs, max_batch=128, **memory_bound)["decode_s"]
    weights = (2 * 144 + 40) * 2
    assert narrow - wide == (4 * 8 - 8) * weights  # 32 steps of 128 against 8 of 512


def test_a_drawn_workloads_documents_are_its_prompts() -> None:
    loaded = load_model("dummy:tiny-gqa+bpe")
    jobs = w.make_jobs(w.WORKLOADS["labeling"], loaded.tokenizer, max_docs=2)
    docs = workload_documents(jobs, loaded.tokenizer)
    assert len(docs) == 2
    for doc, tokens in zip(docs, jobs.doc_tokens):
        assert doc.prefix_tokens > tokens  # the template's instruction around the document
        assert len(doc.question_tokens) == len(doc.answer_tokens) == 16
        assert all(q > 0 for q in doc.question_tokens) and set(doc.answer_tokens) == {64}
    one = floor_seconds(loaded.config, docs[:1])
    both = floor_seconds(loaded.config, docs)
    assert 0 < one["prefill_s"] < both["prefill_s"] and 0 < one["decode_s"] <= both["decode_s"]


def test_every_sample_of_a_question_decodes_and_its_prompt_counts_once() -> None:
    loaded = load_model("dummy:tiny-gqa+bpe")
    one = workload_documents(w.make_jobs(w.WORKLOADS["labeling"], loaded.tokenizer, 1),
                             loaded.tokenizer)[0]
    eight = workload_documents(w.make_jobs(w.WORKLOADS["labeling-samples8"], loaded.tokenizer,
                                           1), loaded.tokenizer)[0]
    assert eight.prefix_tokens == one.prefix_tokens
    assert len(eight.answer_tokens) == 8 * len(one.answer_tokens)
    assert sum(eight.question_tokens) == sum(one.question_tokens)
