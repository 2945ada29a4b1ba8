"""A claimed job's questions as engine requests (`worker/loop.Worker._start` submits them).

    engine_requests: one `QuestionRequest` per missing answer (a question's missing samples,
        each seeded as the engine seeds it), or one per question with choices and several
        samples, keyed (job id, (question id, sample)).
    job_sampling: the job's stored generation parameters as `SamplingParams`.
"""

from __future__ import annotations

from dataclasses import replace

from ppqa.config import sample_seed
from ppqa.store.queue import ClaimedJob

# The sample of a request that answers every sample of its question (a question with choices).
ALL_SAMPLES = -1


def engine_requests(claim: ClaimedJob, sampling) -> list:
    """The engine requests of a claimed job's missing answers. Each missing sample is a
    question of its own, seeded as the engine seeds sample s of a question
    (config.sample_seed), so a resumed job draws what it would have; but a question with
    choices and several samples is one request for all of them, scored once and its samples
    drawn from that scoring (those stored already are drawn again, the same, and dropped)."""
    from ppqa.engine.outputs import QuestionRequest

    common = {"document": claim.document_text, "template": claim.params.template,
              "template_source": claim.template_source,
              "choice_norm": claim.params.choice_norm}
    out = []
    for q in claim.questions:
        if q.choices is not None and claim.params.samples > 1:
            out.append(QuestionRequest(key=(claim.job_id, (q.id, ALL_SAMPLES)), question=q.text,
                                       sampling=sampling, choices=q.choices,
                                       samples=claim.params.samples, **common))
            continue
        out.extend(QuestionRequest(key=(claim.job_id, (q.id, s)), question=q.text,
                                   sampling=replace(sampling, seed=sample_seed(sampling.seed, s)),
                                   choices=q.choices, **common)
                   for s in q.samples)
    return out


def job_sampling(claim: ClaimedJob):
    """A job's sampling parameters; raises if they cannot make any (a seed or budget out of
    range, in a job queued before ingest checked them): that job then fails alone."""
    from ppqa.config import SamplingParams

    p = claim.params
    return SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                          top_p=p.top_p, seed=p.seed, stop=p.stop, json_schema=p.json_schema)
