"""Every plugin's counters and hook timings reach /metrics (middleware/observe/metrics.py), and the
Grafana dashboard (docs/grafana/kvgate.json) only queries metrics a gateway exports."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import AsyncIterator
from importlib.metadata import entry_points
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.engines.ports import free_port
from kvgate.engines.sim.demo import cache_aware_config, sim_config
from kvgate.engines.sim.testing import serve_sim
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.plugin import Plugin
from kvgate.middleware.observe.metrics import PluginCounters, counter_holders
from tests.integration.billing_helpers import billing_config, write_keys
from tests.plugin_helpers import make_plugin

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvgate.json"
#: Attribute names plugins keep their counters under (the house convention).
HOLDER_NAMES = {"stats", "counts", "counters"}


def _holds_counters(plugin: object) -> set[str]:
    """Public attributes that look like counter holders by name or by class name, found
    independently of kvgate.middleware.observe.metrics' structural test."""
    return {name for name, value in vars(plugin).items()
            if name in HOLDER_NAMES or type(value).__name__.endswith(("Stats", "Counts"))}


def _constructible() -> list[Plugin]:
    """Every registered plugin type that builds with its default params and no lookups."""
    built = []
    for ep in entry_points(group="kvgate.plugins"):
        cls = ep.load()
        try:
            built.append(make_plugin(cls))
        except Exception:  # noqa: BLE001 - needs params or other plugins: covered below
            continue
    return built


def test_every_registered_plugin_holding_counters_exports_them() -> None:
    plugins = _constructible()
    assert len(plugins) >= 10
    holding = 0
    for plugin in plugins:
        expected = _holds_counters(plugin)
        holding += bool(expected)
        exported = counter_holders(plugin)
        assert expected <= set(exported), (type(plugin).__name__, expected, set(exported))
        family = next(iter(PluginCounters({"p": plugin}).collect()))
        holders = {s.labels["holder"] for s in family.samples}
        assert set(exported) == holders
        for holder in expected:  # each field of each holder, with its value
            value = getattr(plugin, holder)
            if dataclasses.is_dataclass(value):
                fields = {f.name for f in dataclasses.fields(value)}
                names = {s.labels["counter"].split(".")[0] for s in family.samples
                         if s.labels["holder"] == holder}
                assert names <= fields and names, (holder, names)
    assert holding >= 4  # tokenizer, cache-salt, pd-admission, session affinity, ...


def _scrape(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        out.setdefault(family.name, [])  # declared, maybe with no sample yet
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


@contextlib.asynccontextmanager
async def _cache_aware(tmp: Path, hook_timing_every: int = 1,
                       ) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient]]:
    """The cache-aware preset over two simulators, plus api-keys, billing and quotas."""
    events = f"tcp://127.0.0.1:{free_port()}"
    keys = write_keys(tmp)
    async with contextlib.AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(serve_sim(sim_config(i, events, 0.0)))
                for i in range(2)]
        base = cache_aware_config([s.url for s in sims], events).model_dump(mode="json")
        extra = billing_config([s.url for s in sims], tmp, keys)["plugins"][:3]
        base["plugins"] = [*extra, *base["plugins"]]
        base.pop("source", None)
        base.setdefault("server", {})["hook_timing_every"] = hook_timing_every
        app = create_app(parse_config(base, "test"))
        await stack.enter_async_context(app.running())
        client = await stack.enter_async_context(httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30,
            headers=keys.auth("user")))
        yield app, client


async def test_metrics_have_plugin_counters_hook_timings_and_the_dashboards_names(
        tmp_path: Path) -> None:
    async with _cache_aware(tmp_path) as (app, client):
        body = {"model": "sim-model", "max_tokens": 3,
                "messages": [{"role": "user", "content": "metrics " * 80}]}
        for _ in range(2):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        scraped = _scrape(app.metrics_page().decode())
        counters = {(labels["plugin"], labels["holder"], labels["counter"]): value
                    for labels, value in scraped["kvgate_plugin_counter"]}
        assert counters[("tokenizer", "stats", "requests")] == 2
        assert counters[("tokenizer", "stats", "tokenized")] == 2
        for name, plugin in app.pipeline.plugins.items():
            for holder in _holds_counters(plugin):
                assert any(k[:2] == (name, holder) for k in counters), (name, holder)
        hooks = {(labels["plugin"], labels["hook"]): value
                 for labels, value in scraped["kvgate_plugin_hook_duration_seconds_count"]}
        assert hooks[("tokenizer", "prepare")] == 2
        assert hooks[("api-keys", "on_request")] == 2
        assert hooks[("billing", "on_usage")] == 2
        assert hooks[("max-score-picker", "pick")] == 2
        assert any(hook == "score" for _, hook in hooks)
        exported = {re.sub(r"_(bucket|count|sum|total|created)$", "", n) for n in scraped}
    dashboard = json.loads(DASHBOARD.read_text())
    assert all(v == 2 for v in hooks.values()), hooks  # every call timed (every = 1)
    queried = {m for panel in dashboard["panels"] for target in panel["targets"]
               for m in re.findall(r"kvgate_[a-z0-9_]+", target["expr"])}
    assert len(queried) >= 12
    missing = {m for m in queried
               if re.sub(r"_(bucket|count|sum|total)$", "", m) not in exported}
    assert not missing, missing


@pytest.mark.parametrize(("every", "requests", "timed"), [
    (8, 9, 2),  # the default: the 1st and the 9th request
    (3, 6, 2),
    (0, 3, 0),  # never: no series
])
async def test_hook_timings_are_sampled_one_request_in_n(
        tmp_path: Path, every: int, requests: int, timed: int) -> None:
    async with _cache_aware(tmp_path, every) as (app, client):
        body = {"model": "sim-model", "max_tokens": 3,
                "messages": [{"role": "user", "content": "sampled " * 40}]}
        for _ in range(requests):  # one at a time: each request's hooks run while it is the
            # latest to start
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        scraped = _scrape(app.metrics_page().decode())
    hooks = {(labels["plugin"], labels["hook"]): value
             for labels, value in scraped.get("kvgate_plugin_hook_duration_seconds_count", [])}
    if timed == 0:
        assert not hooks
        return
    assert hooks[("tokenizer", "prepare")] == timed
    assert hooks[("billing", "on_usage")] == timed
    assert hooks[("max-score-picker", "pick")] == timed
    assert set(hooks.values()) == {timed}
