"""`JsonTokenizer` (engine/loading/json_tokenizer.py) against `transformers` on the same saved
folder (the `+bpe` tokenizer, SmolLM2's): the same ids, texts, special tokens, chat rendering
and prompts; and loading it imports no `transformers`."""

import os
import subprocess
import sys

import pytest

from ppqa.engine.loading.bpe import bpe_tokenizer, transformers_tokenizer
from ppqa.engine.loading.json_tokenizer import JsonTokenizer
from ppqa.engine.loading.tokenizer import HFTokenizer

TEXTS = [
    "Read the document.\n\nDocument:\n  Caf\u00e9 2024 -- 12,345 \u6771\u4eac\tend.\n\n\nQ: why?",
    "What happened on day 17? Don't say 'nothing' , it isn't true .",
    "emoji \U0001F600 and combining e\u0301, tabs\t\tand   runs of spaces",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "",
    "x" * 500,
]


@pytest.fixture
def pair(smollm2):
    fast = bpe_tokenizer()  # built from the GGUF by transformers once, saved, read back
    assert isinstance(fast, JsonTokenizer)
    return fast, HFTokenizer(transformers_tokenizer())


def test_same_ids_and_texts_as_transformers(pair):
    fast, ref = pair
    for text in TEXTS:
        ids = ref.encode(text)
        assert fast.encode(text) == ids, text
        assert fast.decode(ids) == ref.decode(ids), text
        for cut in range(1, min(len(ids), 40)):  # answers cut anywhere, mid-character too
            assert fast.decode(ids[:cut]) == ref.decode(ids[:cut])
    specials = [fast.bos_token_id, *fast.eos_token_ids]
    mixed = ref.encode("a b") + specials + ref.encode(" c")
    assert fast.decode(mixed) == ref.decode(mixed)
    # Together (a prompt's document and questions in one call), each as it is alone.
    alone = [ref.encode(text) for text in TEXTS]
    assert fast.encode_many(TEXTS) == alone and ref.encode_many(TEXTS) == alone


def test_same_special_tokens_vocabulary_and_bounds(pair):
    fast, ref = pair
    assert fast.vocab_size == ref.vocab_size
    assert fast.bos_token_id == ref.bos_token_id
    assert fast.eos_token_ids == ref.eos_token_ids
    assert fast.add_bos == ref.add_bos
    assert fast.chat_template == ref.chat_template and fast.chat_template
    assert fast.max_token_bytes == ref.max_token_bytes


def test_same_chat_rendering_and_prompts(pair):
    fast, ref = pair
    conversations = [
        [{"role": "user", "content": "Hello \u00e9"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
    ]
    for messages in conversations:
        for generation in (True, False):
            assert (fast.render_messages(messages, add_generation_prompt=generation)
                    == ref.render_messages(messages, add_generation_prompt=generation))
    document = "The ferry left at noon.\n\nIt came back at six."
    questions = ["When did the ferry leave?", "Who was on it?"]
    for template in ("qa", "label"):
        a = fast.prompt(template, document, questions, variables={"labels": ["yes", "no"]})
        b = ref.prompt(template, document, questions, variables={"labels": ["yes", "no"]})
        assert (a.prefix_ids, a.suffix_ids) == (b.prefix_ids, b.suffix_ids)
    a = fast.prompt("multiple_choice", document, questions, choices=[["noon", "six"], None])
    b = ref.prompt("multiple_choice", document, questions, choices=[["noon", "six"], None])
    assert (a.prefix_ids, a.suffix_ids) == (b.prefix_ids, b.suffix_ids)
    assert a.choices[0].ids == b.choices[0].ids and a.choices[1] is None


def test_loading_the_saved_tokenizer_imports_no_transformers(pair, tmp_path):
    saved = fast_copy = tmp_path / "copy"
    fast_copy.mkdir()
    pair[0].save_pretrained(fast_copy)
    assert (saved / "tokenizer.json").is_file() and (saved / "tokenizer_config.json").is_file()
    probe = ("import sys; from ppqa.engine.loading.json_tokenizer import JsonTokenizer; "
             f"t = JsonTokenizer({str(saved)!r}); "
             "print(len(t.encode('a sentence')), 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ}, timeout=120)
    assert done.returncode == 0, done.stderr
    count, imported = done.stdout.split()
    assert int(count) == len(pair[1].encode("a sentence")) and imported == "False"


def test_a_grammar_compiles_against_the_saved_tokenizer(pair):
    from ppqa.engine.runtime.grammar import Grammars

    fast, _ = pair
    grammars = Grammars(fast, fast.vocab_size)
    matcher = grammars.matcher('{"type": "object", "properties": {"a": {"type": "integer"}}, '
                               '"required": ["a"]}').matcher
    for token in fast.encode('{"a": 12}'):
        assert matcher.consume_token(token)
    assert matcher.is_accepting()


def test_an_llguidance_that_takes_one_end_id_gets_the_first():
    # llguidance 1.6 (in pyproject's range) takes eos_token as one int, later ones a list.
    from ppqa.engine.runtime.grammar import _with_eos

    def one_id(*args, eos_token, **kwargs):
        if not isinstance(eos_token, int):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        return args, eos_token, kwargs

    def many(*args, eos_token, **kwargs):
        return args, eos_token, kwargs

    assert _with_eos(one_id, "t", eos=[7, 9], n_vocab=5) == (("t",), 7, {"n_vocab": 5})
    assert _with_eos(many, "t", eos=[7, 9], n_vocab=5) == (("t",), [7, 9], {"n_vocab": 5})
