"""The golden test: `parallel` and `cascade` give exactly the greedy tokens of `stock` (fp32).

Tiny random models (MHA; GQA with q/k/v bias; one KV head with odd sizes and tied embeddings),
documents of several lengths, questions of unequal lengths, P in (1, 3, 8, 64), and streams that
finish at different steps: an EOS id chosen among the tokens greedy decoding actually emits (so some
answers hit it early and others never), per-question max_new_tokens, stop strings and ignore_eos.
Then several documents in one batch, and a pool small enough that requests wait and documents are
evicted and prefilled again.
"""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest

from ppqa import Answer, QuestionRequest, SamplingParams
from tests.helpers import (assert_pool_holds_only_cached_documents, plain_template, text,
                           tiny_engine)

MODELS = ["tiny-mha", "tiny-gqa", "tiny-odd"]


def pick_eos(answers: list[Answer]) -> int:
    """A token that greedy emits mid-answer in some answers but not in all of them."""
    seen = collections.Counter()
    for a in answers:
        seen.update(set(a.token_ids[1:-1]))
    candidates = [t for t, n in seen.most_common() if n < len(answers)]
    assert candidates, "the random model emitted no usable EOS candidate"
    return candidates[0]


def varied_params(rng: random.Random, answers: list[Answer]) -> list[SamplingParams]:
    """Per-question budgets, some ignoring EOS, some with a stop string from their own answer."""
    params = []
    for a in answers:
        stop = ()
        decoded = [c for c in set(a.text[2:-2]) if c.isalpha()]
        if rng.random() < 0.3 and decoded:
            stop = (rng.choice(sorted(decoded)),)
        budget = 12 if rng.random() < 0.5 else rng.randint(1, 12)
        params.append(SamplingParams(max_new_tokens=budget, stop=stop,
                                     ignore_eos=rng.random() < 0.2))
    return params


def assert_same(reference: list[Answer], other: list[Answer], label: str) -> None:
    for i, (r, o) in enumerate(zip(reference, other, strict=True)):
        assert (o.token_ids, o.finish_reason, o.text) == (r.token_ids, r.finish_reason, r.text), \
            f"{label}: question {i} differs from stock"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("preset", MODELS)
def test_parallel_and_cascade_match_stock(preset: str, seed: int, tmp_path: Path) -> None:
    eng = tiny_engine(preset, seed=seed)  # seed: the random weights as well as the workload
    tmpl = plain_template(tmp_path)
    rng = random.Random(f"{preset}-{seed}")
    reasons, lengths = collections.Counter(), set()
    for doc_chars, n_questions, stream_counts in [(0, 4, (1, 3)), (36, 9, (3, 8)),
                                                  (299, 66, (8, 64))]:
        doc = text(rng, doc_chars)  # + BOS: documents of 1, 37 and 300 tokens
        questions = [text(rng, rng.randint(1, 20)) for _ in range(n_questions)]
        probe = eng.answer(doc, questions, mode="stock", template=tmpl,
                           sampling=SamplingParams(max_new_tokens=12, ignore_eos=True))
        eng.tokenizer.eos_token_ids = [pick_eos(probe)]
        params = varied_params(rng, probe)
        stock = eng.answer(doc, questions, mode="stock", sampling=params, template=tmpl)
        reasons.update(a.finish_reason for a in stock)
        lengths.update(len(a.token_ids) for a in stock)
        for streams in stream_counts:
            parallel = eng.answer(doc, questions, mode="parallel", sampling=params,
                                  streams=streams, template=tmpl)
            assert_same(stock, parallel, f"{preset} doc {doc_chars} parallel P={streams}")
        cascade = eng.answer(doc, questions, mode="cascade", sampling=params, template=tmpl)
        assert_same(stock, cascade, f"{preset} doc {doc_chars} cascade")
    # Streams really did finish at different steps, for both reasons.
    assert reasons["stop"] >= 5 and reasons["length"] >= 5 and len(lengths) >= 6, (reasons, lengths)


def several_documents(tmp_path: Path, seed: int) -> list[QuestionRequest]:
    rng = random.Random(seed)
    tmpl = plain_template(tmp_path)
    docs = [text(rng, n) for n in (120, 45, 200, 80)]
    requests = []
    for d, doc in enumerate(docs):
        for q in range(rng.randint(2, 7)):
            sp = SamplingParams(max_new_tokens=rng.randint(2, 10))
            requests.append(QuestionRequest((d, q), doc, text(rng, rng.randint(3, 15)), sp, tmpl))
    rng.shuffle(requests)  # documents interleaved in the caller's order
    return requests


def answers_of(eng, requests, **kwargs) -> tuple[dict, object]:
    got = {}
    stats = eng.run(requests, on_answer=lambda r, a: got.__setitem__(r.key, a), **kwargs)
    assert len(got) == len(requests)
    return got, stats


def stock_reference(requests) -> dict:
    eng = tiny_engine("tiny-gqa")
    eng.tokenizer.eos_token_ids = [7]
    return answers_of(eng, requests, mode="stock")[0]


@pytest.mark.parametrize("mode,streams", [("parallel", 3), ("parallel", 64), ("cascade", None)])
def test_several_documents_in_one_batch(mode: str, streams, tmp_path: Path) -> None:
    requests = several_documents(tmp_path, seed=5)
    reference = stock_reference(requests)
    eng = tiny_engine("tiny-gqa")
    eng.tokenizer.eos_token_ids = [7]
    got, stats = answers_of(eng, requests, mode=mode, streams=streams)
    for key, answer in reference.items():
        assert got[key].token_ids == answer.token_ids, f"{mode}: {key}"
    per_doc = collections.Counter(key[0] for key in reference)
    largest = max(per_doc.values()) if mode == "cascade" else -(-max(per_doc.values()) // streams)
    assert stats.max_batch_requests > largest  # requests of several documents decoded together


@pytest.mark.parametrize("mode,streams", [("stock", None), ("parallel", 3), ("cascade", None)])
def test_padded_fixed_shape_steps_match(mode: str, streams, tmp_path: Path) -> None:
    """cuda_graphs=True pads every decode step to a power of two with dummy requests (row 0, sink
    slots): the real requests' tokens must not change, and no document KV may be overwritten."""
    requests = several_documents(tmp_path, seed=13)
    reference = stock_reference(requests)
    eng = tiny_engine("tiny-gqa", cuda_graphs=True)
    eng.tokenizer.eos_token_ids = [7]
    for _ in range(2):  # the second run reads the documents cached by the first
        got, _ = answers_of(eng, requests, mode=mode, streams=streams)
        for key, answer in reference.items():
            assert got[key].token_ids == answer.token_ids, f"{mode}: {key}"
    assert not eng.parts.table.table[0].any()  # the dummy row still points only at the sink


@pytest.mark.parametrize("mode", ["stock", "parallel", "cascade"])
def test_small_pool_waits_and_evicts_documents(mode: str, tmp_path: Path) -> None:
    requests = several_documents(tmp_path, seed=9)
    reference = stock_reference(requests)
    # 330 slots hold the largest document (201 tokens) and a few requests, never all documents.
    eng = tiny_engine("tiny-gqa", kv_token_budget=330, max_batch_requests=3, max_prefill_tokens=64,
                      default_streams=2)
    eng.tokenizer.eos_token_ids = [7]
    question_tokens = sum(len(r.question) for r in requests)
    doc_tokens = sum(len(d) + 1 for d in {r.document for r in requests})
    for round_ in range(2):
        got, stats = answers_of(eng, requests, mode=mode)
        for key, answer in reference.items():
            assert got[key].token_ids == answer.token_ids, f"{mode} round {round_}: {key}"
        assert stats.max_batch_requests <= 3
        if round_ == 0:  # each document's requests run together: one prefill per document
            assert stats.prefilled_tokens == question_tokens + doc_tokens
        else:  # the pool cannot keep every document: evicted ones are prefilled again
            assert stats.prefilled_tokens > question_tokens
    assert_pool_holds_only_cached_documents(eng)


def test_document_cache_persists_across_runs(tmp_path: Path) -> None:
    eng = tiny_engine("tiny-mha")
    tmpl = plain_template(tmp_path)
    sp = SamplingParams(max_new_tokens=3)
    # Questions that open differently: no shared opening joins the document (tested below).
    requests = [QuestionRequest(i, "a cached document", f"{i}q", sp, tmpl) for i in range(4)]
    first = eng.run(requests, mode="parallel")
    second = eng.run(requests, mode="cascade")
    assert first.prefilled_tokens == 18 + 4 * 2  # BOS + 17 characters, then 4 questions
    assert second.prefilled_tokens == 4 * 2  # the document was cached: questions only


OPENING_TEMPLATE = ("{% block prefix %}{{ document }}{% endblock %}"
                    "{% block question %} Question {{ index % 3 }} of the set: {{ question }}"
                    "{% endblock %}")


@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa"])
def test_shared_question_opening_changes_no_answer(preset: str, tmp_path: Path) -> None:
    """Questions that open alike (" Question "): the common tokens join the document's prefix,
    prefilled once; every mode still gives stock's tokens without the sharing."""
    tmpl = tmp_path / "opening.jinja"
    tmpl.write_text(OPENING_TEMPLATE, encoding="utf-8")
    rng = random.Random(preset)
    doc = text(rng, 60)
    questions = [text(rng, rng.randint(1, 12)) for _ in range(7)]
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    apart = tiny_engine(preset, share_question_prefix=False)
    reference = apart.answer(doc, questions, mode="stock", sampling=sp, template=str(tmpl))
    eng = tiny_engine(preset)
    for mode, streams in [("stock", None), ("parallel", 3), ("cascade", None)]:
        got = eng.answer(doc, questions, mode=mode, sampling=sp, streams=streams,
                         template=str(tmpl))
        assert_same(reference, got, f"{preset} {mode} with a shared opening")


def test_shared_opening_is_prefilled_once_and_reuses_the_cached_document(tmp_path: Path) -> None:
    tmpl = tmp_path / "opening.jinja"
    tmpl.write_text(OPENING_TEMPLATE, encoding="utf-8")
    doc, questions = "a cached document of some length", ["one", "two", "three", "four"]
    sp = SamplingParams(max_new_tokens=2)
    opening = len(" Question ")  # then the question's index differs
    suffixes = sum(len(f" Question {i % 3} of the set: {q}") for i, q in enumerate(questions))
    eng = tiny_engine("tiny-mha")
    first = eng.run([QuestionRequest(0, doc, questions[0], sp, str(tmpl))], mode="stock")
    assert first.prefilled_tokens == 1 + len(doc) + len(" Question 0 of the set: one")
    many = [QuestionRequest(i, doc, q, sp, str(tmpl)) for i, q in enumerate(questions)]
    second = eng.run(many, mode="cascade")
    # The document's K/V are copied from the first run's entry; only the opening is new.
    assert second.prefilled_tokens == opening + suffixes - len(questions) * opening
    third = eng.run(many, mode="parallel")
    assert third.prefilled_tokens == suffixes - len(questions) * opening
    apart = tiny_engine("tiny-mha", share_question_prefix=False)
    assert apart.run(many, mode="cascade").prefilled_tokens == 1 + len(doc) + suffixes
