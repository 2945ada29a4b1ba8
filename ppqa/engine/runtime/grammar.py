"""Grammar-constrained decoding: each schema compiled once, a matcher per stream, a step's mask.

    SamplingParams.json_schema (text) -> `Grammars.matcher` (the session, when a question is
        prepared): compiled once per schema text against this engine's tokenizer, a copy of
        the compiled matcher per stream -> `Stream.matcher`
    a step's constrained rows -> `GrammarRows` (the scheduler puts it on the SamplingBatch) ->
        `sample`: `bitmask` fills one [R, ceil(V / 32)] int32 row per constrained stream on the
        host (the other rows allow everything), `apply_token_bitmask` masks the logits
    the token read back -> `Request.accept` -> `matcher.consume_token`; the answer ends when
        the matcher is stopped (nothing but EOS can follow: the JSON is complete).

The model's forward (a CUDA graph for decode steps) never sees the grammar: the mask is applied
to the logits the runner returns, before sampling, and filled on the host while the device
still runs the forward. A mask needs the stream's previous token accepted first, so a step
that holds a constrained stream is not built behind a step in flight (engine/session.py).

The library (llguidance, see ppqa/json_schema.py) is imported on the first schema only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ppqa.json_schema import grammar_for

MAX_CACHED_SCHEMAS = 128  # compiled schemas an engine keeps; a job's streams share one


class Grammars:
    """One engine's compiled schemas: the tokenizer as the library sees it (built on first use),
    and a pristine matcher per schema text that each stream copies."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lib_tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # a worker's threads may prepare questions side by side

    def matcher(self, schema: str):
        """A fresh matcher for `schema` (a JSON schema's text); ValueError with one line when
        the schema cannot be compiled for this tokenizer."""
        with self._lock:
            template = self._compiled.get(schema)
            if template is None:
                template = self._compiled[schema] = self._compile(schema)
                if len(self._compiled) > MAX_CACHED_SCHEMAS:  # a long-lived worker, many jobs
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(schema)
        return template.deep_copy()

    def _compile(self, schema: str):
        import llguidance

        if self._lib_tokenizer is None:
            self._lib_tokenizer = _library_tokenizer(self.tokenizer, self.vocab_size)
        try:
            grammar = grammar_for(schema)
        except ValueError as exc:
            raise ValueError(f"the JSON schema cannot be compiled: {exc}") from None
        matcher = llguidance.LLMatcher(self._lib_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            first = (matcher.get_error().strip().splitlines() or ["unknown error"])[0]
            raise ValueError(f"the JSON schema cannot be compiled: {first}")
        return matcher


@dataclass(eq=False)
class GrammarRows:
    """The constrained logit rows of one step: their matchers, as they stand when it samples."""

    matchers: list
    rows: list[int]

    def bitmask(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """[num_rows, ceil(vocab_size / 32)] int32 on the host: each constrained row's allowed
        tokens (filled by the library's thread pool), every token allowed in the others."""
        words = (vocab_size + 31) // 32
        bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
        _executor().unsafe_compute_mask_ptr(list(zip(self.matchers, self.rows)),
                                            bitmask.data_ptr(), words * 4, num_rows)
        return bitmask


_EXECUTOR = None


def _executor():
    """The library's thread pool for masks, one per process (it sizes itself to the CPUs)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def accept_token(matcher, token: int) -> bool:
    """Advance a stream's matcher by its sampled token; True when the grammar is complete (only
    EOS may follow). A token the mask allowed is always consumed; one it did not (impossible
    unless the mask was skipped) raises, rather than end an answer that breaks its schema."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"token {token} breaks the answer's grammar: {matcher.get_error()}")
    return matcher.is_stopped()


def _library_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the engine's tokenizer: a saved tokenizer.json as it is, a
    Hugging Face one through the library's converter; the dummy models' byte tokenizer as 256
    one-byte tokens and special ids."""
    import llguidance

    hf = getattr(tokenizer, "hf", None)
    eos = list(tokenizer.eos_token_ids)
    backend = getattr(tokenizer, "backend", None)  # json_tokenizer.JsonTokenizer's
    if backend is not None:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    if hf is not None:
        import llguidance.hf
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
    from llguidance._tokenizer import TokenizerWrapper

    return llguidance.LLTokenizer(TokenizerWrapper(_ByteVocabulary(tokenizer, vocab_size)),
                                  n_vocab=vocab_size, eos_token=eos)


class _ByteVocabulary:
    """What llguidance's TokenizerWrapper reads of a byte tokenizer: every id's bytes (the ids
    past the 256 bytes are specials, which no grammar allows), and how text encodes."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        nbytes = tokenizer.NUM_BYTES
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [bytes([i]) for i in range(nbytes)] + [
            f"<special_{i}>".encode() for i in range(nbytes, vocab_size)]
        self.special_token_ids = list(range(nbytes, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)
