"""What goes into and comes out of `Engine.run`: requests, answers, run statistics, and the error
for a question that cannot fit. Plain dataclasses without torch, so the worker and the CLI can
build requests and read results without importing the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ppqa.choices import check_choices, check_norm
from ppqa.config import SamplingParams


FINISH_REASONS = ("stop", "length", "choice")


class PromptTooLongError(ValueError):
    """A question whose document + question + answer budget exceeds the context or the KV pool."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class InvalidRequestError(ValueError):
    """A request's own input (its template, document or sampling parameters) cannot be run:
    retrying it cannot help. Other requests of the same run go on."""


@dataclass
class QuestionRequest:
    key: object  # the caller's id, handed back with the answer
    document: str
    question: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    template: str = "qa"  # a built-in name or a .jinja path (a label when template_source is set)
    template_source: str | None = None  # the template's text, rendered instead of `template`
    # Labels to choose from: the answer is the one whose tokens are most likely after the
    # prompt (no generation; see engine/scoring.py). `choice_norm`: how the choices' summed
    # log-probabilities are compared (ppqa/choices.py).
    choices: tuple[str, ...] | None = None
    choice_norm: str = "none"
    # Answers drawn for this question, each from its own random stream (seeded from the
    # question's seed and the sample's index, `config.sample_seed`); each comes back as its
    # own Answer with `sample` 0..samples-1. Needs a temperature above 0. A question with
    # choices is scored once and its samples drawn from the choices' distribution at the
    # temperature (ppqa/choices.py `draw_choices`); with one sample it is the best choice.
    samples: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.document, str) or not isinstance(self.question, str):
            raise TypeError("QuestionRequest.document and .question must be strings")
        if self.template_source is not None and not isinstance(self.template_source, str):
            raise TypeError("QuestionRequest.template_source must be None or a string")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"QuestionRequest.sampling must be a SamplingParams, "
                            f"got {type(self.sampling).__name__}")
        if self.choices is not None:
            self.choices = check_choices(self.choices)
        check_norm(self.choice_norm)
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"QuestionRequest.samples must be an integer >= 1, got {self.samples!r}")
        if self.samples > 1 and self.sampling.greedy:
            raise ValueError(f"{self.samples} samples need a temperature above 0: greedy "
                             "decoding would give the same answer every time")


@dataclass
class Answer:
    text: str
    token_ids: list[int]  # generated ids; an EOS that ended the answer is not included
    # "stop" (EOS or a stop string) | "length" (max_new_tokens) | "choice" (a scored choice)
    finish_reason: str
    prompt_tokens: int  # document prefix + question suffix
    question_index: int = 0  # position in the question list of `Engine.answer`
    latency_s: float = 0.0  # from the start of the session to this answer
    mode: str = "stock"  # how it was decoded
    streams: int = 1  # P of its request (1 for stock and cascade)
    # Device seconds charged to this answer: its share of the prefill steps that held its
    # document and question, and of the decode steps that fed it (see engine/session.py).
    prefill_s: float = 0.0
    decode_s: float = 0.0
    sample: int = 0  # which of the question's `samples` this is
    # A question with choices: the chosen label (also `text`; a sample's drawn one), and per
    # choice, in the question's order, its summed log-probability and its probability (the
    # softmax of the normalised scores over the choices, at temperature 1, whatever the draw's
    # temperature). None for generated answers.
    choice: str | None = None
    choices: list[str] | None = None  # the labels, in the question's order
    choice_logprobs: list[float] | None = None
    choice_probs: list[float] | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Answer.finish_reason must be one of {', '.join(FINISH_REASONS)}, "
                             f"got {self.finish_reason!r}")


@dataclass
class RunStats:
    wall_s: float = 0.0
    prefill_s: float = 0.0  # document and question prefill forwards
    decode_s: float = 0.0  # decode forwards (with sampling)
    prompt_tokens: int = 0  # sum of Answer.prompt_tokens over answered questions
    prefilled_tokens: int = 0  # tokens actually prefilled (documents not yet cached + questions)
    answer_tokens: int = 0
    questions: int = 0  # questions answered
    errors: int = 0  # questions rejected (on_error)
    cancelled: int = 0  # questions dropped because their keys were cancelled
    steps: int = 0  # forward passes
    # document chunks run in the forward of the question prefill after them (StepInputs.lead)
    chunks_with_questions: int = 0
    # decode steps whose forward was launched before the step in flight was read back
    overlapped_steps: int = 0
    max_batch_requests: int = 0  # most requests decoded together in one step
    # requests that gave their place to waiting ones while their last step was in flight
    left_early: int = 0
    streams: int = 1  # P (1 for stock and cascade)
    mode: str = "stock"  # the resolved mode ("mixed" when document groups differ)
    peak_memory_bytes: int = 0  # GPU only
    stopped: bool = False  # should_stop() ended the run early
