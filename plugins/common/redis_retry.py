"""The retry policy of kvgate's Redis clients (quotas, session table, shared load, shared record).

One immediate retry, on a *connection* error only. After Redis restarts, the clients' pools
still hold connections to the old server; the first command on each fails at once with
"connection closed", although Redis is back. Without a retry that one stale connection marks
the store down again right after the outage ended: a second WARNING, and 503s for budgeted keys
until the next probe (seen in tests/integration/test_replicas_quotas.py under load). The retry
runs on a fresh connection: against a Redis that is really down it fails just as fast (the
connect is refused), and a Redis that does not answer is not retried (a timeout is not a
connection error), so each caller's own breaker keeps deciding when to try again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.asyncio.retry import Retry


def stale_connection_retry() -> Retry:
    """A fresh ``Retry``: once, without backoff, on ``redis.exceptions.ConnectionError``."""
    from redis.asyncio.retry import Retry  # optional dependency, only with redis_url
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def redis_errors() -> tuple[type[BaseException], ...]:
    """What a failing Redis call raises, for the callers' breakers: redis-py's own errors,
    socket errors and timeouts, and ``RuntimeError``, which redis-py raises through uvloop when
    Redis dies while a connection is being set up ("unable to perform operation on
    <TCPTransport closed=True>": seen while Redis was SIGKILLed under load, where it became a
    500 instead of the quota store's designed fail-closed 503)."""
    from redis.exceptions import RedisError  # optional dependency, only with redis_url

    return (RedisError, OSError, TimeoutError, RuntimeError)
