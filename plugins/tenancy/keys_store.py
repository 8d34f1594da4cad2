"""Where API keys live, and the admin operations on them (pure functions over a
:class:`~kvgate.plugins.tenancy.keys_model.KeysFile`, applied by a store's ``update``).

Two stores, one protocol (:class:`KeyStore`), both holding hashes only:

* :class:`FileKeyStore` -- the keys file. ``token()`` is the file's (mtime_ns, size, inode):
  a change of any is a change (polled by the plugin about every second). ``update`` holds an
  exclusive ``flock`` on ``<file>.lock`` (the offline ``kvgate keys create --file`` takes it
  too), re-reads the file, applies the change, validates, and replaces the file atomically
  (temporary file in the same folder, fsync, rename): a reader sees the old or the new file,
  never half of one. Comments of a hand-written file are not kept by admin writes.
* :class:`RedisKeyStore` -- ``<prefix>entries`` (hash: key id -> KeyEntry JSON),
  ``<prefix>tenants`` (hash: tenant -> TenantEntry JSON), ``<prefix>version`` (an integer
  incremented by every write; replicas poll it) and ``<prefix>reload`` (incremented by
  ``POST /v1/admin/reload``: every replica re-reads its files). ``update`` is optimistic: WATCH
  the version, read, apply, then MULTI (HSET changed, HDEL removed, INCR version) / EXEC,
  retried on a concurrent write. ``seed`` writes the keys file into an empty Redis (no version
  key) in one Lua script, so concurrent first starts seed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Protocol

import yaml
from pydantic import ValidationError

from kvgate.middleware.framework.errors import BadRequest, ConfigError, HTTPError, NotFound
from kvgate.plugins.common.redis_retry import redis_errors
from kvgate.plugins.tenancy.keys_model import (
    KeyEntry,
    KeysFile,
    Limits,
    TenantEntry,
    hash_key,
    new_key,
    parse_keys,
)

#: Optimistic write attempts against concurrent admin writes before giving up (409).
MAX_WRITE_ATTEMPTS = 16


class Conflict(HTTPError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class StoreUnavailable(HTTPError):
    """The key store cannot be written (Redis down, file unwritable): nothing was changed."""

    status = 503
    type = "server_error"
    code = "keys_store_unavailable"


class KeyStore(Protocol):
    """Where keys are read from and written to."""

    kind: str

    async def token(self) -> object:
        """A cheap value that changes whenever the keys change."""
        ...

    async def read(self) -> tuple[object, KeysFile]:
        """The token and the keys (ConfigError: bad data; OSError/StoreUnavailable: down)."""
        ...

    async def update(self, change: Callable[[KeysFile], KeysFile]) -> KeysFile:
        """Apply ``change`` atomically; its HTTPError passes through, nothing is written."""
        ...


def _validated(change: Callable[[KeysFile], KeysFile], old: KeysFile) -> KeysFile:
    new = change(old)
    try:  # re-check invariants across entries (ids and hashes unique)
        return KeysFile.model_validate(new.model_dump())
    except ValidationError as exc:
        raise Conflict(f"the change breaks the keys file: {exc.errors()[0]['msg']}") from None


# -- file ----------------------------------------------------------------------------------
@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock of ``<path>.lock`` (writers of the keys file take it; readers need not:
    the file is only ever replaced whole)."""
    with open(f"{path}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_atomically(path: Path, parsed: KeysFile) -> None:
    text = yaml.safe_dump(parsed.dump(), sort_keys=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def update_file(path: Path, change: Callable[[KeysFile], KeysFile]) -> KeysFile:
    """Apply ``change`` to the keys file under its lock, atomically (a missing file is
    empty). ConfigError: the file is invalid; OSError: it cannot be written."""
    with file_lock(path):
        old = parse_keys(path.read_text(encoding="utf-8"), str(path)) if path.exists() \
            else KeysFile()
        new = _validated(change, old)
        write_atomically(path, new)
        return new


class FileKeyStore:
    kind = "file"

    def __init__(self, path: Path) -> None:
        self.path = path

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    async def token(self) -> object:
        return await asyncio.to_thread(self._stat)

    def _read(self) -> tuple[object, KeysFile]:
        before = self._stat()
        text = self.path.read_text(encoding="utf-8")
        return before, parse_keys(text, str(self.path))

    async def read(self) -> tuple[object, KeysFile]:
        return await asyncio.to_thread(self._read)

    async def update(self, change: Callable[[KeysFile], KeysFile]) -> KeysFile:
        try:
            return await asyncio.to_thread(update_file, self.path, change)
        except OSError as exc:
            raise StoreUnavailable(f"cannot write the keys file: {exc.strerror}") from None
        except ConfigError as exc:
            raise StoreUnavailable(f"the keys file is invalid, fix it first: {exc}") from None


# -- redis ---------------------------------------------------------------------------------
def store_errors() -> tuple[type[BaseException], ...]:
    """What an unreachable store raises (Redis is an optional dependency)."""
    if find_spec("redis") is None:
        return (OSError, TimeoutError)
    return redis_errors()


def connect_redis(url: str, timeout_s: float) -> Any:
    """A Redis client whose every call is bounded by ``timeout_s``; a connection error is
    retried once at once (a pooled connection gone stale across a Redis restart), a timeout
    is not (the watch loop tries again at its next poll)."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    return Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                          retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError])


_SEED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 1, #ARGV, 3 do
  if ARGV[i] == 'k' then redis.call('HSET', KEYS[2], ARGV[i+1], ARGV[i+2])
  else redis.call('HSET', KEYS[3], ARGV[i+1], ARGV[i+2]) end
end
redis.call('SET', KEYS[1], 1)
return 1
"""


def _entries_json(parsed: KeysFile) -> tuple[dict[str, str], dict[str, str]]:
    keys = {k.id: k.model_dump_json(exclude_defaults=True) for k in parsed.keys}
    tenants = {t: e.model_dump_json(exclude_defaults=True) for t, e in parsed.tenants.items()}
    return keys, tenants


def _decode(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else str(k)):
            (v.decode() if isinstance(v, bytes) else str(v)) for k, v in raw.items()}


def parse_redis(keys: Mapping[str, str], tenants: Mapping[str, str]) -> KeysFile:
    try:
        return KeysFile.model_validate({
            "keys": [json.loads(v) for _, v in sorted(keys.items())],
            "tenants": {t: json.loads(v) for t, v in tenants.items()}})
    except (ValueError, ValidationError) as exc:
        raise ConfigError(f"invalid keys in Redis: {exc}") from None


class RedisKeyStore:
    """See the module docstring. ``client`` is a ``redis.asyncio.Redis``; every call is bounded
    by the client's socket timeout."""

    kind = "redis"

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.version_key = prefix + "version"
        self.reload_key = prefix + "reload"
        self.keys_key = prefix + "entries"
        self.tenants_key = prefix + "tenants"

    async def tokens(self) -> tuple[int, int]:
        """(keys version, reload counter) in one round trip."""
        raw = await self.client.mget([self.version_key, self.reload_key])
        return (int(raw[0] or 0), int(raw[1] or 0))

    async def token(self) -> object:
        return (await self.tokens())[0]

    async def seed(self, parsed: KeysFile) -> bool:
        """Write ``parsed`` if Redis holds no keys yet (True: this call seeded)."""
        keys, tenants = _entries_json(parsed)
        args = [x for i, v in keys.items() for x in ("k", i, v)]
        args += [x for t, v in tenants.items() for x in ("t", t, v)]
        done = await self.client.eval(_SEED, 3, self.version_key, self.keys_key,
                                      self.tenants_key, *args)
        return bool(done)

    async def read(self) -> tuple[object, KeysFile]:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.get(self.version_key).hgetall(self.keys_key).hgetall(self.tenants_key)
            version, keys, tenants = await pipe.execute()
        return int(version or 0), parse_redis(_decode(keys), _decode(tenants))

    async def bump_reload(self) -> int:
        return int(await self.client.incr(self.reload_key))

    async def update(self, change: Callable[[KeysFile], KeysFile]) -> KeysFile:
        from redis.exceptions import WatchError
        for _ in range(MAX_WRITE_ATTEMPTS):
            async with self.client.pipeline(transaction=True) as pipe:
                await pipe.watch(self.version_key, self.keys_key, self.tenants_key)
                keys = _decode(await pipe.hgetall(self.keys_key))
                tenants = _decode(await pipe.hgetall(self.tenants_key))
                new = _validated(change, parse_redis(keys, tenants))
                new_keys, new_tenants = _entries_json(new)
                pipe.multi()
                for name, old, now in ((self.keys_key, keys, new_keys),
                                       (self.tenants_key, tenants, new_tenants)):
                    changed = {k: v for k, v in now.items() if old.get(k) != v}
                    if changed:
                        pipe.hset(name, mapping=changed)
                    gone = [k for k in old if k not in now]
                    if gone:
                        pipe.hdel(name, *gone)
                pipe.incr(self.version_key)
                try:
                    await pipe.execute()
                except WatchError:
                    continue
                return new
        raise Conflict("the keys changed concurrently too often; retry")


# -- operations ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NewKey:
    """What ``create`` and ``rotate`` return: the entry and its secret (shown once)."""

    entry: KeyEntry
    secret: str


def find(parsed: KeysFile, key_id: str) -> KeyEntry:
    for entry in parsed.keys:
        if entry.id == key_id:
            return entry
    raise NotFound(f"no API key with id {key_id!r}", param="key_id")


def _replace(parsed: KeysFile, entry: KeyEntry) -> KeysFile:
    keys = tuple(entry if k.id == entry.id else k for k in parsed.keys)
    return parsed.model_copy(update={"keys": keys})


def next_id(parsed: KeysFile, tenant: str) -> str:
    taken = {k.id for k in parsed.keys}
    n = len(parsed.keys) + 1
    while f"{tenant}-{n}" in taken:
        n += 1
    return f"{tenant}-{n}"


def create_key(parsed: KeysFile, fields: Mapping[str, Any], now: dt.datetime,
               out: list[NewKey]) -> KeysFile:
    """Add a key (``fields``: id, tenant, models, admin, budget_usd, limits); the new key is
    appended to ``out`` (an update may run this more than once: only the last counts)."""
    key_id = fields.get("id") or next_id(parsed, fields["tenant"])
    if any(k.id == key_id for k in parsed.keys):
        raise Conflict(f"an API key with id {key_id!r} exists (ids are never reused)",
                       param="id")
    secret = new_key()
    try:
        entry = KeyEntry.model_validate({**fields, "id": key_id, "sha256": hash_key(secret),
                                         "created_at": now})
    except ValidationError as exc:
        raise BadRequest(f"invalid key: {exc.errors()[0]['msg']}") from None
    out.append(NewKey(entry, secret))
    return parsed.model_copy(update={"keys": (*parsed.keys, entry)})


def revoke_key(parsed: KeysFile, key_id: str, now: dt.datetime) -> KeysFile:
    """Mark revoked (idempotent); a rotated-out secret in its grace period goes too."""
    entry = find(parsed, key_id)
    if entry.revoked_at is not None:
        return parsed
    return _replace(parsed, entry.model_copy(update={
        "revoked_at": now, "previous_sha256": None, "previous_valid_until": None}))


def rotate_key(parsed: KeysFile, key_id: str, grace_s: float, now: dt.datetime,
               out: list[NewKey]) -> KeysFile:
    """A new secret for the same key id; the old one works ``grace_s`` more seconds (0: none)."""
    entry = find(parsed, key_id)
    if entry.revoked_at is not None:
        raise Conflict(f"API key {key_id!r} is revoked", param="key_id")
    secret = new_key()
    grace = {"previous_sha256": entry.sha256,
             "previous_valid_until": now + dt.timedelta(seconds=grace_s)} if grace_s > 0 else {
        "previous_sha256": None, "previous_valid_until": None}
    new = entry.model_copy(update={"sha256": hash_key(secret), **grace})
    out.append(NewKey(new, secret))
    return _replace(parsed, new)


def patch_key(parsed: KeysFile, key_id: str, changes: Mapping[str, Any]) -> KeysFile:
    """Set ``models``, ``admin``, ``budget_usd``, ``limits`` (given fields only; null clears)."""
    entry = find(parsed, key_id)
    try:
        new = KeyEntry.model_validate({**entry.model_dump(), **changes})
    except ValidationError as exc:
        raise BadRequest(f"invalid change: {exc.errors()[0]['msg']}") from None
    return _replace(parsed, new)


def set_tenant(parsed: KeysFile, tenant: str, budget_usd: Decimal | None,
               limits: Limits) -> KeysFile:
    tenants = dict(parsed.tenants)
    tenants[tenant] = TenantEntry(budget_usd=budget_usd, limits=limits)
    return parsed.model_copy(update={"tenants": tenants})
