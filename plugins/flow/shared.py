"""Fairness accounting shared between gateway replicas (``flow-control`` with ``redis_url``;
``kvgate serve --redis`` sets it).

Each replica publishes the tokens it served per tenant (cumulative, real usage) every
``share_interval_s`` and adds the growth of the other replicas' figures to its own virtual
token counters, through the same exchange the token-load scorer uses (plugins/load/shared_load.py:
one string per replica with a TTL, a registry sorted set, ``MGET``; no Redis I/O on the
request path). So a tenant flooding through replica 1 is behind a light tenant on replica 2
too: N replicas order their queues as one would.

The saturation view needs no Redis: each replica learns its share of each engine's batch from
the engine's own running / waiting counts (plugins/flow/saturation.py). The reserve and the
fair shares are per replica (each holds its share of the fleet's slots).

Redis down: the exchange drops the remote view (WARNING once per outage, /health says
``degraded``, ``kvgate_flow_shared_down`` is 1) and each replica orders by its own counters;
requests never wait for Redis.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.plugins.flow.fairness import Fairness
from kvgate.plugins.flow.params import FlowParams
from kvgate.plugins.load.shared_load import CounterShare, LoadExchange, connect


def exchange(params: FlowParams, fair: Fairness) -> LoadExchange | None:
    """The exchange for ``params.redis_url`` (None without one); started by the plugin."""
    if params.redis_url is None:
        return None

    def local() -> Mapping[str, float]:
        return dict(fair.own)

    def remote(deltas: Mapping[str, float]) -> None:
        fair.remote(dict(deltas))

    return LoadExchange(
        connect(params.redis_url.get_secret_value(), params.redis_timeout_s), dict,
        prefix=params.redis_prefix, interval_s=params.share_interval_s,
        ttl_s=params.share_ttl_s, timeout_s=params.redis_timeout_s, max_replicas=64,
        counters=CounterShare(local, remote))


__all__ = ["exchange"]
