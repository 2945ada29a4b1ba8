"""JSON answers in the engine: the token bitmask against a per-token reference; a random model
under a schema answers valid JSON (the mask does the work: without it, its answers are not
JSON), greedy answers identical in every mode and with or without the step in flight; a schema
the library cannot compile fails its own question; SmolLM2 answers a real document in JSON
that validates, identically in every mode (fp32)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch

from ppqa import Engine, QuestionRequest, SamplingParams
from ppqa.engine.outputs import InvalidRequestError
from ppqa.engine.runtime.sampling import apply_token_bitmask
from ppqa.json_schema import schema_text
from tests.helpers import (BOUNDED_SCHEMA, answers_by_key, parses_as_json, plain_template, text,
                           tiny_engine)

BUDGET = 128
MODES = ("stock", "parallel", "cascade")


def bounded(**extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=BUDGET, json_schema=schema_text(BOUNDED_SCHEMA), **extra)


def test_bitmask_matches_a_per_token_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    for rows, vocab, words in ((5, 123, 4), (3, 64, 2), (2, 70, 2)):  # 70: past the mask's bits
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
        logits = torch.randn(rows, vocab, generator=gen)
        masked = apply_token_bitmask(logits, bitmask)
        for r in range(rows):
            for t in range(vocab):
                allowed = t < 32 * words and (int(bitmask[r, t // 32]) >> (t % 32)) & 1
                assert masked[r, t] == (logits[r, t] if allowed else float("-inf")), (r, t)


def test_random_model_answers_valid_json_only_under_the_mask(tmp_path: Path) -> None:
    eng = tiny_engine()
    tmpl = plain_template(tmp_path)
    rng = random.Random(5)
    doc = text(rng, 120)
    questions = [text(rng, rng.randint(4, 20)) for _ in range(6)]
    free = eng.answer(doc, questions, mode="stock", template=tmpl,
                      sampling=SamplingParams(max_new_tokens=32))
    assert not any(parses_as_json(a.text) for a in free)  # the random model alone never writes JSON
    by_mode = {mode: eng.answer(doc, questions, mode=mode, template=tmpl, sampling=bounded(),
                                streams=3 if mode == "parallel" else None) for mode in MODES}
    for answer in by_mode["stock"]:
        assert answer.finish_reason == "stop"  # the JSON completed: the answer ended there
        jsonschema.validate(json.loads(answer.text), BOUNDED_SCHEMA)
    for mode in MODES[1:]:
        assert [a.token_ids for a in by_mode[mode]] == [a.token_ids for a in by_mode["stock"]], mode
    sampled = eng.answer(doc, questions, mode="parallel", template=tmpl, streams=4,
                         sampling=[bounded(temperature=1.0, seed=i) for i in range(len(questions))])
    for answer in sampled:
        jsonschema.validate(json.loads(answer.text), BOUNDED_SCHEMA)
    assert len({a.text for a in sampled}) > 1


def test_constrained_and_free_questions_share_steps_with_or_without_the_step_in_flight(
        tmp_path: Path) -> None:
    """A constrained stream's mask needs its last token read back, so its steps are not built
    behind a step in flight; the free questions beside it must not notice."""
    tmpl = plain_template(tmp_path)
    rng = random.Random(9)
    docs = [text(rng, 90), text(rng, 40)]
    requests = []
    for d, doc in enumerate(docs):
        for q in range(6):
            sampling = bounded() if q % 2 else SamplingParams(max_new_tokens=rng.randint(3, 30))
            requests.append(QuestionRequest((d, q), doc, text(rng, rng.randint(3, 15)), sampling,
                                            tmpl))
    free = [r for r in requests if r.sampling.json_schema is None]
    runs = {}
    for overlap in (True, False):
        eng = tiny_engine(overlap_steps=overlap)
        for mode in MODES:
            runs[overlap, mode] = answers_by_key(eng, requests, mode=mode)
    reference = runs[False, "stock"]
    assert all(run == reference for run in runs.values())
    alone = answers_by_key(tiny_engine(), free, mode="stock")
    assert alone == {r.key: reference[r.key] for r in free}
    for r in requests:
        if r.sampling.json_schema is not None:
            jsonschema.validate(json.loads(reference[r.key][2]), BOUNDED_SCHEMA)


def test_a_schema_the_library_cannot_compile_fails_its_own_question(tmp_path: Path) -> None:
    eng = tiny_engine()
    bad = SamplingParams(max_new_tokens=8, json_schema='{"type": "array", "uniqueItems": true}')
    requests = [QuestionRequest(0, "A document.", "Fine?", SamplingParams(max_new_tokens=4)),
                QuestionRequest(1, "A document.", "Unique?", bad)]
    answers, errors = {}, {}
    eng.run(requests, on_answer=lambda r, a: answers.__setitem__(r.key, a),
            on_error=lambda r, e: errors.__setitem__(r.key, e))
    assert list(answers) == [0] and list(errors) == [1]
    assert isinstance(errors[1], InvalidRequestError)
    assert "cannot be compiled" in str(errors[1]) and "uniqueItems" in str(errors[1])


def test_sampling_params_refuse_a_schema_with_stop_strings_or_ignore_eos() -> None:
    with pytest.raises(ValueError, match="JSON object's text"):
        SamplingParams(json_schema="[1]")
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(json_schema="{}", stop=("}",))
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(json_schema="{}", ignore_eos=True)


RECORD = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "city": {"enum": ["Paris", "London", "New York"]},
        "confident": {"type": "boolean"},
    },
    "required": ["answer", "year", "city", "confident"],
    "additionalProperties": False,
}
EIFFEL = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
          "France. It is named after the engineer Gustave Eiffel, whose company designed and "
          "built the tower from 1887 to 1889 as the centrepiece of the 1889 World's Fair.")


def test_smollm2_answers_in_json_that_validates_identically_in_every_mode(smollm2: Path) -> None:
    eng = Engine("smollm2", device="cpu")
    questions = ["Who designed the tower?", "In which city is the tower?"]
    sampling = SamplingParams(max_new_tokens=48, json_schema=schema_text(RECORD))
    by_mode = {mode: eng.answer(EIFFEL, questions, mode=mode, sampling=sampling)
               for mode in MODES}
    records = [json.loads(a.text) for a in by_mode["stock"]]
    for record in records:
        jsonschema.validate(record, RECORD)
    assert "Eiffel" in records[0]["answer"] and records[1]["city"] == "Paris"
    for mode in MODES[1:]:
        assert [a.token_ids for a in by_mode[mode]] == [a.token_ids for a in by_mode["stock"]], mode

