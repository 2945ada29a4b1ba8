"""A /v1/batches batch from creation to its output files, over the job store.

    create -> `validating` (row written, reply sent) -> a background thread reads the input file
    from the store, checks and plans it (`batch_in.plan_batch_file`) and queues its jobs
    (`in_progress`), or records every problem with its line (`failed`)
    -> workers answer the jobs -> `refresh` (on every read, and from the server's monitor every
    second) finalizes a batch whose jobs have all ended: `completed`, with an output file of the
    answered requests and an error file of the others (`batch_out.batch_files`)
    cancel -> its open jobs cancelled, `cancelling` -> finalized `cancelled` with what was
    answered; past `expires_at` -> open jobs cancelled, finalized `expired`.

Validation runs on one thread (tokenizing is CPU work; planning holds `plan_lock`, shared with
chat calls, as the tokenizer is not used from two threads at once). A batch left `validating`
by a server that stopped is validated again when one starts (`resume`): its jobs were written in
the same transaction as its move to `in_progress`, so this never queues them twice.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from ppqa.openai.batch_in import BatchFileError, LineError, decode_batch_file, plan_batch_file
from ppqa.openai.batch_out import batch_files
from ppqa.openai.prompt_model import PromptModel
from ppqa.store import openai_batches as store
from ppqa.store.db import Database, error_reason
from ppqa.store.errors import InputError, NotFoundError, StoreError
from ppqa.store.openai_files import file_content

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
log = logging.getLogger("ppqa.serve")


class BatchService:
    def __init__(self, db: Database, model: PromptModel, plan_lock: threading.Lock) -> None:
        self.db, self.model, self.plan_lock = db, model, plan_lock
        self._validator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppqa-validate")

    def create(self, input_file_id: str, completion_window: str,
               metadata: dict | None) -> store.BatchRow:
        """A validating batch; its file is checked in the background."""
        row = store.create_batch(self.db, model=self.model.name, input_file_id=input_file_id,
                                 completion_window=completion_window,
                                 window=COMPLETION_WINDOWS[completion_window], metadata=metadata)
        self._validator.submit(self._validate, row.public_id, input_file_id)
        return row

    def resume(self) -> None:
        for batch in store.batches_with_status(self.db, (store.VALIDATING,)):
            input_file_id = store.get_batch(self.db, batch).input_file_id
            self._validator.submit(self._validate, batch, input_file_id)

    def retrieve(self, batch: str) -> store.BatchRow:
        return self.refresh(store.get_batch(self.db, batch))

    def refresh(self, row: store.BatchRow) -> store.BatchRow:
        """Finalize `row` if it is due (see the module doc); the row as it is now."""
        if row.due:
            return store.finalize_batch(self.db, row.public_id, batch_files)
        return row

    def refresh_open(self) -> None:
        """The monitor's tick: finalize every open batch that is due."""
        for batch in store.due_batches(self.db):
            try:
                store.finalize_batch(self.db, batch, batch_files)
            except StoreError as exc:  # a store briefly unreachable: the next tick retries
                log.warning("batch %s: %s", batch, exc)

    def cancel(self, batch: str) -> store.BatchRow:
        return self.refresh(store.cancel_batch(self.db, batch))

    def close(self) -> None:
        self._validator.shutdown(wait=True, cancel_futures=True)

    def _validate(self, batch: str, input_file_id: str | None) -> None:
        try:
            info, data = file_content(self.db, input_file_id or "")
            text = decode_batch_file(data, info.filename)
            with self.plan_lock:
                plan = plan_batch_file(text, info.filename, self.model)
            store.ingest_plan(self.db, plan, model=self.model.name, batch=batch)
        except BatchFileError as exc:
            store.fail_batch(self.db, batch, [e.to_dict() for e in exc.errors])
        except NotFoundError:
            store.fail_batch(self.db, batch, [LineError(
                None, f"input file {input_file_id!r} is not in the store (deleted?)",
                "input_file_id").to_dict()])
        except InputError as exc:
            store.fail_batch(self.db, batch, [LineError(None, str(exc)).to_dict()])
        except StoreError as exc:  # cancelled while validating, or the store is unreachable
            log.warning("batch %s: not queued: %s", batch, exc)
        except Exception as exc:  # noqa: BLE001 - the batch must not stay validating forever
            log.exception("batch %s: validation failed", batch)
            store.fail_batch(self.db, batch, [LineError(
                None, f"internal error while validating: {type(exc).__name__}: "
                f"{error_reason(exc)}",
                code="server_error").to_dict()])
