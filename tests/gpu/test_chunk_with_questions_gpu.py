"""A document's last chunk in the forward of its questions' prefill on the GPU: in bf16 the
chunk's part takes the fused first-chunk path and the question rows' logits are those of the two
forwards apart; in fp32 a session of documents arriving while others decode answers as stock."""

import pytest
import torch

from ppqa import Engine
from ppqa.config import EngineConfig
from tests.helpers import documents_arriving, pending_document, plain_template

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("model", ["tiny-gqa", "tiny-hd128"])
def test_lead_chunk_in_bf16_matches_two_forwards(model):
    eng = Engine(f"dummy:{model}", device="cuda", dtype="bfloat16",
                 config=EngineConfig(mem_fraction=0.05))
    gen = torch.Generator().manual_seed(1)
    doc_ids = torch.randint(3, eng.model_config.vocab_size, (900,), generator=gen).tolist()
    logits = []
    for together in (False, True):
        eng.parts.docs.clear()
        session, doc = pending_document(eng, doc_ids)
        chunk = session.sched.document_chunk(doc)
        assert chunk.plain_causal
        (step,) = session._question_steps(session.sched.questions_ready())
        assert step.inputs.cascade_groups is not None  # the grouped question prefill
        eng.parts.backend.causal_path = None
        if together:
            step.inputs.lead = chunk
        else:
            eng.parts.runner.run(chunk)
        logits.append(eng.parts.runner.run(step.inputs).float())
        assert eng.parts.backend.causal_path in ("triton", "cudnn")
        session.close()
    err = (logits[1] - logits[0]).norm() / logits[0].norm()
    assert err < 1e-2, err


@pytest.mark.parametrize("mode", ["stock", "cascade", "parallel"])
def test_chunks_with_questions_give_stock_answers_on_the_gpu(mode, tmp_path):
    eng = Engine("dummy:tiny-gqa", device="cuda", dtype="float32",
                 config=EngineConfig(mem_fraction=0.05, max_prefill_tokens=400))
    got, expected, stats, docs = documents_arriving(eng, plain_template(tmp_path), mode)
    assert got == expected
    assert stats.chunks_with_questions == docs
