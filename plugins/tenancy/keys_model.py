"""The API keys data model: the keys file's schema (:class:`KeysFile`), the authenticated key
(:class:`ApiKey`) and the immutable lookup table built from a keys file (:class:`KeyIndex`).

A key is ``kvg-`` + 32 random bytes (URL-safe base64); only its SHA-256 is stored. With that
entropy an unsalted SHA-256 cannot be brute-forced, and lookup by hash needs no per-key work.

Lifecycle fields (written by the admin API, plugins/tenancy/keys_admin.py; optional in a
hand-written file): ``created_at``; ``revoked_at`` (a revoked key stays listed, is refused, and its
id is not reused, so the ledger's key ids stay unambiguous); ``previous_sha256`` +
``previous_valid_until`` (after a rotation with a grace period the old secret keeps working
until then, as the same key id).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvgate.middleware.framework.errors import ConfigError, Unauthorized

KEY_PREFIX = "kvg-"
_ID = r"^[A-Za-z0-9._:-]+$"
_SHA = r"^[0-9a-f]{64}$"


class Limits(BaseModel):
    """Quotas of one key or one tenant; ``None``: no limit on that dimension. Enforced by a
    quota plugin (docs/operations.md); tokens per minute are charged with the real usage."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    requests_per_min: int | None = Field(None, ge=1)
    input_tokens_per_min: int | None = Field(None, ge=1)
    output_tokens_per_min: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)


NO_LIMITS = Limits()

#: Flow-control priority bands a key may use (plugins/flow/, docs/flow-control.md), highest
#: first.
Band = Literal["interactive", "standard", "batch"]


class TenantEntry(BaseModel):
    """A tenant's budget and quotas, shared by all its keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    budget_usd: Decimal | None = Field(None, ge=0)
    limits: Limits = NO_LIMITS


class KeyEntry(BaseModel):
    """One API key as stored in the keys file (or one Redis hash field)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(min_length=1, max_length=128, pattern=_ID)
    tenant: str = Field(min_length=1, max_length=128, pattern=_ID)
    sha256: str = Field(pattern=_SHA)
    models: frozenset[str] | None = None
    admin: bool = False
    budget_usd: Decimal | None = Field(None, ge=0)
    limits: Limits = NO_LIMITS
    #: Flow control: the key's default band, and the highest band its requests may ask for
    #: (``x-kvgate-priority``); None: the flow-control plugin's defaults.
    priority: Band | None = None
    max_priority: Band | None = None
    created_at: dt.datetime | None = None
    revoked_at: dt.datetime | None = None
    previous_sha256: str | None = Field(None, pattern=_SHA)
    previous_valid_until: dt.datetime | None = None

    @model_validator(mode="after")
    def _grace(self) -> KeyEntry:
        if (self.previous_sha256 is None) != (self.previous_valid_until is None):
            raise ValueError("previous_sha256 and previous_valid_until go together")
        return self


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    keys: tuple[KeyEntry, ...] = ()
    tenants: dict[str, TenantEntry] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique(self) -> KeysFile:
        ids = [k.id for k in self.keys]
        hashes = [h for k in self.keys for h in (k.sha256, k.previous_sha256) if h is not None]
        if len(set(ids)) != len(ids) or len(set(hashes)) != len(hashes):
            raise ValueError("key ids and hashes must be unique")
        return self

    def dump(self) -> dict[str, Any]:
        """The YAML document (defaults left out, so hand-written files stay short)."""
        data: dict[str, Any] = self.model_dump(mode="json", exclude_defaults=True)
        for key in data.get("keys", []):
            if isinstance(key.get("models"), list):
                key["models"] = sorted(key["models"])
        return data


@dataclass(frozen=True, slots=True)
class ApiKey:
    """The authenticated caller (a middleware Principal)."""

    key_id: str
    tenant: str
    models: frozenset[str] | None
    admin: bool
    budget_usd: Decimal | None
    limits: Limits = NO_LIMITS
    #: The tenant's own budget and quotas (``tenants:`` in the keys file), shared by its keys.
    tenant_budget_usd: Decimal | None = None
    tenant_limits: Limits = NO_LIMITS
    #: Flow-control default band and highest band (None: the plugin's defaults).
    priority: str | None = None
    max_priority: str | None = None


@dataclass(frozen=True, slots=True)
class KeyIndex:
    """An immutable lookup table (swapped whole on reload): sha256 -> (key, valid until as a
    POSIX time or None) for live keys and rotated-out secrets in their grace period, and
    key id -> key for live keys. Bounded by the keys file."""

    by_hash: Mapping[str, tuple[ApiKey, float | None]]
    by_id: Mapping[str, ApiKey]
    source: KeysFile

    def lookup(self, digest: str, now: float) -> ApiKey | None:
        found = self.by_hash.get(digest)
        if found is None or (found[1] is not None and now >= found[1]):
            return None
        return found[0]


def principal(entry: KeyEntry, tenants: Mapping[str, TenantEntry]) -> ApiKey:
    tenant = tenants.get(entry.tenant)
    return ApiKey(entry.id, entry.tenant, entry.models, entry.admin, entry.budget_usd,
                  entry.limits, None if tenant is None else tenant.budget_usd,
                  NO_LIMITS if tenant is None else tenant.limits, entry.priority,
                  entry.max_priority)


def build_index(parsed: KeysFile) -> KeyIndex:
    by_hash: dict[str, tuple[ApiKey, float | None]] = {}
    by_id: dict[str, ApiKey] = {}
    for entry in parsed.keys:
        if entry.revoked_at is not None:
            continue
        key = principal(entry, parsed.tenants)
        by_id[entry.id] = key
        by_hash[entry.sha256] = (key, None)
        if entry.previous_sha256 is not None and entry.previous_valid_until is not None:
            by_hash[entry.previous_sha256] = (key, entry.previous_valid_until.timestamp())
    return KeyIndex(by_hash, by_id, parsed)


#: Why an empty keys file is refused rather than read as "no keys": an editor or a script that
#: truncates the file and then writes it leaves it empty for a moment, and a reload landing in
#: that moment would lock every caller out, admins included.
EMPTY_KEYS_FILE = ("the keys file is empty (a file being written?): write a keys file whole "
                   "(write a new file, then rename it over the old one); no keys is `keys: []`")


def parse_keys(text: str, source: str) -> KeysFile:
    """A keys document (ConfigError naming ``source`` on any problem, an empty one included:
    see :data:`EMPTY_KEYS_FILE`)."""
    try:
        document = yaml.safe_load(text)
        if document is None:  # nothing but blanks and comments
            raise ConfigError(f"{source}: {EMPTY_KEYS_FILE}")
        return KeysFile.model_validate(document)
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"{source}: invalid keys file: {exc}") from None


def read_keys_file(path: Path) -> KeysFile:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read keys file: {exc.strerror}") from None
    return parse_keys(text, str(path))


def load_keys(path: Path) -> dict[str, ApiKey]:
    """sha256 -> key of the live keys of a keys file (ConfigError naming the file)."""
    return {h: k for h, (k, until) in build_index(read_keys_file(path)).by_hash.items()
            if until is None}


def bearer(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer`` value (None if absent; 401 if malformed)."""
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("Authorization header must be 'Bearer <API key>'")
    return token.strip()


def credential(authorization: str | None, api_key: str | None) -> str | None:
    """The API key from an ``Authorization: Bearer`` value and/or an ``x-api-key`` value (None
    if neither; 401 if malformed, or if both are present and differ)."""
    token = bearer(authorization)
    if api_key is None:
        return token
    key = api_key.strip()
    if not key:
        raise Unauthorized("x-api-key header is empty")
    if token is not None and token != key:
        raise Unauthorized("conflicting credentials: the Authorization and x-api-key headers "
                           "carry different API keys; send one")
    return key


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
