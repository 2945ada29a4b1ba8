"""JSON answers with decode steps replayed from CUDA graphs: the grammar's mask is applied to the
logits the graph returns, so replayed and eager steps give the same tokens, in every mode, and
every answer validates (fp32)."""

import json

import jsonschema
import pytest
import torch

from ppqa import Engine, SamplingParams
from ppqa.config import EngineConfig
from ppqa.json_schema import schema_text

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 99},
    "note": {"type": "string", "maxLength": 5}},
    "required": ["label", "score", "note"], "additionalProperties": False}


def test_constrained_graph_replay_matches_eager_in_every_mode():
    document = "Rivers carry silt to the delta, where the town of Mere was built. " * 6
    questions = [f"What happened in year {i}?" for i in range(9)]
    sampling = SamplingParams(max_new_tokens=96, json_schema=schema_text(SCHEMA))
    engines = {g: Engine("dummy:tiny-gqa", device="cuda", dtype="float32",
                         config=EngineConfig(cuda_graphs=g, mem_fraction=0.05)) for g in (False, True)}
    for mode in ("stock", "parallel", "cascade"):
        got = {g: eng.answer(document, questions, mode=mode, sampling=sampling,
                             streams=4 if mode == "parallel" else None)
               for g, eng in engines.items()}
        assert [a.token_ids for a in got[True]] == [a.token_ids for a in got[False]], mode
        for answer in got[True]:
            jsonschema.validate(json.loads(answer.text), SCHEMA)
    assert engines[True].captured_graphs >= 1
