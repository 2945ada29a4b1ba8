"""SmolLM2-135M-Instruct through the public API answers questions about a real document sensibly,
with the same answers in every mode (greedy, fp32)."""

from __future__ import annotations

from pathlib import Path

from ppqa import Engine, SamplingParams

DOCUMENT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889 as the centrepiece of the 1889 World's Fair. The tower is 330 metres tall "
    "and was the tallest man-made structure in the world until the Chrysler Building in New York "
    "was finished in 1930."
)
QUESTIONS = {
    "Who designed the tower?": "Gustave Eiffel",
    "In which country is the tower?": "France",
    "How tall is the tower, in metres?": "330",
}


def test_smollm2_answers_a_real_document_identically_in_every_mode(smollm2: Path) -> None:
    eng = Engine("smollm2", device="cpu")
    questions = list(QUESTIONS)
    sampling = SamplingParams(max_new_tokens=24)
    answers = {mode: eng.answer(DOCUMENT, questions, mode=mode, sampling=sampling)
               for mode in ("stock", "parallel", "cascade")}
    for answer, expected in zip(answers["stock"], QUESTIONS.values()):
        assert expected in answer.text, (answer.text, expected)
    for mode in ("parallel", "cascade"):
        assert [a.token_ids for a in answers[mode]] == [a.token_ids for a in answers["stock"]], mode
        assert [a.text for a in answers[mode]] == [a.text for a in answers["stock"]], mode
