"""Choices scored by SmolLM2 against transformers, an implementation no one here wrote.

On the first part of examples/harrowmere.txt, with the three templates that take choices: the
log-probability of every choice after document + question, computed by transformers' own
model (loaded from the same GGUF) on the text rendered by transformers' own chat template and
tokenizer, equals ppqa's in `parallel` (the choices side by side behind the shared question) and
in `stock` (one request per choice), within 1e-3 in fp32. The token ids agree too: ppqa's
prompt + choice tokens are exactly what the tokenizer makes of the joined text.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppqa.templates import choice_letters, choice_text, load_template, render_block

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# The founding and the early trade (about 500 tokens).
DOCUMENT = (EXAMPLES / "harrowmere.txt").read_text(encoding="utf-8").split("\nThe bridges")[0].strip()
# (template, question, choices, the right one according to the document)
CASES = [
    ("multiple_choice", "In what year was Harrowmere founded?", ("1690", "1734", "1801", "1871"),
     "1734"),
    ("label", "Who led the first settlers?", ("Agathe Vormund", "Tobias Renn",
                                              "the Guild of Dyers"), "Agathe Vormund"),
    ("judge", "Harrowmere blue was dyed with woad and a local lichen.", ("yes", "no"), "yes"),
]


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    from ppqa import Engine

    return Engine(str(smollm2_gguf), device="cpu")


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    """transformers' own tokenizer from the GGUF's metadata (the engine reads the copy ppqa
    saved from it, engine/loading/gguf.py)."""
    from ppqa.engine.loading.gguf import transformers_tokenizer

    return transformers_tokenizer(smollm2_gguf)


def reference_ids(hf, template: str, question: str, choices) -> tuple[list[int], list[str]]:
    """The prompt's ids from transformers' chat template and tokenizer, and each choice's text."""
    tmpl = load_template(template)
    context = {"document": DOCUMENT, "chat": True, "question": question, "index": 0,
               "choices": list(choices), "letters": choice_letters(len(choices))}
    content = render_block(tmpl, "prefix", context) + render_block(tmpl, "question", context)
    conversation = hf.apply_chat_template([{"role": "user", "content": content}],
                                          add_generation_prompt=True, tokenize=False)
    texts = [choice_text(tmpl, context, i) for i in range(len(choices))]
    return conversation, texts


@pytest.mark.parametrize("template,question,choices,right", CASES)
def test_choice_logprobs_match_transformers(engine, hf, hf_smollm2, template, question, choices,
                                            right):
    conversation, texts = reference_ids(hf, template, question, choices)
    want = []
    for text in texts:
        prompt_ids = hf.encode(conversation, add_special_tokens=False)
        ids = hf.encode(conversation + text, add_special_tokens=False)
        assert ids[:len(prompt_ids)] == prompt_ids
        with torch.no_grad():
            logp = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1)
        n = len(prompt_ids)
        want.append(sum(float(logp[n - 1 + j, t]) for j, t in enumerate(ids[n:])))
        # ppqa's prompt and choice tokens are the tokenizer's own for the joined text.
        prompt = engine.tokenizer.prompt(template, DOCUMENT, [question], choices=[choices])
        assert prompt.ids(0) + prompt.choices[0].ids[texts.index(text)] == ids
    for mode in ("parallel", "stock"):
        (answer,) = engine.score(DOCUMENT, [question], list(choices), template=template,
                                 mode=mode)
        assert answer.choice_logprobs == pytest.approx(want, abs=1e-3), mode
        assert answer.choice == choices[max(range(len(want)), key=want.__getitem__)]
    assert answer.choice == right  # even a 135M model reads these off the document


def test_choice_tokens_when_the_tokenizer_merges_across_the_prompt(engine, hf, tmp_path):
    """A prompt that ends in a space: joined, " yes" becomes one token and the prompt's last
    token changes; the choice is then tokenized alone and the prompt's tokens stay as they are
    (module doc of engine/loading/tokenizer.py). Without the space the choice's tokens are the
    joined text's tail."""
    for ending, merges in ((" ", True), ("", False)):
        path = tmp_path / f"t{len(ending)}.jinja"
        path.write_text("{% block prefix %}{{ document }}{% endblock %}{% block question %}"
                        "\nQ: {{ question }}\nA:" + ending + "{% endblock %}"
                        "{% block rendered %}{% endblock %}"
                        "{% block choice %}{% if not choice.startswith(' ') %}" +
                        ("" if merges else " ") + "{% endif %}{{ choice }}{% endblock %}")
        prompt = engine.tokenizer.prompt(str(path), "Some text.", ["Is it?"],
                                         choices=[("yes", "no")])
        question = "\nQ: Is it?\nA:" + ending
        assert prompt.suffix_ids[0] == hf.encode(question, add_special_tokens=False)
        joined = hf.encode(question + "yes", add_special_tokens=False)
        if merges:
            assert joined[:len(prompt.suffix_ids[0])] != prompt.suffix_ids[0]
            assert prompt.choices[0].ids[0] == hf.encode("yes", add_special_tokens=False)
        else:
            assert prompt.choices[0].ids[0] == hf.encode(
                question + " yes", add_special_tokens=False)[len(prompt.suffix_ids[0]):]
