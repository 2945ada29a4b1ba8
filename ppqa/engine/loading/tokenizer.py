"""Tokenizers and prompts: text in, the token ids every engine mode sees out.

A prompt is a shared prefix (chat wrapper start + instruction + document) and one suffix per
question (question + end of the user turn + the assistant's start). The Jinja2 templates in the
`ppqa.templates` package (or a user's `.jinja` file) supply the text of both parts as two
blocks, `prefix` and `question`; `Tokenizer.prompt` wraps them in the model's chat template when it
has one and tokenizes prefix and each suffix separately, so the split is a token boundary by
construction and `stock`, `parallel` and `cascade` all see the same ids.

A question with choices also gets each choice's tokens (`ChoiceTokens`): the tokens that
follow its rendered prompt when the choice's scored text is appended. They are found as
encode(question text + choice text) minus encode(question text) when the first starts with
the second (the usual case: byte-level BPE and SentencePiece split before the space or the
newline that starts a choice). When the tokenizer merges across the boundary (the question's
last token changes with the choice appended), the choice is encoded on its own instead, so that
the question's tokens stay the same for every choice (they are shared, see engine/scoring.py):
then the scored tokens are not exactly those of the joined text, which only matters for
templates that end the prompt in the middle of a word.

Three tokenizers: `HFTokenizer` wraps a `transformers` tokenizer (built by `loader.py` from an
HF directory or GGUF metadata, never from the hub); `json_tokenizer.JsonTokenizer` reads a saved
folder with the `tokenizers` library alone (the `+bpe` tokenizer: no `transformers` import at
start-up); `ByteTokenizer` is the file-free tokenizer of the `dummy:` models (UTF-8 bytes plus
BOS/EOS).
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ppqa.templates import (RENDERED_BLOCK, choice_letters, choice_text, compile_template,
                             load_template, render_block)

# Splits a rendered chat conversation into the prefix and the per-question part; control
# characters so that no real text (or chat template) contains it.
_SPLIT_MARK = "\x00ppqa-split\x00"
_QUESTION_MARK = "\x00ppqa-question\x00"
_REPLACEMENT = "\ufffd"


@dataclass
class ChoiceTokens:
    """A question's choices as scored: each choice's text after the prompt and its tokens."""

    texts: list[str]
    ids: list[list[int]]

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.ids) or any(not ids for ids in self.ids):
            raise ValueError("every choice needs a text and at least one token")


@dataclass
class Prompt:
    prefix_ids: list[int]  # shared: (chat wrapper start) + instruction + document
    suffix_ids: list[list[int]]  # one per question: question + (chat wrapper end) + assistant start
    # One per question when any question has choices (None for those without), else None.
    choices: list[ChoiceTokens | None] | None = None

    def __post_init__(self) -> None:
        if not self.suffix_ids:
            raise ValueError("a Prompt needs at least one question suffix")
        if any(not ids for ids in self.suffix_ids):
            raise ValueError("every question suffix must have at least one token")

    def ids(self, i: int) -> list[int]:
        """The full token ids of question i (prefix + suffix)."""
        return self.prefix_ids + self.suffix_ids[i]

    def with_common_opening(self) -> Prompt:
        """The same prompts with the tokens every suffix starts with moved into the prefix
        (each suffix keeps at least its last token, whose logits start the answer). Templates
        open each question alike ("Question: ..."; a fixed instruction); shared, those tokens
        are prefilled and cached once with the document instead of once per question, and no
        decode step reads them per question. One question: unchanged (its whole suffix would
        otherwise become a one-off document)."""
        if len(self.suffix_ids) < 2:
            return self
        first, shortest = self.suffix_ids[0], min(len(s) for s in self.suffix_ids)
        n = 0
        while n < shortest - 1 and all(s[n] == first[n] for s in self.suffix_ids):
            n += 1
        if n == 0:
            return self
        return Prompt(self.prefix_ids + first[:n], [s[n:] for s in self.suffix_ids],
                      self.choices)


@dataclass
class PromptTexts:
    """A prompt rendered but not yet tokenized (`Tokenizer.prompt_texts`). `all`: the texts
    one `encode_many` call takes, the prefix (document) first, then each question's."""

    template: Any
    prefix: str
    questions: list[str]
    contexts: list[dict[str, Any]]
    scored: bool  # some question has choices

    @property
    def all(self) -> list[str]:
        return [self.prefix, *self.questions]


class Tokenizer:
    """Base class: encode/decode plus prompt building from a template."""

    eos_token_ids: list[int]
    bos_token_id: int | None
    add_bos: bool = False  # prepend BOS to the prompt prefix
    chat_template: str | None = None
    # `encode_many` does its work outside Python (without the GIL), so another thread may run
    # it while this one launches steps (`EngineSession.submit(background=True)`).
    tokenizes_off_thread: bool = False

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text (a backend that can encodes them together, in parallel)."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; an incomplete character at the end (an answer cut inside a
        multi-byte character) is left out rather than shown as U+FFFD."""
        raise NotImplementedError

    @property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for: with it a text too
        long for a context is known without tokenizing it."""
        raise NotImplementedError

    def render_chat(self, user_content: str) -> str:
        """The conversation text of one user turn followed by the assistant's start."""
        return self.render_messages([{"role": "user", "content": user_content}])

    def render_messages(self, messages: Sequence[Mapping[str, str]], *,
                        add_generation_prompt: bool = True) -> str:
        """The conversation text of `messages` ({"role", "content"} each) in the model's chat
        template, followed by the assistant's start when `add_generation_prompt`."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    def prompt(self, template: str, document: str, questions: Sequence[str], *,
               variables: Mapping[str, Any] | None = None,
               template_source: str | None = None,
               choices: Sequence[Sequence[str] | None] | None = None) -> Prompt:
        """Tokenize `questions` about `document` with a template (built-in name or .jinja path).

        `variables` are extra names the template may use (e.g. `labels` for the label template).
        `template_source`: the template's text, when the caller holds it (a job stores its user
        template's text); `template` is then only its name in messages. `choices`: per
        question, its labels or None; the prompt then carries each choice's tokens.
        """
        texts = self.prompt_texts(template, document, questions, variables=variables,
                                  template_source=template_source, choices=choices)
        # One call for the document and every question: a batch-capable backend tokenizes
        # them on all cores while this thread waits.
        return self.prompt_from(texts, self.encode_many(texts.all))

    def prompt_texts(self, template: str, document: str, questions: Sequence[str], *,
                     variables: Mapping[str, Any] | None = None,
                     template_source: str | None = None,
                     choices: Sequence[Sequence[str] | None] | None = None) -> PromptTexts:
        """`prompt`'s first half: the rendered texts, to be tokenized in one `encode_many`
        call (`PromptTexts.all`; the engine session may run it on another thread) and
        finished by `prompt_from`."""
        if isinstance(questions, str):
            raise TypeError("questions must be a sequence of strings, not one string")
        if not questions:
            raise ValueError("no questions: a prompt needs at least one question")
        tmpl = (load_template(template) if template_source is None
                else compile_template(template_source, template))
        # A template of already rendered text (`raw`) is never wrapped a second time.
        wrap = self.chat_template is not None and RENDERED_BLOCK not in tmpl.blocks
        context = {**(variables or {}), "document": document, "chat": wrap}
        prefix_text = render_block(tmpl, "prefix", context)
        if choices is not None and len(choices) != len(questions):
            raise ValueError(f"{len(choices)} choice lists for {len(questions)} questions")
        per_question = list(choices) if choices is not None else [None] * len(questions)
        contexts = [{**context, "question": q, "index": i, "choices": c and list(c),
                     "letters": c and choice_letters(len(c))}
                    for i, (q, c) in enumerate(zip(questions, per_question))]
        question_texts = [render_block(tmpl, "question", ctx) for ctx in contexts]
        if wrap:
            # Chat templates often trim the message; leading blanks would not survive the split.
            prefix_text = prefix_text.lstrip()
            head, tail = self._chat_wrapper(prefix_text)
            prefix_text = head + prefix_text
            question_texts = [q + tail for q in question_texts]
        return PromptTexts(tmpl, prefix_text, question_texts, contexts,
                           any(c is not None for c in per_question))

    def prompt_from(self, texts: PromptTexts, encoded: Sequence[list[int]]) -> Prompt:
        """The `Prompt` of `texts` from `encode_many(texts.all)` (`prompt`'s second half)."""
        prefix_ids, *suffix_ids = (list(ids) for ids in encoded)
        if len(suffix_ids) != len(texts.questions):
            raise ValueError(f"{len(encoded)} encodings for {len(texts.all)} texts")
        if self.add_bos and self.bos_token_id is not None and prefix_ids[:1] != [self.bos_token_id]:
            prefix_ids.insert(0, self.bos_token_id)
        scored = None
        if texts.scored:
            scored = [None if ctx["choices"] is None else
                      self._choice_tokens(texts.template, ctx, text, ids)
                      for ctx, text, ids in zip(texts.contexts, texts.questions, suffix_ids)]
        return Prompt(prefix_ids, suffix_ids, scored)

    def _choice_tokens(self, tmpl, context: Mapping[str, Any], question_text: str,
                       question_ids: list[int]) -> ChoiceTokens:
        """The tokens of each choice after the question (see the module doc)."""
        texts, ids = [], []
        for i in range(len(context["choices"])):
            text = choice_text(tmpl, context, i)
            joined = self.encode(question_text + text)
            n = len(question_ids)
            tokens = joined[n:] if joined[:n] == question_ids else self.encode(text)
            if not tokens:
                raise ValueError(f"choice {context['choices'][i]!r} renders to no tokens")
            texts.append(text)
            ids.append(tokens)
        return ChoiceTokens(texts, ids)

    def _chat_wrapper(self, prefix_text: str) -> tuple[str, str]:
        """(text before the prefix, text after each question) in the chat-wrapped conversation."""
        rendered = self.render_chat(prefix_text + _SPLIT_MARK + _QUESTION_MARK)
        if rendered.count(_SPLIT_MARK + _QUESTION_MARK) != 1:
            raise ValueError("the model's chat template does not keep the user's message intact; "
                             "cannot split the prompt into a document prefix and question suffixes")
        before, after = rendered.split(_SPLIT_MARK + _QUESTION_MARK)
        if not before.endswith(prefix_text):
            raise ValueError("the model's chat template changes the message text; "
                             "cannot split the prompt into a document prefix and question suffixes")
        return before[: len(before) - len(prefix_text)], after


class HFTokenizer(Tokenizer):
    """A `transformers` tokenizer (fast backend), with its chat template and EOS ids."""

    def __init__(self, hf_tokenizer: Any, *, extra_eos_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        self.bos_token_id = hf_tokenizer.bos_token_id
        eos = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        self.eos_token_ids = sorted(set(eos) | {int(i) for i in extra_eos_ids})
        self.chat_template = getattr(hf_tokenizer, "chat_template", None) or None
        self.tokenizes_off_thread = bool(getattr(hf_tokenizer, "is_fast", False))
        # Whether the tokenizer itself adds BOS to plain text (Llama 2 yes, SmolLM2/Qwen no).
        with_specials = hf_tokenizer.encode("a", add_special_tokens=True)
        self.add_bos = (self.bos_token_id is not None and with_specials[:1] == [self.bos_token_id]
                        and hf_tokenizer.encode("a", add_special_tokens=False)[:1] != [self.bos_token_id])

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self.hf(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        return drop_cut_character(self.hf.decode(ids, skip_special_tokens=True),
                                  lambda: self.hf.decode(ids[-1:]))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        # Vocabulary strings overstate what they stand for (byte-level BPE writes a byte as a
        # 2-byte character, SentencePiece a space as 3 bytes), which is safe for a bound.
        return max((len(t.encode("utf-8")) for t in self.hf.get_vocab()), default=1) or 1

    def save_pretrained(self, folder: str) -> None:
        """Write the tokenizer's files into `folder` (a Hugging Face model folder)."""
        self.hf.save_pretrained(str(folder))

    def render_messages(self, messages: Sequence[Mapping[str, str]], *,
                        add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise NotImplementedError("this tokenizer has no chat template")
        return self.hf.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                           add_generation_prompt=add_generation_prompt)


def drop_cut_character(text: str, last_token_text) -> str:
    """`text` without its last character when that is a replacement character which the last
    token alone decodes to (`last_token_text()`): the first bytes of a character the answer
    stopped before. A replacement character the text really holds stays."""
    if text.endswith(_REPLACEMENT) and last_token_text().endswith(_REPLACEMENT):
        return text[:-1]
    return text


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then BOS and EOS; no files, no chat template (dummy models)."""

    NUM_BYTES = 256

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < self.NUM_BYTES + 2:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {self.NUM_BYTES + 2} "
                             f"(256 bytes + BOS + EOS), got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = self.NUM_BYTES
        self.eos_token_ids = [self.NUM_BYTES + 1]
        self.add_bos = True
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    max_token_bytes = 1

    def decode(self, ids: Sequence[int]) -> str:
        # Specials and the ids above them (a random model emits any id below vocab_size) carry no text.
        data = bytes(int(i) for i in ids if 0 <= int(i) < self.NUM_BYTES)
        # Not final: the incremental decoder keeps back an incomplete last character.
        return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=False)
