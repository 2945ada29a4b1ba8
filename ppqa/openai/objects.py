"""The JSON objects of the OpenAI API that `ppqa serve` returns: file, batch, list page, model,
and the error body. Shapes as the OpenAI API reference gives them (the official client parses
them); times are Unix seconds.
"""

from __future__ import annotations

from ppqa.openai.batch_out import epoch
from ppqa.store.openai_batches import BatchRow
from ppqa.store.openai_files import FileInfo


def _time(moment) -> int | None:
    return None if moment is None else epoch(moment)


def file_object(info: FileInfo) -> dict:
    return {"id": info.public_id, "object": "file", "bytes": info.bytes,
            "created_at": epoch(info.created_at), "filename": info.filename,
            "purpose": info.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def batch_object(row: BatchRow) -> dict:
    total, completed, failed = row.counts
    return {
        "id": row.public_id, "object": "batch", "endpoint": row.endpoint,
        "errors": {"object": "list", "data": row.errors} if row.errors else None,
        "input_file_id": row.input_file_id, "completion_window": row.completion_window,
        "status": row.status, "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id, "created_at": epoch(row.created_at),
        **{f"{event}_at": _time(getattr(row, f"{event}_at")) for event in (
            "in_progress", "expires", "finalizing", "completed", "failed", "expired",
            "cancelling", "cancelled")},
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "metadata": row.user_metadata,
        "model": row.model,
    }


def page(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def model_object(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "ppqa"}


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
