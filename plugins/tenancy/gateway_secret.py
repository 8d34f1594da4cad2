"""The gateway secret: one key from which kvgate derives its keyed hashes (tenants' cache salts,
the ledger's session digests), so that neither can be computed from the tenant name or the
session id alone.

Where it comes from, first match wins:

1. the environment variable ``KVGATE_SECRET`` (the param ``secret_env`` names another): at
   least 32 characters, used as UTF-8 bytes. Replicas must share it: every derived value (a
   tenant's salt, a session digest) is a function of it, and replicas deriving different salts
   for one tenant would split that tenant's prefix cache per replica;
2. with shared state (a ``redis_url``: ``kvgate serve --redis``), the Redis key
   ``kvgate:gateway-secret``: the first replica to start sets it (``SET NX``, 64 hex characters),
   every replica reads it, so replicas started from different working directories derive the
   same salts and digests with nothing else to configure. Redis then holds the secret: it is
   trusted like the API keys' hashes and budgets it already holds. Redis unreachable at
   startup is a startup error (a replica that went on with a secret of its own would split
   every tenant's cache and ledger digests from the others' for its whole life);
3. the file ``.kvgate/secret`` (param ``secret_file``, relative to the working directory like
   the ledger's and the job store's defaults): read if present; created if absent (64 hex
   characters from :func:`secrets.token_hex`, mode 0600, written to a temporary file and
   hard-linked into place, so two processes starting together agree on one and neither reads
   a half-written file). A generated secret is said in a WARNING: fine for one host, wrong for
   replicas on several.

Derivation: ``K_purpose = HMAC-SHA256(secret, "kvgate\\0" + purpose)``; each use has its own
purpose string, so a value derived for one use reveals nothing about another. Pure functions
apart from :func:`load_secret` (startup I/O); the secret itself is never logged or shown.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.middleware.framework.errors import ConfigError

log = logging.getLogger("kvgate.plugins.gateway_secret")

DEFAULT_ENV = "KVGATE_SECRET"
DEFAULT_FILE = ".kvgate/secret"
#: 32 characters: with hex (the generated form) 128 bits, the least an HMAC key should carry.
MIN_SECRET_CHARS = 32

#: The Redis key of the shared secret, and the bound on each Redis call at startup [s].
REDIS_KEY = "kvgate:gateway-secret"
REDIS_TIMEOUT_S = 5.0

#: Purposes (one derived key each).
CACHE_SALT_PURPOSE = "cache-salt v1"
SESSION_PURPOSE = "ledger-session v1"
#: Prefix of a ledger session digest (versioned with the purpose).
SESSION_DIGEST_PREFIX = "hs1:"


@dataclass(frozen=True, slots=True)
class GatewaySecret:
    """The loaded secret and where it came from (``env NAME``, ``file PATH``, ``generated
    PATH``). ``repr`` never shows the key."""

    key: bytes = field(repr=False)
    source: str

    def derive(self, purpose: str) -> bytes:
        """The 32-byte key of one purpose."""
        return hmac.new(self.key, b"kvgate\x00" + purpose.encode(), hashlib.sha256).digest()


def load_secret(env: str = DEFAULT_ENV, file: str = DEFAULT_FILE,
                environ: Mapping[str, str] | None = None,
                redis_url: str | None = None) -> GatewaySecret:
    """The secret from ``env``, else Redis (``redis_url``; set once by the first replica), else
    ``file`` (created when absent); ConfigError when it is too short, or the file or Redis
    cannot be read or written."""
    value = (os.environ if environ is None else environ).get(env)
    if value:
        return GatewaySecret(_checked(value, f"environment variable {env}"), f"env {env}")
    if redis_url is not None:
        text, created = _from_redis(redis_url)
        if created:
            log.info("generated the gateway secret in Redis (%s); every replica reads it there",
                     REDIS_KEY)
        return GatewaySecret(_checked(text, f"Redis key {REDIS_KEY}"), f"redis {REDIS_KEY}")
    path = Path(file)
    try:
        text, generated = _read_or_create(path)
    except OSError as exc:
        raise ConfigError(f"gateway secret file {path}: {exc.strerror or exc}") from None
    if generated:
        log.warning("generated a new gateway secret in %s (tenants' cache salts and ledger "
                    "session digests derive from it); replicas must share one: set %s to the "
                    "same value on every replica, or copy the file", path, env)
    source = f"{'generated' if generated else 'file'} {path}"
    return GatewaySecret(_checked(text.strip(), f"file {path}"), source)


def _from_redis(url: str) -> tuple[str, bool]:
    """The shared secret (set now if absent) and whether this call set it."""
    import redis  # optional dependency: present whenever a redis_url passed config checks
    from redis.exceptions import RedisError

    client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S,
                                  socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        created = bool(client.set(REDIS_KEY, secrets.token_hex(32), nx=True))
        value = client.get(REDIS_KEY)
    except RedisError as exc:  # the URL may hold a password: name the error only
        raise ConfigError(f"gateway secret: shared state (Redis) unreachable at startup "
                          f"({type(exc).__name__}); set the secret's environment variable on "
                          "every replica, or bring Redis up") from None
    finally:
        client.close()
    if not isinstance(value, bytes):
        raise ConfigError(f"gateway secret: Redis key {REDIS_KEY} vanished while read")
    return value.decode(), created


def _checked(value: str, where: str) -> bytes:
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(f"gateway secret from {where} is shorter than {MIN_SECRET_CHARS} "
                          "characters")
    return value.encode()


def _read_or_create(path: Path) -> tuple[str, bool]:
    """The file's text, and whether it was created now."""
    if path.exists():
        return path.read_text(encoding="utf-8"), False
    path.parent.mkdir(parents=True, exist_ok=True)
    text = secrets.token_hex(32) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.link(tmp, path)  # atomic, and fails if it exists: never a half-written secret
    except FileExistsError:  # another process (a --workers sibling) made it first: use theirs
        return path.read_text(encoding="utf-8"), False
    finally:
        tmp.unlink(missing_ok=True)
    return text, True


def session_digest(key: bytes, session_key: str) -> str:
    """The ledger's form of a session key (``["tenant","model","session id"]``, see
    plugins/load/session_affinity.py): ``hs1:`` + the first 32 hex digits (128 bits) of
    ``HMAC-SHA256(K_session, session_key)``. ``key`` is ``secret.derive(SESSION_PURPOSE)``."""
    mac = hmac.new(key, session_key.encode(), hashlib.sha256).hexdigest()
    return SESSION_DIGEST_PREFIX + mac[:32]


__all__ = [
    "CACHE_SALT_PURPOSE", "DEFAULT_ENV", "DEFAULT_FILE", "REDIS_KEY", "SESSION_PURPOSE",
    "GatewaySecret",
    "load_secret", "session_digest",
]
