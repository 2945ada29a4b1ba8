"""Tokenizers and prompt building: ByteTokenizer, SmolLM2's chat-wrapped prompts, the token split."""

from __future__ import annotations

import pytest

from ppqa.engine.loading.tokenizer import ByteTokenizer, Prompt

DOC = "The Eiffel Tower is in Paris. It was finished in 1889 and is 330 metres tall."
QUESTIONS = ["Where is the tower?", "When was it finished?", "How tall is it, in metres?"]


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer(301)
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.bos_token_id == 256 and tok.eos_token_ids == [257]
    # Specials and ids above the byte range (a random model emits them) decode to nothing.
    assert tok.decode([tok.bos_token_id, *ids, 257, 300]) == text
    # An answer cut inside a multi-byte character drops it (no trailing U+FFFD);
    # a byte that is invalid where it stands is still shown as U+FFFD.
    assert tok.decode(list("aé".encode())[:2]) == "a"
    assert tok.decode(list("a€".encode())[:3]) == "a"
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"


def test_byte_tokenizer_needs_room_for_specials():
    with pytest.raises(ValueError, match="vocab_size >= 258"):
        ByteTokenizer(257)


def test_byte_prompt_is_bos_prefix_then_question_suffixes():
    tok = ByteTokenizer(384)
    prompt = tok.prompt("qa", DOC, QUESTIONS)
    assert prompt.prefix_ids[0] == tok.bos_token_id
    prefix_text = tok.decode(prompt.prefix_ids)
    assert prefix_text.endswith("Document:\n" + DOC) and "Question" not in prefix_text
    assert len(prompt.suffix_ids) == len(QUESTIONS)
    for q, suffix in zip(QUESTIONS, prompt.suffix_ids):
        assert tok.decode(suffix) == f"\n\nQuestion: {q}\nAnswer:"
    assert prompt.ids(1) == prompt.prefix_ids + prompt.suffix_ids[1]


def test_prompt_rejects_empty_or_bare_string_questions():
    tok = ByteTokenizer(384)
    with pytest.raises(ValueError, match="no questions"):
        tok.prompt("qa", DOC, [])
    with pytest.raises(TypeError, match="not one string"):
        tok.prompt("qa", DOC, "Where?")
    with pytest.raises(ValueError, match="at least one question"):
        Prompt([1, 2], [])


def test_unknown_template_names_the_available_ones():
    with pytest.raises(ValueError, match="qa") as err:
        ByteTokenizer(384).prompt("nonexistent", DOC, QUESTIONS)
    for name in ("judge", "label", "multiple_choice"):
        assert name in str(err.value)


def test_smollm2_prompt_wraps_in_chat_template(smollm2):
    from ppqa.engine.loading.gguf import transformers_tokenizer  # the reference ppqa saves
    from ppqa.engine.loading.loader import load_model

    tok, hf = load_model("smollm2").tokenizer, transformers_tokenizer(smollm2)
    prompt = tok.prompt("qa", DOC, QUESTIONS)
    prefix = hf.decode(prompt.prefix_ids)
    assert prefix.startswith("<|im_start|>system\n") and "<|im_start|>user\n" in prefix
    assert prefix.endswith(DOC)
    for q, suffix in zip(QUESTIONS, prompt.suffix_ids):
        assert hf.decode(suffix) == f"\n\nQuestion: {q}<|im_end|>\n<|im_start|>assistant\n"
        assert tok.eos_token_ids[0] in suffix  # <|im_end|> closes the user turn
    # The split is a token boundary: prefix + suffix equals transformers' own tokenization of the
    # whole conversation (rendered by its apply_chat_template).
    for i, q in enumerate(QUESTIONS):
        content = tok.decode(prompt.prefix_ids).split("user\n", 1)[1] + f"\n\nQuestion: {q}"
        reference = hf.apply_chat_template([{"role": "user", "content": content}],
                                           tokenize=True, add_generation_prompt=True)
        if isinstance(reference, dict) or hasattr(reference, "keys"):
            reference = reference["input_ids"]
        assert prompt.ids(i) == list(reference)
    # SmolLM2 adds no BOS of its own: the chat template's <|im_start|> (id 1) opens the prompt once.
    assert not tok.add_bos and prompt.prefix_ids[:2] == [1, tok.encode("system")[0]]


def test_smollm2_decode_skips_specials_and_eos_is_im_end(smollm2):
    from ppqa.engine.loading.gguf import transformers_tokenizer  # the reference ppqa saves
    from ppqa.engine.loading.loader import load_model

    tok, hf = load_model("smollm2").tokenizer, transformers_tokenizer(smollm2)
    ids = tok.encode("<|im_start|>Hello world<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # special strings in text map to their ids
    assert tok.decode(ids) == "Hello world"
    assert tok.eos_token_ids == [2] and hf.convert_ids_to_tokens(2) == "<|im_end|>"


def test_smollm2_decode_of_a_cut_character_drops_it(smollm2):
    from ppqa.engine.loading.gguf import transformers_tokenizer  # the reference ppqa saves
    from ppqa.engine.loading.loader import load_model

    tok, hf = load_model("smollm2").tokenizer, transformers_tokenizer(smollm2)
    text = "Ok \U0001d518\u4e2d\u6587 done"  # a 4-byte and two 3-byte characters
    ids = tok.encode(text)
    cuts = [tok.decode(ids[:k]) for k in range(1, len(ids) + 1)]
    assert cuts[-1] == text
    # Every cut reads as a prefix of the text, never with a U+FFFD where a character was cut.
    assert all(text.startswith(c) and "\ufffd" not in c for c in cuts), cuts
    assert len(set(cuts)) < len(cuts)  # the premise: some cut fell inside a character
    # The bound the engine uses to refuse a too-long document before tokenizing it.
    assert max(len(hf.decode([i]).encode()) for i in ids) <= tok.max_token_bytes < 200


def test_common_opening_joins_the_prefix_and_keeps_each_prompt() -> None:
    tok = ByteTokenizer(384)
    questions = ["Summarize paragraph 1.", "Summarize paragraph 12.", "Summarize paragraph 2."]
    prompt = tok.prompt("qa", DOC, questions)
    shared = prompt.with_common_opening()
    opening = "\n\nQuestion: Summarize paragraph "
    assert tok.decode(shared.prefix_ids) == tok.decode(prompt.prefix_ids) + opening
    assert [tok.decode(s) for s in shared.suffix_ids] == ["1.\nAnswer:", "12.\nAnswer:",
                                                          "2.\nAnswer:"]
    for i in range(len(questions)):
        assert shared.ids(i) == prompt.ids(i)  # every question's tokens are unchanged


def test_common_opening_leaves_every_suffix_a_token_and_one_question_alone() -> None:
    same = Prompt([1, 2], [[5, 6, 7], [5, 6, 7], [5, 6, 7, 8]])
    shared = same.with_common_opening()  # identical suffixes keep their last token
    assert shared.prefix_ids == [1, 2, 5, 6] and shared.suffix_ids == [[7], [7], [7, 8]]
    alone = Prompt([1], [[5, 6, 7]])
    assert alone.with_common_opening() is alone
    apart = Prompt([1], [[5, 6], [6, 5]])
    assert apart.with_common_opening() is apart
