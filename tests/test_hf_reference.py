"""SmolLM2 against transformers, an implementation no one here wrote, on the same GGUF file.

1. Our loader's weights (dequantized, q/k un-permuted, config from the metadata) equal the ones
   transformers' GGUF loader produces, and a transformers model built from our ModelConfig holding
   them gives the same logits: this proves the loader and the config mapping.
2. Our Engine's greedy tokens (modes `stock` and `parallel`) equal transformers' `generate` greedy
   tokens from the same prompt ids (our `Tokenizer.prompt`): this proves the model end to end.
The transformers model is loaded once for the module (~12 s on a 2-core CPU).
"""

from __future__ import annotations

import pytest
import torch

from ppqa.engine.loading.loader import load_model
from tests.helpers import hf_twin

DOCUMENT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. It was the entrance arch of the 1889 World's Fair. The tower is 330 metres "
    "tall, about the same height as an 81-storey building, and it was the tallest man-made "
    "structure in the world until the Chrysler Building in New York City was finished in 1930."
)
QUESTIONS = ["Who is the tower named after?", "How tall is the tower?",
             "Which building was taller than the tower in 1930?"]
NEW_TOKENS = 16


def test_loader_weights_and_config_match_transformers(smollm2, hf_smollm2):
    ours = load_model("smollm2")
    c, hc = ours.config, hf_smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        (hc.num_hidden_layers, hc.hidden_size, hc.num_attention_heads, hc.num_key_value_heads,
         hc.head_dim, hc.vocab_size)
    assert c.tie_word_embeddings == hc.tie_word_embeddings is True
    reference = hf_smollm2.state_dict()
    weights = dict(ours.weights)
    assert len(weights) == 272
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name  # same dequantization, same row order
    twin = hf_twin(c, weights.items())
    ids = torch.tensor([ours.tokenizer.prompt("qa", DOCUMENT, QUESTIONS[:1]).ids(0)])
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, hf_smollm2(ids).logits, rtol=1e-4, atol=1e-4)


def _hf_greedy(model, prompt_ids: list[int], eos_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    tokens = out[0, ids.shape[1]:].tolist()
    for i, t in enumerate(tokens):  # our answers exclude the EOS that ended them
        if t in eos_ids:
            return tokens[:i]
    return tokens


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    """One Engine for both modes (from the shared file's path; `smollm2` by name is tested elsewhere)."""
    from ppqa import Engine

    return Engine(str(smollm2_gguf), device="cpu")


@pytest.fixture(scope="module")
def hf_answers(engine, hf_smollm2) -> list[list[int]]:
    prompt = engine.tokenizer.prompt("qa", DOCUMENT, QUESTIONS)
    eos = list(engine.tokenizer.eos_token_ids)
    return [_hf_greedy(hf_smollm2, prompt.ids(i), eos) for i in range(len(QUESTIONS))]


@pytest.mark.parametrize("mode", ["stock", "parallel"])
def test_engine_greedy_tokens_match_transformers(engine, hf_answers, mode):
    from ppqa import SamplingParams

    answers = engine.answer(DOCUMENT, QUESTIONS, mode=mode, template="qa",
                            sampling=SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [a.token_ids for a in answers] == hf_answers
    assert "Eiffel" in answers[0].text
