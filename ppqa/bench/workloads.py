"""The named workloads of `ppqa bench --e2e`: seeded documents, varied questions, answer budgets.

A `Workload` is groups of documents (`DocGroup`: how many, their length in tokens of the model's
own tokenizer, questions each, answer budget). `make_jobs(workload, tokenizer)` draws them from
the seed: each document is a slice of the project's synthetic prose (`grid.synthetic_text`) of
the drawn length, each question one of the forms below with the document's words filled in, each
answer budget fixed or drawn per question. Variants answer otherwise (`Workload.answers`): options
scored by log-probability, the same options listed and the letter generated, JSON under a
5-field schema, N samples per question or the same jobs N times; each names the workload it is
measured against. Dummy weights seldom emit EOS, so an answer ends at its
budget, as EOS would end it; budgets drawn per question are rounded to `budget_step` and a
document's questions of one budget make one job (the store keeps one budget per job), so its
streams finish at different steps. `write_batch` writes the jobs as an `ppqa ingest --batch`
file with each document once beside it (e2e.py ingests it).
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ppqa.bench.grid import _OBJECTS, _SUBJECTS, _TIMES, _VERBS, synthetic_text

# Free-form questions (template qa): 15-30 BPE tokens each once filled in.
_QA_FORMS = (
    "What did {s} do {t}, according to paragraph {p}?",
    "According to the document, who {v} {o}, and when did that happen?",
    "Summarize in one sentence what paragraph {p} says about {s}.",
    "Why does the text mention {o} in paragraph {p}, and what came of it?",
    "Which of the events described between paragraphs {p} and {p2} involved {s}?",
    "What happened to {o} {t}, and who was responsible for it?",
    "Compare what {s} did {t} with what {s2} did in paragraph {p2}.",
    "How many times does the document say that {s} {v} {o}?",
    "List the groups and places that paragraph {p} connects with {o}.",
    "Is there any paragraph where {s2} {v} {o} {t}? Give its number.",
)
# Classification questions (template label).
_LABEL_FORMS = (
    "Which topic does paragraph {p} mostly concern: trade, weather, building, law or festivals?",
    "Is the tone of paragraph {p} positive, negative or neutral?",
    "Does the document say that {s} {v} {o}? Answer yes, no or unclear.",
    "Which group acts first in paragraph {p}: {s} or {s2}?",
    "What kind of event does paragraph {p} describe: a disaster, a celebration, a construction "
    "or a dispute?",
    "Is {o} in paragraph {p2} described as a success or a failure?",
)


@dataclass(frozen=True)
class DocGroup:
    documents: int
    doc_tokens: int  # mean length; lengths are spread evenly over +-doc_spread of it
    questions: int  # per document
    answer_tokens: int  # the budget, or the mean of budgets drawn from answer_range
    answer_range: tuple[int, int] | None = None  # per-question budgets, triangular on this range
    doc_spread: float = 0.0  # fraction

    def __post_init__(self) -> None:
        if min(self.documents, self.doc_tokens, self.questions, self.answer_tokens) < 1:
            raise ValueError(f"DocGroup counts must be >= 1, got {self}")
        if not 0.0 <= self.doc_spread < 1.0:
            raise ValueError(f"DocGroup.doc_spread must be in [0, 1), got {self.doc_spread}")
        if self.answer_range is not None:
            low, high = self.answer_range
            # a triangular draw on [low, high] has mean (low + high + mode) / 3
            if not 1 <= low <= self.answer_tokens <= high or \
                    not low <= 3 * self.answer_tokens - low - high <= high:
                raise ValueError(f"DocGroup: no triangular draw on {self.answer_range} has mean "
                                 f"{self.answer_tokens}")


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # the default model spec (`--model` overrides it)
    groups: tuple[DocGroup, ...]
    template: str = "qa"  # qa or label (the question forms follow it)
    seed: int = 0
    budget_step: int = 1  # per-question budgets are rounded to a multiple of this
    arrivals: bool = False  # ingested at a steady rate while a `ppqa run --follow` worker runs
    description: str = ""
    # How questions are answered: "text" (generated), "choices" (options scored by
    # log-probability), "letters" (the same options listed in the question, the letter
    # generated), "json" (generated under JSON_SCHEMA).
    answers: str = "text"
    options: int = 0  # per question, for "choices" and "letters"
    samples: int = 1  # answers per question (drawn at temperature 0.8)
    copies: int = 1  # each job ingested this many times, with seeds 0, 1, ... (samples' baseline)

    def __post_init__(self) -> None:
        if self.template not in ("qa", "label", "multiple_choice"):
            raise ValueError(f"Workload.template must be qa, label or multiple_choice, "
                             f"got {self.template!r}")
        if self.answers not in ANSWER_KINDS:
            raise ValueError(f"Workload.answers must be one of {', '.join(ANSWER_KINDS)}, "
                             f"got {self.answers!r}")
        if (self.answers in ("choices", "letters")) != (self.options >= 2):
            raise ValueError("Workload.options (>= 2) goes with answers 'choices' or 'letters'")
        if self.samples < 1 or self.copies < 1:
            raise ValueError("Workload.samples and copies must be >= 1")
        if not self.groups or self.budget_step < 1:
            raise ValueError("a Workload needs document groups and budget_step >= 1")


@dataclass
class JobSpec:
    """One job to ingest: a document (by index), its questions (id, text) and their budget."""

    document: int
    name: str
    questions: list[tuple[str, str]]
    max_new_tokens: int
    template: str
    # Batch-line extras: each question's options (scored), and generation parameters.
    choices: list[list[str]] | None = None
    params: dict = field(default_factory=dict)


@dataclass
class Jobs:
    """A drawn workload: the document texts, their token counts and the jobs over them."""

    documents: list[str]
    doc_tokens: list[int]
    jobs: list[JobSpec] = field(default_factory=list)


ANSWER_KINDS = ("text", "choices", "letters", "json")
LETTERS = "ABCDEFGH"
# The 5-field record of the JSON-answer workloads (and of benchmarks/grammar_mask.py and
# grammar_step.py).
JSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "label": {"enum": ["positive", "negative", "neutral"]},
    "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
    "required": ["name", "age", "label", "score", "tags"], "additionalProperties": False}
# The eight labels of the label-scoring workload.
_LABELS = ("trade", "weather", "building", "law", "festivals", "disaster", "dispute", "travel")

_CODELLAMA, _QWEN = "dummy:codellama-7b+bpe", "dummy:qwen2.5-7b+bpe"
_QUALITY = (DocGroup(115, 5700, 18, 16, doc_spread=0.3),)
_LABELING_SHORT = (DocGroup(200, 2048, 32, 8),)
_LABELING = (DocGroup(100, 2048, 16, 64),)
_TINY = (DocGroup(3, 200, 4, 8),)
WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("paper", _CODELLAMA, (DocGroup(4, 16384, 256, 128), DocGroup(4, 8192, 64, 128)),
             description="4 documents of 16k tokens x 256 questions + 4 of 8k x 64, 128-token answers"),
    Workload("labeling", _CODELLAMA, _LABELING, template="label",
             description="100 documents of 2k tokens x 16 questions, 64-token answers"),
    Workload("labeling-short", _CODELLAMA, _LABELING_SHORT, template="label",
             description="200 documents of 2k tokens x 32 questions, 8-token answers"),
    Workload("quality", _QWEN, _QUALITY,
             description="QuALITY-shaped: 115 documents of ~5.7k tokens x 18 questions, "
                         "16-token answers"),
    Workload("loogle", _QWEN, (DocGroup(96, 19900, 18, 234, answer_range=(60, 400),
                                        doc_spread=0.2),), budget_step=50,
             description="LooGLE-shaped: 96 documents of ~19.9k tokens x 18 questions, answers "
                         "of 60-400 tokens (mean ~234), one job per (document, budget)"),
    Workload("arrivals", _CODELLAMA, _LABELING, template="label", arrivals=True,
             description="the labeling jobs ingested at a steady rate while `ppqa run --follow` "
                         "runs: throughput and latency from ingest to a job's last answer"),
    # Answers for labeling and judging, each beside the workload it is measured against.
    Workload("quality-choices", _QWEN, _QUALITY, template="multiple_choice", answers="choices",
             options=4, description="quality's documents and questions with 4 lettered options "
                                    "each, the answer scored by log-probability (no decode)"),
    Workload("quality-letters", _QWEN, _QUALITY, template="multiple_choice", answers="letters",
             options=4, description="quality-choices' questions and options, the letter "
                                    "generated (16-token answers)"),
    Workload("labeling-short-labels", _CODELLAMA, _LABELING_SHORT, template="label",
             answers="choices", options=8,
             description="labeling-short with 8 labels per question, scored by log-probability"),
    Workload("labeling-json", _CODELLAMA, _LABELING, template="label", answers="json",
             description="labeling, every answer a JSON record of 5 fields (a grammar mask)"),
    Workload("labeling-samples8", _CODELLAMA, _LABELING, template="label", samples=8,
             description="labeling, 8 samples per question at temperature 0.8 (--samples 8)"),
    Workload("labeling-copies8", _CODELLAMA, _LABELING, template="label", copies=8,
             description="labeling's jobs ingested 8 times (seeds 0-7, temperature 0.8): "
                         "labeling-samples8 done as separate jobs"),
    Workload("tiny", "dummy:tiny-gqa", _TINY,
             description="3 documents of 200 tokens x 4 questions, 8-token answers (CPU tests)"),
    Workload("tiny-arrivals", "dummy:tiny-gqa", _TINY, arrivals=True,
             description="the tiny jobs arriving while `ppqa run --follow` runs (CPU tests)"),
]}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: known workloads are {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def make_document(tokenizer, tokens: int, seed: int) -> tuple[str, int]:
    """(text, its token count): a seeded slice of the synthetic prose of `tokens` tokens (a BPE
    tokenizer may merge a few tokens differently once the slice is decoded and re-encoded)."""
    paragraphs = 8 + tokens // 40  # a paragraph is ~60 BPE tokens (~350 bytes)
    text = synthetic_text(seed, paragraphs)
    ids = tokenizer.encode(text)
    while len(ids) < tokens + 64:  # a longer text of the same seed starts with the shorter one
        paragraphs *= 2
        text = synthetic_text(seed, paragraphs)
        ids = tokenizer.encode(text)
    start = random.Random(seed).randrange(0, len(ids) - tokens)
    document = tokenizer.decode(ids[start:start + tokens]).strip()
    return document, len(tokenizer.encode(document))


def make_question(rng: random.Random, forms: tuple[str, ...]) -> str:
    paragraph = rng.randint(1, 300)
    return rng.choice(forms).format(
        s=rng.choice(_SUBJECTS), s2=rng.choice(_SUBJECTS), v=rng.choice(_VERBS),
        o=rng.choice(_OBJECTS), t=rng.choice(_TIMES), p=paragraph,
        p2=paragraph + rng.randint(1, 12))


def _budgets(group: DocGroup, rng: random.Random, step: int) -> list[int]:
    if group.answer_range is None:
        return [group.answer_tokens] * group.questions
    low, high = group.answer_range
    mode = 3 * group.answer_tokens - low - high
    return [min(high, max(low, step * round(rng.triangular(low, high, mode) / step)))
            for _ in range(group.questions)]


def question_requests(jobs: Jobs, documents: list[str] | None = None) -> list:
    """The drawn jobs as engine requests, job by job: keys (job name, question id), each job's
    budget with EOS ignored (dummy weights' answers end at their budgets) and its template.
    `documents` replaces the texts, index for index (the tools that time the session alone)."""
    from ppqa import QuestionRequest, SamplingParams

    texts = jobs.documents if documents is None else documents
    requests = []
    for job in jobs.jobs:
        sampling = SamplingParams(max_new_tokens=job.max_new_tokens, ignore_eos=True)
        requests += [QuestionRequest((job.name, qid), texts[job.document], q, sampling,
                                     template=job.template)
                     for qid, q in job.questions]
    return requests


def make_jobs(workload: Workload, tokenizer, max_docs: int | None = None) -> Jobs:
    """Draw the workload from its seed with `tokenizer` (the model's); see the module doc.
    `max_docs` keeps the first documents of each group only (quick trials)."""
    rng = random.Random(workload.seed)
    # Options come from a stream of their own, so that a workload's variants (text, choices,
    # letters) draw the same documents and questions.
    option_rng = random.Random(workload.seed + 7919)
    forms = _LABEL_FORMS if workload.template == "label" else _QA_FORMS
    params: dict = {}
    if workload.answers == "json":
        params["json_schema"] = JSON_SCHEMA
    if workload.samples > 1 or workload.copies > 1:
        params["temperature"] = 0.8
    if workload.samples > 1:
        params["samples"] = workload.samples
    out = Jobs([], [])
    for g, group in enumerate(workload.groups):
        count = min(group.documents, max_docs or group.documents)
        # Lengths evenly spaced over +-doc_spread, shuffled: their mean is doc_tokens exactly.
        lengths = [round(group.doc_tokens * (1 + group.doc_spread * (2 * (i + 0.5) / count - 1)))
                   for i in range(count)]
        rng.shuffle(lengths)
        for tokens in lengths:
            index = len(out.documents)
            text, length = make_document(tokenizer, tokens, seed=workload.seed * 100_003 + index)
            out.documents.append(text)
            out.doc_tokens.append(length)
            questions: list[str] = []
            while len(questions) < group.questions:  # millions of forms: a repeat is rare
                q = make_question(rng, forms)
                if q not in questions:
                    questions.append(q)
            options = [_options(option_rng, workload.options, workload.template)
                       for _ in questions]
            by_budget: dict[int, list[int]] = {}
            for i, budget in enumerate(_budgets(group, rng, workload.budget_step)):
                by_budget.setdefault(budget, []).append(i)
            for budget, picks in sorted(by_budget.items()):
                qs = [(f"q{i + 1}", _shown(questions[i], options[i], workload)) for i in picks]
                choices = ([options[i] for i in picks] if workload.answers == "choices"
                           else None)
                for copy in range(workload.copies):
                    extra = {**params, "seed": copy} if workload.copies > 1 else params
                    name = f"{workload.name}-g{g}-d{index:03d}" + (f"-c{copy}" if copy else "")
                    out.jobs.append(JobSpec(index, name, qs, budget, workload.template,
                                            choices, extra))
    return out


def _options(rng: random.Random, count: int, template: str) -> list[str]:
    """`count` distinct options: topic labels for the label template, else things the
    document's sentences speak of (the answers to its questions' forms)."""
    if count <= 0:
        return []
    return rng.sample(_LABELS if template == "label" else _OBJECTS, count)


def _shown(question: str, options: list[str], workload: Workload) -> str:
    """The question as asked: for "letters", with its options listed as the multiple_choice
    template lists a question's choices, so both kinds see one prompt."""
    if workload.answers != "letters":
        return question
    return question + "".join(f"\n{LETTERS[i]}. {o}" for i, o in enumerate(options))


def write_batch(jobs: Jobs, folder: Path, specs: list[JobSpec] | None = None,
                name: str = "batch.jsonl") -> Path:
    """An `ppqa ingest --batch` file of `specs` (default: every job) in `folder`, the
    documents written once each under folder/docs/ and referenced by path. A file already
    there is kept only if it holds the same text: a folder used before for another workload,
    seed or `max_docs` would otherwise hand its documents to this one."""
    docs = folder / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    lines = []
    for job in jobs.jobs if specs is None else specs:
        doc = docs / f"d{job.document:04d}.txt"
        text = jobs.documents[job.document]
        if not doc.exists() or doc.read_text(encoding="utf-8") != text:
            doc.write_text(text, encoding="utf-8")
        questions = [{"id": qid, "question": q} for qid, q in job.questions]
        for item, options in zip(questions, job.choices or []):
            item["choices"] = options
        lines.append(json.dumps({
            "document_path": f"docs/{doc.name}", "name": job.name, "template": job.template,
            "max_new_tokens": job.max_new_tokens, **job.params, "questions": questions}))
    path = folder / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def describe(workload: Workload, jobs: Jobs, tokenizer) -> dict:
    """What was drawn, for the results JSON: counts and token lengths (min/mean/max)."""
    question_tokens = [len(tokenizer.encode(q)) for j in jobs.jobs for _, q in j.questions]
    budgets = [j.max_new_tokens for j in jobs.jobs for _ in j.questions]

    def spread(values: list[int]) -> dict:
        return {"min": min(values), "mean": round(statistics.fmean(values), 1), "max": max(values)}

    return {"name": workload.name, "description": workload.description,
            "template": workload.template, "seed": workload.seed,
            "documents": len(jobs.documents), "jobs": len(jobs.jobs),
            "questions": len(question_tokens), "doc_tokens": spread(jobs.doc_tokens),
            "question_tokens": spread(question_tokens), "answer_budget": spread(budgets),
            "answer_budget_total": sum(budgets), "arrivals": workload.arrivals}
