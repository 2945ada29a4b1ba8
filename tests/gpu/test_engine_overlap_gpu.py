"""The step in flight on a GPU (CUDA graphs, input tokens gathered on the device from the
previous step's samples): answers with EOS, stop strings and short budgets equal those of
step-by-step runs, in every mode (tests/test_engine_overlap.py runs the same on the CPU)."""

import random

import pytest
import torch

from ppqa import Engine, QuestionRequest, SamplingParams
from ppqa.config import EngineConfig
from tests.helpers import answers_by_key, overlap_workload, plain_template

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("mode,streams", [("stock", None), ("cascade", None), ("parallel", 4)])
def test_step_in_flight_on_the_gpu(mode, streams, tmp_path):
    tmpl = plain_template(tmp_path)
    requests = overlap_workload(random.Random(mode), tmpl)
    engines = {overlap: Engine("dummy:tiny-gqa", device="cuda", dtype="float32",
                               config=EngineConfig(seed=3, overlap_steps=overlap, mem_fraction=0.05))
               for overlap in (True, False)}
    eight_tokens = SamplingParams(max_new_tokens=8, ignore_eos=True)
    probe = answers_by_key(engines[False], [QuestionRequest(r.key, r.document, r.question,
                                                            eight_tokens, tmpl) for r in requests],
                           mode="stock")
    firsts = [ids[1] for ids, _, _ in probe.values() if len(ids) > 2]
    eos = max(set(firsts), key=firsts.count)  # a token some answers emit early
    for eng in engines.values():
        eng.tokenizer.eos_token_ids = [eos]
    reference = answers_by_key(engines[False], requests, mode=mode, streams=streams)
    assert answers_by_key(engines[True], requests, mode=mode, streams=streams) == reference
    assert "stop" in {reason for _, reason, _ in reference.values()}
