"""OpenAI Batch output lines and chat.completion objects, from the store's `RequestResult`s.

One line per request, as the Batch output file is specified: `id`, `custom_id`, `response`
(`status_code` 200, `request_id`, `body`: a chat.completion with one choice per `n`, each with its
message and `finish_reason`, and `usage`) and `error` (null), or `response` null and `error`
{code, message} for a request that was not answered: its job failed (the engine's reason),
the batch was cancelled or expired first, or (`ppqa export --all` only) it is still queued.
`ppqa export --format openai-batch` writes every line to one file; a finished /v1/batches batch
splits them into its output file (answered) and its error file (the rest).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone

from ppqa.store.models import CANCELLED, FAILED
from ppqa.store.openai_batches import EXPIRED
from ppqa.store.openai_results import ChoiceResult, RequestResult


def epoch(moment: datetime | None) -> int:
    """Unix seconds of a naive-UTC store timestamp (0 for None)."""
    return 0 if moment is None else int(moment.replace(tzinfo=timezone.utc).timestamp())


def chat_completion(completion_id: str, model: str, prompt_tokens: int,
                    choices: Sequence[ChoiceResult]) -> dict:
    """A chat.completion object for answered `choices`."""
    completion_tokens = sum(c.tokens or 0 for c in choices)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": max(epoch(c.answered_at) for c in choices),
        "model": model,
        "choices": [{"index": c.choice,
                     "message": {"role": "assistant", "content": c.text, "refusal": None},
                     "logprobs": None, "finish_reason": c.finish_reason} for c in choices],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "system_fingerprint": None,
    }


def request_error(choices: Sequence[ChoiceResult], batch_status: str | None = None) -> dict:
    """Why a request has no answer, as an OpenAI error object {code, message}."""
    pending = [c for c in choices if c.text is None]
    failed = next((c for c in pending if c.job_status == FAILED), None)
    if failed is not None:
        return {"code": "job_failed", "message": failed.job_error or f"job {failed.job_id} failed"}
    if batch_status == EXPIRED:
        return {"code": "batch_expired", "message": "This request could not be executed "
                                                    "before the completion window expired."}
    if any(c.job_status == CANCELLED for c in pending):
        return {"code": "batch_cancelled",
                "message": "This request was not executed because the batch was cancelled."}
    return {"code": "not_finished",
            "message": f"job {pending[0].job_id} is {pending[0].job_status}; no answer yet"}


def output_line(result: RequestResult) -> dict:
    """The output line of one request (module doc)."""
    tag = f"{result.batch.removeprefix('batch_')}_{result.line}"
    line = {"id": f"batch_req_{tag}", "custom_id": result.custom_id, "response": None,
            "error": None}
    if result.answered:
        line["response"] = {"status_code": 200, "request_id": f"req_{tag}",
                            "body": chat_completion(f"chatcmpl-{tag}", result.model,
                                                    result.prompt_tokens, result.choices)}
    else:
        line["error"] = request_error(result.choices, result.batch_status)
    return line


def jsonl(lines: Sequence[dict]) -> bytes:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode("utf-8")


def batch_files(results: Sequence[RequestResult]) -> tuple[bytes | None, bytes | None]:
    """(output file, error file) of a finished batch; None where it would be empty."""
    lines = [output_line(r) for r in results]
    answered = [line for line in lines if line["error"] is None]
    errors = [line for line in lines if line["error"] is not None]
    return (jsonl(answered) or None), (jsonl(errors) or None)
