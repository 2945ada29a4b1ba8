"""Grammar-constrained decoding: each schema compiled once, a matcher per stream, a step's mask.

    SamplingParams.json_schema (text) -> `Grammars.matcher` (the session, when a question is
        prepared): compiled against this engine's tokenizer once per schema text and lane (one
        lane per mask thread), a copy of a lane's compiled matcher per stream, the lanes in
        turn -> `Stream.matcher` (a `StreamMatcher`)
    a step's constrained rows -> `GrammarRows` (the scheduler puts it on the SamplingBatch) ->
        `sample`: `bitmask` fills one [R, ceil(V / 32)] int32 row per constrained stream still
        answering on the host, lane by lane in the library's thread pool (the other rows allow
        everything), `apply_token_bitmask` masks the logits
    the token read back -> `Request.accept` -> `accept_token` (`consume_token`); the answer ends
        when the matcher is stopped (nothing but EOS can follow: the JSON is complete).

The model's forward (a CUDA graph for decode steps) never sees the grammar: the mask is applied
to the logits the runner returns, before sampling. A mask needs the stream's previous token
accepted first, so the session splits a constrained step in two (engine/session.py): its forward
is launched behind the step in flight, then that step is read back and its tokens consumed,
then the masks are filled on a background thread (`fill_later`) while the device runs the
forward and the session builds its next step, and applied when the step's tokens are needed. A
stream that the step in flight finished still has a row in the step behind it; its mask is not
filled (the token is dropped anyway), so a step whose constrained streams all finished builds no
bitmask at all.

The library (llguidance, see ppqa/json_schema.py) is imported on the first schema only.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ppqa.json_schema import grammar_for

MAX_CACHED_SCHEMAS = 128  # schemas an engine keeps compiled; a job's streams share them


def mask_threads() -> int:
    """Threads that fill a step's masks (the library's pool), and so the lanes of each schema:
    one per CPU this process may run on, at most 32 (the library's own cap). The engine's
    thread only waits while they work."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return max(1, min(32, cpus))


@dataclass(eq=False)
class StreamMatcher:
    """A stream's grammar state (`Stream.matcher`): its matcher, and its lane, the compiled
    matcher of its schema that it copies. llguidance's copies share their original's lexer
    behind one lock that a mask holds while it is filled, so the masks of one lane are filled
    one at a time; a schema is compiled once per mask thread (lanes, built as streams need
    them) and `GrammarRows.bitmask` hands the pool its rows lane by lane, so that its threads
    fill side by side."""

    matcher: object  # llguidance.LLMatcher
    lane: int


@dataclass(eq=False)
class _Lanes:
    templates: list  # compiled matchers, one per lane so far
    handed: int = 0  # matchers given out: the next one copies lane handed % lanes


class Grammars:
    """One engine's compiled schemas: the tokenizer as the library sees it (built on first use),
    and per schema text pristine matchers (its lanes) that the streams copy in turn."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.lanes = mask_threads()
        self._lib_tokenizer = None
        self._compiled: OrderedDict[str, _Lanes] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # a worker's threads may prepare questions side by side

    def matcher(self, schema: str) -> StreamMatcher:
        """A fresh matcher for `schema` (a JSON schema's text), on the next lane; ValueError
        with one line when the schema cannot be compiled for this tokenizer."""
        with self._lock:
            lanes = self._compiled.get(schema)
            if lanes is None:
                lanes = self._compiled[schema] = _Lanes([self._compile(schema)])
                if len(self._compiled) > MAX_CACHED_SCHEMAS:  # a long-lived worker, many jobs
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(schema)
            lane = lanes.handed % self.lanes
            lanes.handed += 1
            if lane == len(lanes.templates):
                lanes.templates.append(self._compile(schema))
            template = lanes.templates[lane]
        return StreamMatcher(template.deep_copy(), lane)

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
    """The constrained logit rows of one step: the streams whose matchers mask them (runtime/
    request.Stream), read when the step samples, not when it is built."""

    streams: list
    rows: list[int]

    def bitmask(self, num_rows: int, vocab_size: int, *, pin: bool = False) -> torch.Tensor | None:
        """[num_rows, ceil(vocab_size / 32)] int32 on the host: the allowed tokens of each row
        whose stream is still answering (filled by the library's thread pool), every token
        allowed in the others; None when no such row is left. pin: in page-locked memory, so
        that its copy to a GPU does not wait for the device."""
        # Lane by lane (rows are distinct, so matchers are never compared): the pool's threads
        # take contiguous runs of the list, so each works on a lane of its own most of the time.
        live = sorted((s.matcher.lane, row, s.matcher.matcher)
                      for s, row in zip(self.streams, self.rows)
                      if s.finish_reason is None and not s.cancelled)
        if not live:
            return None
        words = (vocab_size + 31) // 32
        bitmask = torch.empty((num_rows, words), dtype=torch.int32, pin_memory=pin)
        if len(live) < num_rows:  # rows the library does not write allow everything
            bitmask.fill_(-1)
        _executor().unsafe_compute_mask_ptr([(matcher, row) for _, row, matcher in live],
                                            bitmask.data_ptr(), words * 4, num_rows)
        return bitmask


_EXECUTOR = None
_FILLER = None


def fill_later(rows: GrammarRows, num_rows: int, vocab_size: int, *, pin: bool = False):
    """`rows.bitmask(...)` on a background thread (the library releases the GIL while its pool
    fills): a Future of the bitmask, so that the caller builds its next step meanwhile."""
    global _FILLER
    if _FILLER is None:
        from concurrent.futures import ThreadPoolExecutor
        _FILLER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppqa-masks")
    return _FILLER.submit(rows.bitmask, num_rows, vocab_size, pin=pin)


def _executor():
    """The library's thread pool for masks, one per process (`mask_threads` threads)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance
        _EXECUTOR = llguidance.LLExecutor(num_threads=mask_threads())
    return _EXECUTOR


def accept_token(state: StreamMatcher, token: int) -> bool:
    """Advance a stream's matcher by its sampled token; True when the grammar is complete (only
    EOS may follow). A token the mask allowed is always consumed; one it did not (impossible
    unless the mask was skipped) raises, rather than end an answer that breaks its schema."""
    matcher = state.matcher
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
        return _with_eos(llguidance.LLTokenizer, backend.to_str(), n_vocab=vocab_size, eos=eos)
    if hf is not None:
        import llguidance.hf
        return _with_eos(llguidance.hf.from_tokenizer, hf, n_vocab=vocab_size, eos=eos)
    from llguidance._tokenizer import TokenizerWrapper

    return _with_eos(llguidance.LLTokenizer,
                     TokenizerWrapper(_ByteVocabulary(tokenizer, vocab_size)),
                     n_vocab=vocab_size, eos=eos)


def _with_eos(make, *args, eos: list[int], **kwargs):
    """make(*args, eos_token=...): every end-of-sequence id where the installed llguidance
    takes a list; its first where it takes one id (the 1.6 releases, which pyproject's
    range allows: a model's other end ids then only end an answer outside a grammar)."""
    try:
        return make(*args, eos_token=eos, **kwargs)
    except TypeError:
        if len(eos) < 1:
            raise
        return make(*args, eos_token=eos[0], **kwargs)


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
