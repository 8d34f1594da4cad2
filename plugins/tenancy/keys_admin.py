"""The key administration API: a FastAPI sub-application the ``api-keys`` plugin mounts at
``/v1/admin`` through the core's ``AsgiMount`` extension point (the inference hot path never
goes through FastAPI). OpenAPI schema at ``/v1/admin/openapi.json``.

Every request but the schema is authenticated first by an ASGI guard (no key or an unknown
one: 401; a key without ``admin: true``: 403) and its body bounded (64 KiB: 413). Errors --
ours, FastAPI's validation errors (answered 400, as OpenAI does), Starlette's 404/405 -- are
in OpenAI's shape ``{"error": {message, type, param, code}}``. Admin keys manage every tenant.

=========================================  ================================================
``POST   /v1/admin/keys``                  create; the answer carries the secret ``key``,
                                           the only time it is ever shown
``GET    /v1/admin/keys[?tenant=]``        list (never secrets or hashes)
``GET    /v1/admin/keys/{id}``             one key
``PATCH  /v1/admin/keys/{id}``             set models, admin, budget_usd, limits (fields
                                           sent are set; null clears)
``POST   /v1/admin/keys/{id}/revoke``      refused from now on (idempotent); stays listed
``POST   /v1/admin/keys/{id}/rotate``      new secret, same id; the old secret works
                                           ``grace_s`` more seconds (default 0: none)
``GET    /v1/admin/tenants``               tenants' budgets and limits
``PUT    /v1/admin/tenants/{tenant}``      set a tenant's budget_usd and limits
``POST   /v1/admin/reload``                re-read keys, catalog, prices (every replica)
=========================================  ================================================
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, FastAPI, Query
from pydantic import BaseModel, ConfigDict, Field

from kvgate.middleware.framework.errors import (
    BadRequest,
)
from kvgate.middleware.transport.fastapi_errors import Guard, install_openai_errors, openapi_errors
from kvgate.plugins.tenancy.keys_model import ApiKey, KeyEntry, KeysFile, Limits, utcnow
from kvgate.plugins.tenancy.keys_store import (
    NewKey,
    create_key,
    find,
    patch_key,
    revoke_key,
    rotate_key,
    set_tenant,
)

log = logging.getLogger("kvgate.plugins.keys_admin")
PREFIX = "/v1/admin"
MAX_BODY = 64 * 1024
_ID = r"^[A-Za-z0-9._:-]+$"


class AdminBackend(Protocol):
    """What the admin API needs from the api-keys plugin."""

    def admin_principal(self, headers: Mapping[str, str]) -> ApiKey: ...

    def check_entry(self, entry: KeyEntry) -> None: ...

    async def read_keys(self) -> KeysFile: ...

    async def write_keys(self, op: str, change: Callable[[KeysFile], KeysFile]) -> KeysFile: ...

    async def reload_everything(self) -> dict[str, object]: ...


# -- models ----------------------------------------------------------------------------------
class KeyObject(BaseModel):
    """An API key as the admin API shows it: never its secret or hash."""

    object: Literal["admin.api_key"] = "admin.api_key"
    id: str
    tenant: str
    status: Literal["active", "revoked"]
    models: list[str] | None
    admin: bool
    budget_usd: Decimal | None
    limits: Limits
    created_at: int | None
    revoked_at: int | None
    #: After a rotation with a grace period: the old secret works until then (unix s).
    previous_valid_until: int | None


class KeyWithSecret(KeyObject):
    #: The secret: shown in this answer only, stored nowhere (only its SHA-256 is).
    key: str


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyObject]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str = Field(min_length=1, max_length=128, pattern=_ID)
    #: Default ``<tenant>-<n>``; ids are never reused (a revoked key keeps its id).
    id: str | None = Field(None, min_length=1, max_length=128, pattern=_ID)
    models: list[str] | None = None
    admin: bool = False
    budget_usd: Decimal | None = Field(None, ge=0)
    limits: Limits = Limits()


class KeyUpdate(BaseModel):
    """Fields sent are set (null clears ``models`` / ``budget_usd``); others are kept."""

    model_config = ConfigDict(extra="forbid")
    models: list[str] | None = None
    admin: bool | None = None
    budget_usd: Decimal | None = Field(None, ge=0)
    limits: Limits | None = None


class RotateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: Seconds the old secret keeps working (0: revoked at once); at most 30 days.
    grace_s: float = Field(0.0, ge=0, le=30 * 86400)


class TenantObject(BaseModel):
    object: Literal["admin.tenant"] = "admin.tenant"
    id: str
    budget_usd: Decimal | None
    limits: Limits


class TenantList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantObject]


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    budget_usd: Decimal | None = Field(None, ge=0)
    limits: Limits = Limits()


class ReloadResult(BaseModel):
    object: Literal["admin.reload"] = "admin.reload"
    #: Source -> whether its reload succeeded here (a failed one kept its last good version).
    reloaded: dict[str, bool]
    #: With Redis: the other replicas were told to reload too.
    replicas_notified: bool


def _ts(value: dt.datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def key_object(e: KeyEntry) -> dict[str, Any]:
    return {"id": e.id, "tenant": e.tenant, "models": None if e.models is None else sorted(
        e.models), "admin": e.admin, "budget_usd": e.budget_usd, "limits": e.limits,
        "status": "revoked" if e.revoked_at else "active", "created_at": _ts(e.created_at),
        "revoked_at": _ts(e.revoked_at), "previous_valid_until": _ts(e.previous_valid_until)}


def _with_secret(made: list[NewKey]) -> KeyWithSecret:
    return KeyWithSecret(**key_object(made[-1].entry), key=made[-1].secret)


# -- routes ---------------------------------------------------------------------------------
_ERRORS = openapi_errors(400, 401, 403, 404, 409, 413, 503)
KeyId = Annotated[str, Field(min_length=1, max_length=128, pattern=_ID)]


def keys_router(b: AdminBackend) -> APIRouter:
    r = APIRouter(prefix=PREFIX, tags=["keys"], responses=_ERRORS)

    def checked(change: Callable[[KeysFile], KeysFile], key_id: str) -> Callable[[KeysFile],
                                                                                   KeysFile]:
        def run(parsed: KeysFile) -> KeysFile:
            new = change(parsed)
            b.check_entry(find(new, key_id))
            return new
        return run

    @r.post("/keys", response_model=KeyWithSecret)
    async def create(body: KeyCreate) -> KeyWithSecret:
        made: list[NewKey] = []
        fields = body.model_dump(exclude_none=True)

        def change(parsed: KeysFile) -> KeysFile:
            new = create_key(parsed, fields, utcnow(), made)
            b.check_entry(made[-1].entry)
            return new
        await b.write_keys("create", change)
        return _with_secret(made)

    @r.get("/keys", response_model=KeyList)
    async def list_keys(tenant: Annotated[str | None, Query(max_length=128)] = None) -> KeyList:
        parsed = await b.read_keys()
        return KeyList(data=[KeyObject(**key_object(k)) for k in parsed.keys
                             if tenant is None or k.tenant == tenant])

    @r.get("/keys/{key_id}", response_model=KeyObject)
    async def get_key(key_id: KeyId) -> KeyObject:
        return KeyObject(**key_object(find(await b.read_keys(), key_id)))

    @r.patch("/keys/{key_id}", response_model=KeyObject)
    async def update(key_id: KeyId, body: KeyUpdate) -> KeyObject:
        changes = {k: getattr(body, k) for k in body.model_fields_set}
        if changes.get("admin", False) is None or ("limits" in changes
                                                   and changes["limits"] is None):
            raise BadRequest("admin and limits cannot be null", param="limits")
        new = await b.write_keys("update", checked(
            lambda p: patch_key(p, key_id, changes), key_id))
        return KeyObject(**key_object(find(new, key_id)))

    @r.post("/keys/{key_id}/revoke", response_model=KeyObject)
    async def revoke(key_id: KeyId) -> KeyObject:
        new = await b.write_keys("revoke", lambda p: revoke_key(p, key_id, utcnow()))
        return KeyObject(**key_object(find(new, key_id)))

    @r.post("/keys/{key_id}/rotate", response_model=KeyWithSecret)
    async def rotate(key_id: KeyId, body: RotateRequest | None = None) -> KeyWithSecret:
        made: list[NewKey] = []
        grace = 0.0 if body is None else body.grace_s
        await b.write_keys("rotate", lambda p: rotate_key(p, key_id, grace, utcnow(), made))
        return _with_secret(made)

    return r


def tenants_router(b: AdminBackend) -> APIRouter:
    r = APIRouter(prefix=PREFIX, tags=["tenants"], responses=_ERRORS)

    @r.get("/tenants", response_model=TenantList)
    async def list_tenants() -> TenantList:
        parsed = await b.read_keys()
        names = sorted({k.tenant for k in parsed.keys} | set(parsed.tenants))
        out = []
        for name in names:
            t = parsed.tenants.get(name)
            out.append(TenantObject(id=name, budget_usd=None if t is None else t.budget_usd,
                                    limits=Limits() if t is None else t.limits))
        return TenantList(data=out)

    @r.put("/tenants/{tenant}", response_model=TenantObject)
    async def put_tenant(tenant: KeyId, body: TenantUpdate) -> TenantObject:
        await b.write_keys("tenant", lambda p: set_tenant(p, tenant, body.budget_usd,
                                                          body.limits))
        return TenantObject(id=tenant, budget_usd=body.budget_usd, limits=body.limits)

    @r.post("/reload", response_model=ReloadResult)
    async def reload() -> ReloadResult:
        out = await b.reload_everything()
        notified = bool(out.pop("replicas_notified", False))
        return ReloadResult(reloaded={k: bool(v) for k, v in out.items()},
                            replicas_notified=notified)

    return r


def build_admin_app(backend: AdminBackend) -> FastAPI:
    app = FastAPI(title="kvgate key administration", version="1", docs_url=None,
                  redoc_url=None, openapi_url=PREFIX + "/openapi.json",
                  description="API keys, tenants' budgets and limits, reloads "
                  "(docs/operations.md, Key administration)")
    install_openai_errors(app, "admin API", log)
    app.include_router(keys_router(backend))
    app.include_router(tenants_router(backend))
    # admin keys only (admin_principal: 401 / 403), bounded bodies
    app.add_middleware(Guard, authenticate=backend.admin_principal, max_body=MAX_BODY,
                       open_path=PREFIX + "/openapi.json")
    return app
