"""From checked chat requests to jobs: render, group by shared prefix, split, one job per group
and generation parameters.

Each request's prompt is rendered with the model's chat template (`render.py`) and tokenized
whole. Requests are grouped by the longest prefix of rendered text they share
(`grouping.py`); each group's shared text becomes ONE document and each request's rest a
question of the built-in `raw` template, which the tokenizer neither wraps nor changes. The
split point must be a token boundary for every request of the group: the tokenization of
document + rest must equal that of the whole prompt, or the engine would see other ids than
the model's chat template gives. Candidates are tried from the longest down: the end of the
shared text, word and line starts just before it, then message starts; the first that keeps
the ids for the whole group wins (a group with none is split into single requests). A single
request (a group of one, every /v1/chat/completions call) splits where its last message begins,
so that requests with the same conversation before their last message share a document even
when they arrive one by one; else inside its last message at a line start, else before the
assistant's turn.

Requests of a group with different parameters (max_tokens, temperature, seed, stop) become
separate jobs on the same document, which a worker claims and decodes together. A request
asking for n choices is n questions in n jobs, the seed counting up per choice so that sampled
choices differ. Requests without a seed take one drawn at random for the call (as the OpenAI
API samples afresh each time), the same for all of a batch file's, so that they still share
jobs.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from ppqa.files.inputs import QuestionInput
from ppqa.openai.chat_request import DEFAULT_MAX_TOKENS, MAX_SEED, ChatRequest, RequestError
from ppqa.openai.grouping import common_prefix_length, group_by_shared_prefix
from ppqa.openai.prompt_model import PromptModel
from ppqa.openai.render import RenderedPrompt, render_prompt
from ppqa.store.jobs import IngestRequest
from ppqa.store.params import GenerationParams

RAW_TEMPLATE = "raw"
WORD_STARTS_TRIED = 8  # word/line starts tried below a group's shared end
WORD_START_WINDOW = 400  # characters searched for them


@dataclass(frozen=True)
class PlannedRequest:
    line: int  # 1-based line of the batch file (1 for a chat call)
    custom_id: str
    request: ChatRequest


@dataclass(frozen=True)
class PlannedChoice:
    line: int
    custom_id: str
    choice: int
    job: int  # index into BatchPlan.jobs
    position: int  # the question's position in that job
    prompt_tokens: int


@dataclass
class BatchPlan:
    jobs: list[IngestRequest]
    choices: list[PlannedChoice]
    group_shared_tokens: list[int]  # per group, the document's tokens
    group_sizes: list[int]
    ignored: dict[str, int] = field(default_factory=dict)  # ignored field -> requests naming it

    @property
    def request_count(self) -> int:
        return len({c.line for c in self.choices})

    def summary(self) -> str:
        """One line for the person at the terminal: groups found and their shared lengths."""
        sizes = ", ".join(f"{t} tokens x {n}" for t, n in
                          sorted(zip(self.group_shared_tokens, self.group_sizes), reverse=True)[:8])
        more = len(self.group_sizes) - 8
        text = (f"{self.request_count} requests in {len(self.group_sizes)} shared-prefix "
                f"group{'s' if len(self.group_sizes) != 1 else ''} (document tokens x "
                f"requests: {sizes}{f', and {more} more' if more > 0 else ''}) as "
                f"{len(self.jobs)} job{'s' if len(self.jobs) != 1 else ''}")
        if self.ignored:
            text += "; ignored " + ", ".join(f"{k!r} ({n} requests)"
                                             for k, n in sorted(self.ignored.items()))
        return text


def plan_requests(requests: Sequence[PlannedRequest], model: PromptModel, *, label: str,
                  priority: int = 0) -> BatchPlan:
    """Jobs for `requests` (see the module doc); RequestError naming `label:line` if one cannot
    be planned (a prompt too long for the context, a template that will not render)."""
    tok = model.tokenizer
    prompts, ids = [], []
    for r in requests:
        try:
            prompts.append(render_prompt(tok, r.request.messages))
        except RequestError as exc:
            raise RequestError(f"{label}:{r.line}: {exc}", exc.param, r.line) from None
        ids.append(_with_bos(tok, tok.encode(prompts[-1].text)))
    groups: list[tuple[list[int], int]] = []  # (member indices, split offset)
    for members in group_by_shared_prefix([p.text for p in prompts]):
        split = _group_split([prompts[i] for i in members], [ids[i] for i in members], tok)
        if split is not None:
            groups.append((members, split))
            continue
        for i in members:
            single = _group_split([prompts[i]], [ids[i]], tok)
            if single is None:
                raise RequestError(f"{label}:{requests[i].line}: cannot split this prompt into "
                                   "a document and a question on a token boundary of the "
                                   "model's tokenizer", "messages", requests[i].line)
            groups.append(([i], single))
    plan = BatchPlan(jobs=[], choices=[], group_shared_tokens=[], group_sizes=[])
    drawn_seed = secrets.randbelow(MAX_SEED)  # for the requests that give none
    for r in requests:
        for name in r.request.ignored:
            plan.ignored[name] = plan.ignored.get(name, 0) + 1
    pending: list[tuple[str, str, GenerationParams, str, list[QuestionInput]]] = []
    for number, (members, split) in enumerate(groups, start=1):
        document = prompts[members[0]].text[:split]
        plan.group_shared_tokens.append(len(_with_bos(tok, tok.encode(document))))
        plan.group_sizes.append(len(members))
        jobs_of_group: dict[GenerationParams, int] = {}
        for i in members:
            r, prompt_tokens = requests[i], len(ids[i])
            where = f"{label}:{r.line}"
            max_new = _answer_budget(r.request, prompt_tokens, model.context_tokens, where, r.line)
            for choice in range(r.request.n):
                params = GenerationParams(
                    template=RAW_TEMPLATE, max_new_tokens=max_new,
                    temperature=r.request.temperature, top_p=r.request.top_p,
                    seed=(drawn_seed if r.request.seed is None else r.request.seed) + choice,
                    model=model.name, stop=r.request.stop,
                    json_schema=r.request.json_schema)
                if params not in jobs_of_group:
                    jobs_of_group[params] = len(pending)
                    pending.append((document, f"{label} group {number}", params, where, []))
                questions = pending[jobs_of_group[params]][4]
                plan.choices.append(PlannedChoice(r.line, r.custom_id, choice,
                                                  jobs_of_group[params], len(questions),
                                                  prompt_tokens))
                questions.append(QuestionInput(r.custom_id, prompts[i].text[split:], where))
    plan.jobs = [IngestRequest(doc, name, questions, params, priority, where)
                 for doc, name, params, where, questions in pending]
    plan.choices.sort(key=lambda c: (c.line, c.choice))
    return plan


def _with_bos(tok, ids: list[int]) -> list[int]:
    """The ids the engine prefills: BOS first when the model wants it (as Tokenizer.prompt)."""
    if tok.add_bos and tok.bos_token_id is not None and ids[:1] != [tok.bos_token_id]:
        return [tok.bos_token_id, *ids]
    return ids


def _answer_budget(request: ChatRequest, prompt_tokens: int, context: int, where: str,
                   line: int) -> int:
    room = context - prompt_tokens
    if request.max_tokens is None:
        if room < 1:
            raise RequestError(f"{where}: the prompt ({prompt_tokens} tokens) fills the model's "
                               f"context of {context} tokens", "messages", line)
        return min(DEFAULT_MAX_TOKENS, room)
    if request.max_tokens > room:
        raise RequestError(f"{where}: the prompt ({prompt_tokens} tokens) + max_tokens "
                           f"({request.max_tokens}) exceed the model's context of {context} "
                           "tokens", "max_tokens", line)
    return request.max_tokens


def _group_split(prompts: list[RenderedPrompt], ids: list[list[int]], tok) -> int | None:
    """The longest valid split offset shared by the group (module doc), or None."""
    texts = [p.text for p in prompts]
    for split in _candidates(prompts):
        document = texts[0][:split]
        if not document.strip() or any(not t[split:].strip() for t in texts):
            continue
        head = _with_bos(tok, tok.encode(document))
        if all(head + tok.encode(t[split:]) == full for t, full in zip(texts, ids)):
            return split
    return None


def _candidates(prompts: list[RenderedPrompt]) -> list[int]:
    """Split offsets to try, best first (module doc)."""
    first = prompts[0]
    text = first.text
    if len(prompts) == 1:
        last, gen = first.last_message_start, first.generation_start
        if gen is None:
            return []
        # Line starts inside the last message that a line of text follows (its question).
        inside = [p for p in _near(text, gen, last or 0, "\n") if text[p:gen].strip()]
        return _unique([last, *inside, gen])
    shared = min(common_prefix_length(text, p.text) for p in prompts[1:])
    word_starts = _near(text, shared, max(0, shared - WORD_START_WINDOW), None)
    return _unique([shared, *word_starts, *(s for s in reversed(first.message_starts)
                                             if s <= shared)])


def _near(text: str, end: int, lower: int, chars: str | None) -> list[int]:
    """Up to WORD_STARTS_TRIED offsets p in (lower, end), descending, next to whitespace
    (to one of `chars` if given): where BPE pre-tokenizers cut, so likely token boundaries."""
    out = []
    for p in range(end - 1, lower, -1):
        left, right = text[p - 1], text[p]
        if (left in chars or right in chars) if chars else (left.isspace() or right.isspace()):
            out.append(p)
            if len(out) == WORD_STARTS_TRIED:
                break
    return out


def _unique(offsets) -> list[int]:
    seen, out = set(), []
    for p in offsets:
        if p is not None and p not in seen:
            seen.add(p)
            out.append(p)
    return out
