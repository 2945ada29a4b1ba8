"""The engine's internal view of work: a `Request` is one row of the req_to_token table holding a
document and P streams (P = 1 for `stock` and `cascade`); a `Stream` is one question and its answer.

Per-stream state that every step needs (next rotary position, live flag, last token, sampling
parameters) is kept in small [P] numpy arrays (cheap to update one element, cheap to concatenate),
so the scheduler builds a step for B requests with a few concatenations, not a loop over tokens.

Two clocks: a step *schedules* a token for each stream it feeds (`num_out`, the sampling counter,
and the row/rotary positions advance when the step is built), and a token is *accepted* when the
host reads it back (`Request.accept`: EOS, stop strings, a completed JSON grammar and the token
budget end the stream).
The engine builds step t+1 before it reads step t's tokens, so a stream may be fed once after the
token that ended it; that token's KV lands in a slot only the dead stream can see, within its
reservation (a stream is never scheduled past its token budget).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ppqa.config import SamplingParams
from ppqa.engine.runtime.grammar import accept_token
from ppqa.engine.runtime.document_cache import CachedDocument, document_key


@dataclass(eq=False)
class Stream:
    key: object  # the caller's QuestionRequest (handed back with the answer)
    suffix_ids: list[int]
    sampling: SamplingParams
    seed: int  # resolved sampling seed
    prompt_tokens: int  # document + suffix
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None  # set when finished
    finished_at: float = 0.0
    cancelled: bool = False  # dropped by the caller: no answer, its place freed
    # Seconds of device work attributed to this stream: its share of the prefill steps that
    # held its document and question, and of the decode steps that fed it.
    prefill_s: float = 0.0
    decode_s: float = 0.0
    matcher: object | None = None  # a JSON answer's grammar state (runtime/grammar.StreamMatcher)
    # A scoring stream (engine/runtime/scoring.py): the tokens of the choices it scores, and
    # their places among its question's choices. None: a stream that generates.
    choice_ids: list[list[int]] | None = None
    choice_index: list[int] | None = None
    sample: int = 0  # which of its question's samples this stream draws

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def choice_tokens(self) -> int:
        """Choice tokens this stream forwards: none when every choice is one token (the
        question's last logits score them all)."""
        if self.choice_ids is None or all(len(c) == 1 for c in self.choice_ids):
            return 0
        return sum(len(c) for c in self.choice_ids)

    @property
    def reserve_tokens(self) -> int:
        """KV slots after the document: the question and its answer budget, or its choices."""
        if self.choice_ids is not None:
            return len(self.suffix_ids) + self.choice_tokens
        return len(self.suffix_ids) + self.sampling.max_new_tokens


@dataclass(eq=False)
class Request:
    doc_ids: list[int]
    streams: list[Stream]
    width: int  # P: this request's place in a step; streams beyond len(streams) are padding
    doc: CachedDocument | None = None
    row: int = -1
    slots: torch.Tensor | None = None  # reserved for questions + answers, after the document
    prefix_len: int = 0  # row tokens cached so far
    doc_key: bytes = b""  # document_key(doc_ids); computed here unless the caller shares one
    mode: str = "stock"  # how it decodes: "stock" | "cascade" (width 1) | "parallel" (width P)
    # A parallel request of samples of one question: the question's tokens, once in the row
    # after the document (stream -1, seen by every stream), and the streams' answers after it.
    shared_question: list[int] | None = None

    def __post_init__(self) -> None:
        if not 1 <= len(self.streams) <= self.width:
            raise ValueError(f"a request holds 1..{self.width} streams, got {len(self.streams)}")
        self.doc_key = self.doc_key or document_key(self.doc_ids)
        width, n = self.width, len(self.streams)
        pad = width - n
        self.next_pos = np.zeros(width, dtype=np.int64)
        self.live = np.zeros(width, dtype=bool)
        self.last_token = np.zeros(width, dtype=np.int64)
        self.num_out = np.zeros(width, dtype=np.int64)  # tokens scheduled: the RNG counter
        self.max_new = np.array([s.sampling.max_new_tokens for s in self.streams] + [0] * pad,
                                dtype=np.int64)
        # The step whose sampled tokens are still on the device (its id, this request's first
        # logit row in it), or -1: the next step takes this request's input tokens from there.
        self.pending_step, self.pending_row = -1, 0
        # Its row, slots and document reference given back while its last step was in flight
        # (`Scheduler.release_leaving`): that step's tokens are still to be accepted.
        self.left_early = False
        self.temperature = np.array([s.sampling.temperature for s in self.streams] + [0.0] * pad,
                                    dtype=np.float32)
        self.top_p = np.array([s.sampling.top_p for s in self.streams] + [1.0] * pad, dtype=np.float32)
        self.top_k = np.array([s.sampling.top_k for s in self.streams] + [0] * pad, dtype=np.int64)
        self.seed = np.array([s.seed for s in self.streams] + [0] * pad, dtype=np.int64)
        self.all_greedy = all(s.sampling.greedy for s in self.streams)
        self.constrained = any(s.matcher is not None for s in self.streams)

    @property
    def doc_len(self) -> int:
        return len(self.doc_ids)

    @property
    def question_lens(self) -> list[int]:
        return [len(s.suffix_ids) for s in self.streams]

    @property
    def scoring(self) -> bool:
        """A request that scores choices (one stream, no decode; see runtime/scoring.py)."""
        return self.streams[0].choice_ids is not None

    @property
    def prefill_tokens(self) -> int:
        """Tokens its prefill step forwards: its questions (and a scoring stream's choices)."""
        if self.shared_question is not None:
            return len(self.shared_question)
        return sum(len(s.suffix_ids) + s.choice_tokens for s in self.streams)

    @property
    def reserve_tokens(self) -> int:
        """KV slots to hold every question and its full answer budget (beyond the document)."""
        if self.shared_question is not None:
            return len(self.shared_question) + sum(s.sampling.max_new_tokens for s in self.streams)
        return sum(s.reserve_tokens for s in self.streams)

    @property
    def is_finished(self) -> bool:
        """Every stream has finished (meaningful once answers started: `live` marks the rest).
        Width 1 reads its one element: stock and cascade steps hold 256 requests."""
        return not (self.live[0] if self.width == 1 else self.live.any())

    def schedulable(self) -> np.ndarray:
        """[P] bool: streams a new step would feed (live, and token budget not yet scheduled)."""
        return self.live & (self.num_out < self.max_new)

    def feeds_one(self) -> bool:
        """`schedulable()` of a width-1 request, as one bool (no array)."""
        return bool(self.live[0]) and self.num_out[0] < self.max_new[0]

    def start_answers(self) -> None:
        """After the question prefill: every real stream is live at its first answer position."""
        n = len(self.streams)
        if self.shared_question is not None:
            self.prefix_len = self.doc_len + len(self.shared_question)
            self.next_pos[:n] = self.prefix_len
        else:
            self.prefix_len = self.doc_len + sum(self.question_lens)
            self.next_pos[:n] = [self.doc_len + q for q in self.question_lens]
        self.live[:n] = [not s.cancelled for s in self.streams]

    def cancel(self, s: int) -> None:
        """Drop stream s: it gets no answer and no further tokens."""
        self.streams[s].cancelled = True
        self.live[s] = False

    def accept(self, s: int, token: int, eos_ids: Sequence[int],
               decode: Callable[[list[int]], str], now: float) -> bool:
        """Apply stream s's sampled token; True if the stream finished with it."""
        stream = self.streams[s]
        params = stream.sampling
        if not params.ignore_eos and token in eos_ids:
            return self._finish(s, "stop", decode(stream.output_ids), now)
        stream.output_ids.append(token)
        if stream.matcher is not None and accept_token(stream.matcher, token):
            return self._finish(s, "stop", decode(stream.output_ids), now)  # the JSON is complete
        if params.stop:
            text = decode(stream.output_ids)
            cut = min((i for i in (text.find(t) for t in params.stop) if i >= 0), default=-1)
            if cut >= 0:
                return self._finish(s, "stop", text[:cut], now)
        if len(stream.output_ids) >= params.max_new_tokens:
            return self._finish(s, "length", decode(stream.output_ids), now)
        self.last_token[s] = token
        return False

    def _finish(self, s: int, reason: str, text: str, now: float) -> bool:
        stream = self.streams[s]
        stream.finish_reason, stream.text, stream.finished_at = reason, text, now
        self.live[s] = False
        return True
