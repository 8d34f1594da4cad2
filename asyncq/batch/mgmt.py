"""The management plane: a FastAPI sub-application serving OpenAI's Files and Batch APIs
(``/v1/files*``, ``/v1/batches*``), the queued-request endpoints (``/v1/queue/requests/{id}``,
asyncq/queued.py) and their OpenAPI schema at ``/openapi.json``.

The ``async-queue`` plugin mounts the app :func:`build_management_app` returns through the
core's ``AsgiMount`` extension point; the inference hot path never goes through FastAPI.
Its background work (batch finalisation, webhook delivery) is the :class:`ManagementPlane` in
``app.state.plane``: started and stopped by the plugin's lifecycle (or by the app's own
lifespan when served standalone), its counters exported through :meth:`ManagementPlane.collector`
and its state through :meth:`ManagementPlane.health`.

Every request is authenticated first (``QueueService.authenticate``: the gateway's own
authenticator; 401 in OpenAI's shape) and its body size checked before anything is read
(413); every error -- ours, FastAPI's validation errors (422 becomes 400, as OpenAI answers),
Starlette's 404/405 -- is rendered in OpenAI's shape ``{"error": {message, type, param,
code}}``. Files and batches are scoped to the caller's tenant: another tenant's id is a 404.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from kvgate.asyncq.api import QueueService
from kvgate.asyncq.batch.batches import BatchManager
from kvgate.asyncq.batch.files import FileDeleted, FileList, FileObject, FileStore
from kvgate.asyncq.batch.mgmt_db import Db
from kvgate.asyncq.batch.objects import BatchCreate, BatchList, BatchObject
from kvgate.asyncq.queued import queued_router
from kvgate.asyncq.webhooks import Webhooks, WebhookSettings
from kvgate.middleware.framework.types import Principal
from kvgate.middleware.transport.fastapi_errors import (
    PRINCIPAL,
    Guard,
    install_openai_errors,
    openapi_errors,
)

log = logging.getLogger("kvgate.asyncq.mgmt")

#: Multipart framing allowed on top of the file itself (boundaries, the purpose field).
MULTIPART_SLACK = 1 << 20


class ManagementSettings(BaseModel):
    """``management:`` of the ``async-queue`` plugin (docs/config.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Uploaded and output files, and ``mgmt.sqlite`` (file metadata, batches, webhook outbox).
    #: Replicas share batches by sharing this directory (one volume); see docs/async.md.
    data_dir: str = ".kvgate/async"
    #: OpenAI's limits for a batch input file: 200 MB and 50,000 requests.
    max_file_bytes: int = Field(200 * 1000 * 1000, ge=1)
    max_file_lines: int = Field(50_000, ge=1)
    #: Every unfinished batch is checked this often (a restarted or other replica finishes
    #: batches it did not run); finishing requests trigger a check at once as well.
    finalize_interval_s: float = Field(5.0, gt=0)
    #: How long a validation or finalisation may hold a batch before another process takes
    #: it over (it died): well above the time to validate 50,000 lines.
    lease_s: float = Field(120.0, gt=0)
    webhooks: WebhookSettings = Field(default_factory=WebhookSettings)


_ERRORS = openapi_errors(400, 401, 404, 409, 413, 503)


class ManagementPlane:
    """Files, batches and webhooks over one database; the app's background work."""

    def __init__(self, service: QueueService, settings: ManagementSettings) -> None:
        root = Path(settings.data_dir)
        self.service = service
        self.settings = settings
        self.db = Db(root / "mgmt.sqlite")
        self.files = FileStore(self.db, root / "files")
        self.webhooks = Webhooks(self.db, settings.webhooks)
        self.batches = BatchManager(
            service, self.db, self.files, self.webhooks, root / "batches",
            max_lines=settings.max_file_lines, lease_s=settings.lease_s,
            finalize_interval_s=settings.finalize_interval_s)
        self.files_uploaded = 0
        self.bytes_uploaded = 0
        self._listening = False

    async def start(self) -> None:
        if not self._listening:
            self.service.add_listener(self.batches)
            self.service.add_listener(self.webhooks)
            self._listening = True
        await self.batches.start()
        await self.webhooks.start()

    async def stop(self) -> None:
        await self.batches.stop()
        await self.webhooks.stop()
        self.db.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ManagementPlane]:
        await self.start()
        try:
            yield self
        finally:
            await self.stop()

    def health(self) -> Mapping[str, object]:
        """No I/O: degraded since when (batch bookkeeping, webhook outbox)."""
        b, w = self.batches.counters, self.webhooks.counters
        out: dict[str, object] = {"webhooks_pending": w.pending}
        if b.degraded_since is not None:
            out["batches_degraded_since"] = b.degraded_since
        if w.degraded_since is not None:
            out["webhooks_degraded_since"] = w.degraded_since
        return out

    def collector(self) -> Collector:
        return _PlaneCollector(self)


class _PlaneCollector(Collector):
    def __init__(self, plane: ManagementPlane) -> None:
        self._p = plane

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        b, w = self._p.batches.counters, self._p.webhooks.counters
        yield CounterMetricFamily("kvgate_batches_created", "Batches created",
                                  value=b.created)
        done = CounterMetricFamily("kvgate_batches_finished", "Batches finished by this "
                                   "replica, by final status", labels=["status"])
        for status, n in sorted(b.finished.items()):
            done.add_metric([status], n)
        yield done
        yield CounterMetricFamily("kvgate_batch_invalid_lines", "Batch input lines refused "
                                  "by validation (sent to the error file)",
                                  value=b.invalid_lines)
        yield CounterMetricFamily("kvgate_batch_bookkeeping_errors", "Failed batch sweeps "
                                  "(store or queue unavailable)", value=b.sweep_errors)
        yield CounterMetricFamily("kvgate_files_uploaded", "Files uploaded",
                                  value=self._p.files_uploaded)
        yield CounterMetricFamily("kvgate_files_uploaded_bytes", "Bytes uploaded",
                                  value=self._p.bytes_uploaded)
        hooks = CounterMetricFamily("kvgate_webhook_events", "Webhook events by outcome "
                                    "(enqueued; delivered; failed: given up after "
                                    "max_attempts; attempt_failed: one non-2xx attempt)",
                                    labels=["outcome"])
        for outcome, n in (("enqueued", w.enqueued), ("delivered", w.delivered),
                           ("failed", w.failed), ("attempt_failed", w.attempts_failed)):
            hooks.add_metric([outcome], n)
        yield hooks
        yield GaugeMetricFamily("kvgate_webhook_pending", "Webhook events waiting in the "
                                "outbox (as of the last delivery poll)", value=w.pending)
        yield GaugeMetricFamily("kvgate_async_mgmt_degraded", "1 while batch bookkeeping or "
                                "webhook delivery cannot reach its store",
                                value=int(b.degraded_since is not None
                                          or w.degraded_since is not None))


def _tenant_of(request: Request) -> tuple[str, str | None]:
    principal: Principal | None = request.scope.get(PRINCIPAL)
    if principal is None:
        return "", None
    return principal.tenant, principal.key_id


Caller = Annotated[tuple[str, str | None], Depends(_tenant_of)]


# -- routes ---------------------------------------------------------------------------------
def files_router(plane: ManagementPlane) -> APIRouter:
    r = APIRouter(tags=["files"], responses=_ERRORS)
    s = plane.settings

    @r.post("/v1/files", response_model=FileObject)
    async def create_file(caller: Caller, file: Annotated[UploadFile, File()],
                          purpose: Annotated[str, Form()]) -> FileObject:
        rec = await plane.files.upload(caller[0], file.filename or "upload.jsonl", purpose,
                                       file.file, s.max_file_bytes, s.max_file_lines)
        plane.files_uploaded += 1
        plane.bytes_uploaded += rec.bytes
        return rec.to_object()

    @r.get("/v1/files", response_model=FileList)
    async def list_files(caller: Caller, purpose: str | None = None,
                         limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                         after: str | None = None,
                         order: Literal["asc", "desc"] = "desc") -> FileList:
        return await plane.files.page(caller[0], purpose, limit, after, order)

    @r.get("/v1/files/{file_id}", response_model=FileObject)
    async def retrieve_file(caller: Caller, file_id: str) -> FileObject:
        return (await plane.files.get(caller[0], file_id)).to_object()

    @r.get("/v1/files/{file_id}/content", response_class=FileResponse,
           responses={200: {"content": {"application/octet-stream": {}}}})
    async def file_content(caller: Caller, file_id: str) -> FileResponse:
        rec = await plane.files.get(caller[0], file_id)
        return FileResponse(plane.files.path(rec.id), media_type="application/octet-stream",
                            filename=rec.filename)

    @r.delete("/v1/files/{file_id}", response_model=FileDeleted)
    async def delete_file(caller: Caller, file_id: str) -> FileDeleted:
        return await plane.files.delete(caller[0], file_id)

    return r


def batches_router(plane: ManagementPlane) -> APIRouter:
    r = APIRouter(tags=["batches"], responses=_ERRORS)

    @r.post("/v1/batches", response_model=BatchObject)
    async def create_batch(caller: Caller, body: BatchCreate) -> BatchObject:
        return await plane.batches.create(caller[0], caller[1], body)

    @r.get("/v1/batches", response_model=BatchList)
    async def list_batches(caller: Caller, after: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20) -> BatchList:
        return await plane.batches.page(caller[0], limit, after)

    @r.get("/v1/batches/{batch_id}", response_model=BatchObject)
    async def retrieve_batch(caller: Caller, batch_id: str) -> BatchObject:
        return await plane.batches.get(caller[0], batch_id)

    @r.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject)
    async def cancel_batch(caller: Caller, batch_id: str) -> BatchObject:
        return await plane.batches.cancel(caller[0], batch_id)

    return r


def build_management_app(service: QueueService, settings: ManagementSettings) -> FastAPI:
    """The management sub-application over ``service``; its plane is ``app.state.plane``."""
    plane = ManagementPlane(service, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with plane.running():
            yield

    app = FastAPI(title="kvgate management plane", version="1", lifespan=lifespan,
                  docs_url=None, redoc_url=None,
                  description="OpenAI Files and Batch APIs and queued requests (docs/async.md)")
    app.state.plane = plane
    app.state.started_at = time.time()
    install_openai_errors(app, "management plane", log)
    app.include_router(files_router(plane))
    app.include_router(batches_router(plane))
    app.include_router(queued_router(service), responses=_ERRORS)
    app.add_middleware(Guard, authenticate=service.authenticate,
                       max_body=settings.max_file_bytes + MULTIPART_SLACK,
                       open_path="/openapi.json")
    return app


def plane_of(app: FastAPI) -> ManagementPlane:
    plane = app.state.plane
    assert isinstance(plane, ManagementPlane)
    return plane
