"""Webhooks: batch and queued-request state changes POSTed to per-tenant endpoints, signed the
way OpenAI signs its webhooks (the Standard Webhooks scheme), from a durable outbox.

Events (OpenAI's names for batches): ``batch.completed``, ``batch.failed``, ``batch.expired``,
``batch.cancelled``; for queued requests and background responses ``request.queued``,
``request.running``, ``request.succeeded``, ``request.failed``, ``request.expired``,
``request.cancelled``. The body is OpenAI's event object
``{"id": "evt_...", "object": "event", "created_at": unix_s, "type": ..., "data": {"id": ...}}``.

Signing: ``webhook-id`` (the event id), ``webhook-timestamp`` (unix seconds) and
``webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``, keyed with the
base64-decoded part of the tenant's ``whsec_...`` secret; the ``openai`` SDK's
``client.webhooks.unwrap`` / ``verify_signature`` (and any Standard Webhooks library) verify it.

Durability: an event is a row of the ``outbox`` table (asyncq/batch/mgmt_db.py), written in the
same transaction as the state change it reports for batches, and before the listener returns
for requests. A delivery loop claims due rows (``next_at`` moved forward by the request
timeout first, so two processes never send one row at once), POSTs them, and deletes them on a
2xx. Otherwise it retries after ``min(backoff_max_s, backoff_base_s * 2**attempts)`` times a
uniform jitter in [0.5, 1] (so a fleet of gateways does not retry in lock step), until
``max_attempts`` (default 10: about 17 minutes of retries with the defaults) -- then the row is
kept as ``failed`` (at most ``max_failed_kept``, the oldest evicted) for inspection. Rows
survive restarts; delivery is at least once (a crash between the 2xx and the delete sends the
event again with the same ``webhook-id``: receivers dedupe on it, as the scheme intends).
Secrets are never stored in the outbox nor logged: they are looked up in the settings at
delivery.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
import random
import secrets
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from kvgate.asyncq.api import Job, JobState
from kvgate.asyncq.batch.mgmt_db import Db
from kvgate.asyncq.tasks import cancel

log = logging.getLogger("kvgate.asyncq.webhooks")

BATCH_EVENTS = frozenset({"batch.completed", "batch.failed", "batch.expired",
                          "batch.cancelled"})
REQUEST_EVENTS = frozenset(f"request.{s.value}" for s in JobState)
EVENTS = BATCH_EVENTS | REQUEST_EVENTS
#: Job kinds whose state changes are request events (batch requests are reported per batch).
REQUEST_KINDS = frozenset({"queued", "background"})
#: The ``endpoints`` key used for a tenant without its own entry (and without authentication).
ANY_TENANT = "*"


class WebhookEndpoint(BaseModel):
    """Where one tenant's events go."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    #: ``whsec_<base64>``, as OpenAI and Standard Webhooks issue them.
    secret: SecretStr
    #: Event types sent; None: all of them.
    events: frozenset[str] | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("url must be http:// or https://")
        return v

    @field_validator("secret")
    @classmethod
    def _secret(cls, v: SecretStr) -> SecretStr:
        secret_key(v.get_secret_value())
        return v

    @field_validator("events")
    @classmethod
    def _events(cls, v: frozenset[str] | None) -> frozenset[str] | None:
        if v is not None and not v <= EVENTS:
            raise ValueError(f"unknown events {sorted(v - EVENTS)}; known: {sorted(EVENTS)}")
        return v


class WebhookSettings(BaseModel):
    """``management.webhooks`` (docs/config.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: tenant -> endpoint; ``"*"`` for any tenant without its own (and when auth is off).
    endpoints: dict[str, WebhookEndpoint] = Field(default_factory=dict)
    max_attempts: int = Field(10, ge=1, le=100)
    backoff_base_s: float = Field(1.0, gt=0)
    backoff_max_s: float = Field(300.0, gt=0)
    timeout_s: float = Field(10.0, gt=0)
    poll_interval_s: float = Field(0.5, gt=0)
    #: Rows kept after their last failed attempt (oldest evicted first).
    max_failed_kept: int = Field(10_000, ge=0)


def secret_key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_`` secret (ValueError if it is not one)."""
    if not secret.startswith("whsec_"):
        raise ValueError("the secret must start with whsec_")
    try:
        key = base64.b64decode(secret[len("whsec_"):], validate=True)
    except binascii.Error as exc:
        raise ValueError("the secret after whsec_ must be base64") from exc
    if len(key) < 16:
        raise ValueError("the secret must hold at least 16 bytes")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value (Standard Webhooks ``v1``)."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def event_body(event_id: str, event_type: str, data: Mapping[str, object],
               created_at: int) -> bytes:
    return orjson.dumps({"id": event_id, "object": "event", "created_at": created_at,
                         "type": event_type, "data": dict(data)})


@dataclass
class WebhookCounters:
    delivered: int = 0
    failed: int = 0  # events given up after max_attempts
    attempts_failed: int = 0  # single attempts that did not get a 2xx
    enqueued: int = 0
    pending: int = 0  # outbox rows waiting, as of the last poll
    degraded_since: float | None = None  # the outbox database could not be read


class Webhooks:
    """The outbox, its delivery loop and the request-event listener."""

    def __init__(self, db: Db, settings: WebhookSettings, seed: int | None = None) -> None:
        self.db = db
        self.settings = settings
        self.counters = WebhookCounters()
        self._rng = random.Random(seed)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def endpoint(self, tenant: str) -> WebhookEndpoint | None:
        eps = self.settings.endpoints
        return eps.get(tenant) or eps.get(ANY_TENANT)

    def stage(self, conn: sqlite3.Connection, tenant: str, event_type: str,
              data: Mapping[str, object]) -> bool:
        """Insert an event row inside the caller's transaction (False: nobody listens)."""
        ep = self.endpoint(tenant)
        if ep is None or (ep.events is not None and event_type not in ep.events):
            return False
        event_id = "evt_" + secrets.token_hex(16)
        now = time.time()
        body = event_body(event_id, event_type, data, int(now))
        conn.execute("INSERT INTO outbox (id, tenant, type, body, created_at, attempts, "
                     "next_at, state) VALUES (?,?,?,?,?,0,?,'pending')",
                     (event_id, tenant, event_type, body, now, now))
        self.counters.enqueued += 1
        self._wake.set()
        return True

    async def emit(self, tenant: str, event_type: str, data: Mapping[str, object]) -> None:
        if self.endpoint(tenant) is not None:
            await self.db.run(lambda c: self.stage(c, tenant, event_type, data))

    async def on_job(self, job: Job) -> None:
        """JobListener: request events for queued requests and background responses."""
        if job.spec.kind in REQUEST_KINDS:
            await self.emit(job.spec.tenant or "", f"request.{job.state.value}",
                            {"id": job.spec.id})

    # -- delivery --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s))
            self._task = asyncio.create_task(self._loop(), name="kvgate-webhooks")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel(task)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self) -> None:
        while True:
            try:
                sent = await self.deliver_due()
            except sqlite3.Error as exc:
                if self.counters.degraded_since is None:
                    self.counters.degraded_since = time.time()
                    log.warning("webhook outbox unreadable (%s): delivery paused", exc)
                sent = 0
            else:
                if self.counters.degraded_since is not None:
                    log.warning("webhook outbox readable again: delivery resumed")
                self.counters.degraded_since = None
            if sent == 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.settings.poll_interval_s)

    def _claim(self, conn: sqlite3.Connection, now: float,
               limit: int) -> list[tuple[str, str, bytes, int]]:
        rows = conn.execute(
            "SELECT id, tenant, body, attempts FROM outbox WHERE state = 'pending' AND "
            "next_at <= ? ORDER BY next_at LIMIT ?", (now, limit)).fetchall()
        hold = now + self.settings.timeout_s + 5
        for row in rows:
            conn.execute("UPDATE outbox SET next_at = ? WHERE id = ?", (hold, row[0]))
        self.counters.pending = conn.execute(
            "SELECT COUNT(*) FROM outbox WHERE state = 'pending'").fetchone()[0]
        return [(str(r[0]), str(r[1]), bytes(r[2]), int(r[3])) for r in rows]

    async def deliver_due(self, limit: int = 32) -> int:
        """Send every due event (at most ``limit``); how many were attempted."""
        rows = await self.db.run(lambda c: self._claim(c, time.time(), limit))
        if rows:
            await asyncio.gather(*(self._deliver(*row) for row in rows))
        return len(rows)

    async def _post(self, ep: WebhookEndpoint, event_id: str, body: bytes) -> str | None:
        """None on a 2xx, else what went wrong (never the secret)."""
        assert self._session is not None
        ts = int(time.time())
        headers = {"content-type": "application/json", "webhook-id": event_id,
                   "webhook-timestamp": str(ts),
                   "webhook-signature": sign(ep.secret.get_secret_value(), event_id, ts, body)}
        try:
            async with self._session.post(ep.url, data=body, headers=headers) as resp:
                await resp.read()
                return None if 200 <= resp.status < 300 else f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"

    async def _deliver(self, event_id: str, tenant: str, body: bytes, attempts: int) -> None:
        ep = self.endpoint(tenant)
        error = "no endpoint configured any more" if ep is None else \
            await self._post(ep, event_id, body)
        if error is None:
            self.counters.delivered += 1
            await self.db.run(lambda c: c.execute("DELETE FROM outbox WHERE id = ?",
                                                  (event_id,)))
            return
        self.counters.attempts_failed += 1
        attempts += 1
        s = self.settings
        if attempts >= s.max_attempts or ep is None:
            self.counters.failed += 1
            log.warning("webhook %s to tenant %r failed for good after %d attempts: %s",
                        event_id, tenant, attempts, error)
            await self.db.run(lambda c: self._fail(c, event_id, attempts, error))
            return
        delay = min(s.backoff_max_s, s.backoff_base_s * 2 ** (attempts - 1))
        delay *= 0.5 + 0.5 * self._rng.random()
        log.info("webhook %s attempt %d failed (%s); retry in %.1fs", event_id, attempts,
                 error, delay)
        await self.db.run(lambda c: c.execute(
            "UPDATE outbox SET attempts = ?, next_at = ?, last_error = ? WHERE id = ?",
            (attempts, time.time() + delay, error, event_id)))

    def _fail(self, conn: sqlite3.Connection, event_id: str, attempts: int,
              error: str) -> None:
        conn.execute("UPDATE outbox SET state = 'failed', attempts = ?, last_error = ? "
                     "WHERE id = ?", (attempts, error, event_id))
        conn.execute("DELETE FROM outbox WHERE id IN (SELECT id FROM outbox WHERE "
                     "state = 'failed' ORDER BY created_at DESC LIMIT -1 OFFSET ?)",
                     (self.settings.max_failed_kept,))
