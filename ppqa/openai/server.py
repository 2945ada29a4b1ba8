"""`ppqa serve`'s HTTP app (FastAPI): the OpenAI Files, Batches, Models and Chat API over the
job store.

    /v1/files            upload (multipart, size-limited), list, retrieve, content, delete:
                         bytes live in the store (`store.openai_files`), never at a path
    /v1/batches          create, retrieve, list, cancel (`batches.BatchService`)
    /v1/chat/completions a call waits for its answer (`chat.ChatService`)
    /v1/models           the one model this server renders prompts for

Every error is an OpenAI error body ({"error": {message, type, param, code}}) with its status:
400 bad request, 401 wrong or missing key (`--api-key`), 404 unknown id or route, 413 too
large, 500/504 when answering failed or timed out, 503 for a chat call still waiting when the
server begins to shut down (`ServerConfig.closing`). Route functions that touch the store are
plain `def`s (FastAPI runs them on its thread pool); the chat call is async, waiting on the
shared poll loop. A `--worker` runs `ppqa.worker.loop.Worker` on a thread of this process, from
startup to shutdown; a monitor finalizes due batches every `monitor_seconds`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.exceptions import HTTPException as StarletteHTTPException

from ppqa.openai import objects
from ppqa.openai.batches import COMPLETION_WINDOWS, BatchService
from ppqa.openai.chat import ChatFailed, ChatService, ServerClosing
from ppqa.openai.chat_request import RequestError
from ppqa.openai.prompt_model import PromptModel
from ppqa.store import openai_batches, openai_files
from ppqa.store.db import Database
from ppqa.store.errors import InputError, NotFoundError, StoreError

FILE_PURPOSES = ("batch", "user_data", "assistants", "fine-tune", "vision", "evals")
MAX_METADATA_KEYS = 16
log = logging.getLogger("ppqa.serve")


@dataclass
class ServerConfig:
    db: Database
    model: PromptModel
    api_key: str | None = None
    max_file_bytes: int = 200 * 2**20  # uploads, and JSON bodies
    worker: Any = None  # a ppqa.worker.loop.Worker to run on a thread, or None
    poll_seconds: float = 0.1
    request_timeout: float = 600.0
    monitor_seconds: float = 1.0
    # Set when the server begins to shut down (`ppqa serve` sets it at SIGINT/SIGTERM): chat
    # calls still waiting answer 503 at once rather than holding the shutdown until they time
    # out.
    closing: threading.Event = field(default_factory=threading.Event)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, objects.error_body(message, kind=kind, param=param,
                                                             code=code)


def create_app(config: ServerConfig) -> FastAPI:
    db, plan_lock = config.db, threading.Lock()
    batches = BatchService(db, config.model, plan_lock)
    chat = ChatService(db, config.model, plan_lock, poll_seconds=config.poll_seconds,
                       timeout=config.request_timeout, closing=config.closing)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        thread = None
        if config.worker is not None:
            thread = threading.Thread(target=_run_worker, args=(config.worker,),
                                      name="ppqa-worker", daemon=True)
            thread.start()
        batches.resume()
        monitor = asyncio.create_task(_monitor(batches, config.monitor_seconds))
        try:
            yield
        finally:
            monitor.cancel()
            if thread is not None:
                config.worker.request_stop("server shutdown")
                await asyncio.to_thread(thread.join, 120)
            batches.close()

    app = FastAPI(title="ppqa", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    _error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_key_check(config.api_key))])

    @v1.get("/models")
    def list_models() -> dict:
        return {"object": "list", "data": [objects.model_object(config.model.name, started)]}

    @v1.get("/models/{model_id:path}")
    def retrieve_model(model_id: str) -> dict:
        if model_id != config.model.name:
            raise APIError(404, f"The model {model_id!r} does not exist (this server runs "
                                f"{config.model.name!r})", param="model", code="model_not_found")
        return objects.model_object(model_id, started)

    @v1.post("/files")
    async def upload_file(request: Request) -> dict:
        form = await _upload_form(request, config.max_file_bytes + 65536)
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise APIError(400, "a multipart field 'file' is required", param="file")
            if purpose not in FILE_PURPOSES:
                raise APIError(400, f"purpose must be one of {', '.join(FILE_PURPOSES)}, got "
                                    f"{purpose!r}", param="purpose")
            data = await upload.read(config.max_file_bytes + 1)
        finally:
            await form.close()
        if len(data) > config.max_file_bytes:
            raise APIError(413, f"the file is larger than {config.max_file_bytes} bytes",
                           param="file")
        if not data:
            raise APIError(400, "the file is empty", param="file")
        info = await asyncio.to_thread(openai_files.create_file, db,
                                       _label(upload.filename), purpose, data)
        return objects.file_object(info)

    @v1.get("/files")
    def list_files(purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000),
                   after: str | None = None, order: str = Query("desc", pattern="^(asc|desc)$")
                   ) -> dict:
        files, more = openai_files.list_files(db, purpose=purpose, limit=limit, after=after,
                                              newest_first=order == "desc")
        return objects.page([objects.file_object(f) for f in files], more)

    @v1.get("/files/{file_id}")
    def retrieve_file(file_id: str) -> dict:
        return objects.file_object(openai_files.get_file(db, file_id))

    @v1.get("/files/{file_id}/content")
    def file_content(file_id: str) -> Response:
        _, data = openai_files.file_content(db, file_id)
        return Response(data, media_type="application/octet-stream")

    @v1.delete("/files/{file_id}")
    def delete_file(file_id: str) -> dict:
        openai_files.delete_file(db, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @v1.post("/batches")
    async def create_batch(request: Request) -> dict:
        body = await _json_body(request, config.max_file_bytes)
        input_file_id, window, metadata = _batch_fields(body)
        info = await asyncio.to_thread(openai_files.get_file, db, input_file_id)
        if info.purpose != "batch":
            raise APIError(400, f"file {input_file_id} has purpose {info.purpose!r}; a batch "
                                "needs a file uploaded with purpose 'batch'", param="input_file_id")
        row = await asyncio.to_thread(batches.create, input_file_id, window, metadata)
        return objects.batch_object(row)

    @v1.get("/batches")
    def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict:
        rows, more = openai_batches.list_batches(db, limit=limit, after=after)
        return objects.page([objects.batch_object(batches.refresh(r)) for r in rows], more)

    @v1.get("/batches/{batch_id}")
    def retrieve_batch(batch_id: str) -> dict:
        return objects.batch_object(batches.retrieve(batch_id))

    @v1.post("/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict:
        return objects.batch_object(batches.cancel(batch_id))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> dict:
        body = await _json_body(request, config.max_file_bytes)
        try:
            completion = await chat.complete(body, request.is_disconnected)
        except ChatFailed as exc:
            raise APIError(500, f"the request was not answered: {exc}", kind="server_error")
        except ServerClosing as exc:
            raise APIError(503, str(exc), kind="server_error", code="shutting_down")
        if completion is None:
            raise APIError(504, f"no answer within {config.request_timeout:g} s; is a worker "
                                f"running model {config.model.name!r}? (ppqa run --follow, or "
                                "ppqa serve --worker)", kind="server_error", code="timeout")
        return completion

    app.include_router(v1)
    return app


def _run_worker(worker) -> None:
    try:
        worker.run()
    except Exception:  # noqa: BLE001 - the server keeps serving; calls then time out
        log.exception("the server's worker stopped")


async def _monitor(batches: BatchService, seconds: float) -> None:
    while True:
        await asyncio.sleep(seconds)
        try:
            await asyncio.to_thread(batches.refresh_open)
        except Exception:  # noqa: BLE001 - keep monitoring
            log.exception("batch monitor")


def _key_check(api_key: str | None):
    def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer "
                                "KEY', the key given to ppqa serve --api-key)",
                           code="invalid_api_key")
    return check


def _error_handlers(app: FastAPI) -> None:
    def reply(status: int, body: dict) -> JSONResponse:
        return JSONResponse(body, status_code=status)

    app.add_exception_handler(APIError, lambda _r, e: reply(e.status, e.body))
    app.add_exception_handler(NotFoundError, lambda _r, e: reply(
        404, objects.error_body(str(e), code="not_found")))
    app.add_exception_handler(RequestError, lambda _r, e: reply(
        400, objects.error_body(str(e), param=e.param)))
    app.add_exception_handler(InputError, lambda _r, e: reply(400, objects.error_body(str(e))))
    app.add_exception_handler(StoreError, lambda _r, e: reply(400, objects.error_body(str(e))))
    app.add_exception_handler(RequestValidationError, lambda _r, e: reply(
        400, objects.error_body("; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                          for err in e.errors()))))
    app.add_exception_handler(StarletteHTTPException, lambda _r, e: reply(
        e.status_code, objects.error_body(str(e.detail))))

    async def internal(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error", exc_info=exc)
        return reply(500, objects.error_body(f"internal error: {type(exc).__name__}",
                                             kind="server_error"))

    app.add_exception_handler(Exception, internal)


def _check_length(request: Request, limit: int) -> None:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request is larger than {limit} bytes")


async def _upload_form(request: Request, limit: int) -> FormData:
    """An upload's multipart form, its body counted as it arrives: past `limit` bytes it is a
    413 at once, chunked uploads included (they carry no Content-Length to refuse them by;
    Starlette's `request.form()` would read the whole body to a temporary file first)."""
    _check_length(request, limit)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, "an upload is a multipart/form-data body with the fields 'file' and "
                            "'purpose'")

    async def counted():
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request is larger than {limit} bytes")
            yield chunk

    try:
        return await MultiPartParser(request.headers, counted(), max_files=1, max_fields=8).parse()
    except MultiPartException as exc:
        raise APIError(400, f"the multipart body is malformed: {exc.message}") from None


async def _json_body(request: Request, limit: int) -> Any:
    _check_length(request, limit)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise APIError(413, f"the request is larger than {limit} bytes")
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None


def _batch_fields(body: Any) -> tuple[str, str, dict | None]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                                  "output_expires_after"})
    if unknown:
        raise APIError(400, f"unsupported field {unknown[0]!r}", param=unknown[0])
    if body.get("endpoint") != openai_batches.CHAT_ENDPOINT:
        raise APIError(400, f"endpoint must be {openai_batches.CHAT_ENDPOINT!r} (the only one "
                            f"ppqa serves), got {body.get('endpoint')!r}", param="endpoint")
    window = body.get("completion_window")
    if window not in COMPLETION_WINDOWS:
        raise APIError(400, f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}, "
                            f"got {window!r}", param="completion_window")
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise APIError(400, "input_file_id must be a file id", param="input_file_id")
    metadata = body.get("metadata")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_KEYS
            and all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                    for k, v in metadata.items())):
        raise APIError(400, f"metadata must map up to {MAX_METADATA_KEYS} keys (64 characters) "
                            "to strings (512 characters)", param="metadata")
    return input_file_id, window, metadata


def _label(filename: str | None) -> str:
    """A display name for an upload: its last path part, printable, at most 255 characters.
    Only ever shown (in errors and listings); nothing is read or written at it."""
    name = (filename or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if ch.isprintable())[:255]
    return name or "upload.jsonl"
