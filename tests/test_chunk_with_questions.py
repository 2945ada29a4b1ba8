"""A document's last prefill chunk run in the forward of the question prefill after it
(`StepInputs.lead`, `runtime/runner.SplitAttention`): the same logits as the two forwards apart,
stock's answers whatever the mode, and the chunk launched alone where the two would not fit one
chunk's budget or where scoring reads the document first."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ppqa import QuestionRequest, SamplingParams
from ppqa.engine.runtime.runner import StepInputs
from tests.helpers import (documents_arriving, pending_document, plain_template,
                           stock_by_document, text, tiny_engine)


@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa"])
def test_lead_chunk_gives_the_logits_of_two_forwards(preset: str) -> None:
    """One forward of a document's last chunk and its question's prefill, which attends to
    the K/V the chunk writes in that same layer: the question's logits and every new K/V as
    when the two run apart (fp32)."""
    eng = tiny_engine(preset, seed=5)
    runner, pool = eng.parts.runner, eng.parts.pool
    rng = random.Random(0)
    doc_ids = [rng.randrange(3, 200) for _ in range(40)]
    logits, kv = [], []
    for together in (False, True):
        eng.parts.docs.clear()
        session, doc = pending_document(eng, doc_ids)
        req = session.sched.prefilling[0]
        chunk = session.sched.document_chunk(doc)
        (step,) = session._question_steps(session.sched.questions_ready())
        if together:
            step.inputs.lead = chunk
        else:
            runner.run(chunk)
        logits.append(runner.run(step.inputs))
        slots = torch.cat([doc.slots, req.slots[:len(req.streams[0].suffix_ids)]]).long()
        kv.append([buf[slots].clone() for buf in pool.k_buffers + pool.v_buffers])
        session.close()
    assert logits[0].shape == logits[1].shape and logits[0].shape[0] == 1
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(*kv):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_lead_must_be_a_chunk_without_logits() -> None:
    eng = tiny_engine("tiny-gqa")
    session, doc = pending_document(eng, list(range(3, 40)))
    chunk = session.sched.document_chunk(doc)
    (step,) = session._question_steps(session.sched.questions_ready())
    with pytest.raises(ValueError, match="lead"):
        StepInputs(**{**vars(chunk), "lead": step.inputs})


@pytest.mark.parametrize("mode", ["stock", "cascade", "parallel", "auto"])
def test_chunks_with_questions_give_stock_answers(mode: str, tmp_path: Path) -> None:
    """Documents submitted while others decode, one of several chunks: each prefills its
    chunks an iteration at a time, its last chunk beside its questions, and every mode
    answers as stock."""
    eng = tiny_engine("tiny-mha", seed=2, max_prefill_tokens=400)
    got, expected, stats, docs = documents_arriving(eng, plain_template(tmp_path), mode)
    assert got == expected
    assert stats.chunks_with_questions == docs


def test_no_lead_past_the_chunk_budget(tmp_path: Path) -> None:
    """Questions whose rows and their document's last chunk pass `max_prefill_tokens` run
    in a forward of their own, and still answer as stock."""
    eng = tiny_engine("tiny-gqa", seed=4, max_prefill_tokens=64)
    tmpl = plain_template(tmp_path)
    rng = random.Random(9)
    doc = text(rng, 60)
    requests = [QuestionRequest(("q", i), doc, text(rng, 60),
                                SamplingParams(max_new_tokens=2, ignore_eos=True), tmpl)
                for i in range(3)]
    expected = stock_by_document(eng, requests)
    eng.parts.docs.clear()
    got: dict = {}
    stats = eng.run(requests, mode="cascade",
                    on_answer=lambda r, a: got.__setitem__(r.key, a.token_ids))
    assert got == expected
    assert stats.chunks_with_questions == 0
