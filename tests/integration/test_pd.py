"""Prefill/decode disaggregation end to end on simulated engines: each connector protocol, the
usage rewrite (JSON and SSE, both decode conventions), engine errors in either hop, fallback.
The simulators check vLLM 0.32's Mooncake fields as vLLM does (engines/sim/core/pd.py): a request
pairs with its prefill only when they are right (drift and failures: test_pd_mooncake.py).

Engines are in-process simulators on loopback ports (time_scale 0); the gateway runs in-process
behind httpx.ASGITransport.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from kvgate.engines.sim.core.config import PdSimConfig, SimConfig
from kvgate.engines.sim.core.faults import FaultSpec
from kvgate.engines.sim.core.pd import PdStats
from kvgate.engines.sim.http.app import sim_handles
from kvgate.engines.sim.testing import RunningSim, serve_sim
from kvgate.middleware.app import KvgateApp
from kvgate.middleware.framework.composition.quickstart import pd_config_data
from kvgate.plugins.load.token_load import TokenLoadScorer
from kvgate.plugins.pd.admission import PdAdmission
from tests.integration.billing_helpers import PRICES_YAML, ledger_rows, write_keys
from tests.integration.conftest import FAST_POOL, gateway, serve_gateway

PROTOCOLS = ["nixl", "mooncake", "sglang"]
#: Prefill simulators serve a Mooncake bootstrap server on a free port (vLLM: 8998).
BOOTSTRAP = PdSimConfig(bootstrap_port=0)
LONG = "Summarize the repository history and every open issue in detail. " * 60  # ~700 tokens


@contextlib.asynccontextmanager
async def pd_fleet(
    protocol: str, prefill: int = 1, decode: int = 1, reports: str = "transferred",
    always_prefill: bool = True, **gw_extra: Any,
) -> AsyncIterator[tuple[list[RunningSim], list[RunningSim], KvgateApp, httpx.AsyncClient]]:
    # The simulated decode keeps waiting for a cancelled concurrent prefill's KV after the
    # gateway has left (it does not abort on disconnect): 5 s instead of vLLM's ~30 s lease
    # bounds that wait, which a fallback test would otherwise sit out (prefills here take ms).
    pd = PdSimConfig(decode_reports=reports, bootstrap_port=0, wait_timeout_s=5.0)
    async with contextlib.AsyncExitStack() as stack:
        pre = [await stack.enter_async_context(serve_sim(SimConfig(
            engine_id=f"p{i}", role="prefill", time_scale=0.0, seed=7, pd=pd)))
            for i in range(prefill)]
        dec = [await stack.enter_async_context(serve_sim(SimConfig(
            engine_id=f"d{i}", role="decode", time_scale=0.0, seed=7, pd=pd)))
            for i in range(decode)]
        data = _pd_data(pre, dec, protocol, always_prefill)
        data.update(gw_extra)
        app, client = await stack.enter_async_context(gateway(data))
        yield pre, dec, app, client


async def _one_pair(stack: contextlib.AsyncExitStack,
                    time_scale: float) -> tuple[RunningSim, RunningSim]:
    """One simulated prefill engine ``p0`` and one decode engine ``d0``, closed with ``stack``."""
    pre = await stack.enter_async_context(serve_sim(SimConfig(
        engine_id="p0", role="prefill", time_scale=time_scale, pd=BOOTSTRAP)))
    dec = await stack.enter_async_context(serve_sim(SimConfig(
        engine_id="d0", role="decode", time_scale=time_scale)))
    return pre, dec


def _pd_data(pre: list[RunningSim], dec: list[RunningSim], protocol: str,
             always_prefill: bool = True) -> dict[str, Any]:
    data = pd_config_data([s.url for s in pre], [s.url for s in dec], protocol)
    # Most tests exercise the two-hop protocols: every request takes the prefill hop, even when
    # its decode engine already holds the prompt (which the default preset serves locally:
    # test_cache_aware_decider_skips_the_hop_when_decode_holds_the_prompt).
    for plugin in data["plugins"]:
        if plugin["type"] == "pd-profile-handler" and always_prefill:
            plugin["params"]["min_uncached_tokens"] = 0
    for eng, sim in zip(data["engines"], [*pre, *dec], strict=True):
        # SGLang's bootstrap is the simulator's HTTP port; Mooncake's its bootstrap server
        port = sim.bootstrap_port if protocol == "mooncake" and sim in pre else sim.port
        eng["labels"] = {"bootstrap_port": str(port)}
    data["pool"] = FAST_POOL
    return data


def _body(stream: bool, content: str = LONG, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "max_tokens": 8, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": content}], **extra}


def _sse_usage(text: str) -> tuple[str, dict[str, Any] | None]:
    out, usage = "", None
    for line in text.split("\n\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        assert "kv_transfer_params" not in chunk
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            out += choice["delta"].get("content", "")
    return out, usage


async def _ask(client: httpx.AsyncClient, stream: bool, **extra: Any) -> tuple[
        httpx.Response, str, dict[str, Any] | None]:
    body = _body(stream, **extra)
    if stream:
        body["stream_options"] = {"include_usage": True}
    resp = await client.post("/v1/chat/completions", json=body)
    if resp.status_code != 200:
        return resp, "", None
    if stream:
        text, usage = _sse_usage(resp.text)
        return resp, text, usage
    data = resp.json()
    if "x-kvgate-prefill-engine" in resp.headers:  # two hops: a plain OpenAI answer
        assert "kv_transfer_params" not in data
    return resp, data["choices"][0]["message"]["content"], data["usage"]


def _cached_metric(app: KvgateApp) -> float:
    for line in app.metrics.render().decode().splitlines():
        if line.startswith('kvgate_tokens_total{kind="cached"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reports", ["transferred", "prefill-hit"])
async def test_two_hops_transfer_kv_and_report_prefill_hit(
    protocol: str, stream: bool, reports: str
) -> None:
    async with pd_fleet(protocol, reports=reports) as (pre, dec, app, client):
        results = []
        for _ in range(2):  # the second time the prefill engine holds the prompt
            resp, text, usage = await _ask(client, stream)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvgate-engine"] == "decode-0"
            assert resp.headers["x-kvgate-prefill-engine"] == "prefill-0"
            assert usage is not None
            results.append((text, usage))
        prompt = results[0][1]["prompt_tokens"]
        assert prompt > 256
        # the client sees the prefill side's own hit: 0 cold, then its block-aligned prefix
        hits = [u["prompt_tokens_details"]["cached_tokens"] for _, u in results]
        assert hits == [0, (prompt - 1) // 16 * 16]
        assert _cached_metric(app) == sum(hits)  # what usage hooks (billing) saw
        pstats, dstats = pre[0].engine.scheduler.stats, dec[0].engine.scheduler.stats
        # computed on the prefill engine: all of it, then the part past its cached blocks
        assert pstats.prompt_tokens_local_compute == prompt + (prompt - hits[1])
        assert pstats.generation_tokens == 2  # one token per prefill hop
        # the decode engine received the KV (all but the last token) the first time; the
        # second time it found most of it in its own cache
        assert dstats.prompt_tokens_external >= prompt - 1
        assert dstats.prompt_tokens_local_compute == 2
        assert results[0][0] == results[1][0] and results[0][0]
        # both decode requests paired with their prefill (Mooncake: fields as vLLM checks them)
        assert sim_handles(dec[0].app).pd == PdStats(transfers=2)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_output_equals_aggregated_engine(protocol: str) -> None:
    async with pd_fleet(protocol) as (_, _dec, _app, client), \
            serve_sim(SimConfig(engine_id="agg", time_scale=0.0, seed=7)) as agg:
        _, text, _ = await _ask(client, False, temperature=0)
        async with httpx.AsyncClient(base_url=agg.url) as direct:
            plain = (await direct.post("/v1/chat/completions",
                                       json=_body(False, temperature=0))).json()
    assert text == plain["choices"][0]["message"]["content"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_failure_falls_back_to_local_decode(protocol: str, stream: bool) -> None:
    async with pd_fleet(protocol) as (pre, dec, app, client):
        pre[0].faults.apply(FaultSpec(fail_next=1, status=500))
        resp, text, usage = await _ask(client, stream)
        assert resp.status_code == 200, resp.text
        assert "x-kvgate-prefill-engine" not in resp.headers
        assert text and usage is not None
        dstats = dec[0].engine.scheduler.stats
        assert dstats.prompt_tokens_external == 0
        assert dstats.prompt_tokens_local_compute == usage["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert app.gateway.two_hop is not None
        assert app.gateway.two_hop.stats["fallback"] == 1
        assert 'kvgate_pd_requests_total{result="fallback"} 1.0' in app.metrics.render().decode()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_decode_failure_is_reported_and_prefill_cleaned_up(protocol: str) -> None:
    async with pd_fleet(protocol) as (pre, dec, _app, client):
        dec[0].faults.apply(FaultSpec(fail_next=1, status=500))
        resp, _, _ = await _ask(client, False)
        assert resp.status_code in (502, 503)
        # nothing left waiting on the prefill engine's board, nothing running anywhere
        assert len(pre[0].app.state.sim.board) <= 1
        assert dec[0].engine.num_running == 0
        # the fleet still serves
        resp, _, usage = await _ask(client, False)
        assert resp.status_code == 200 and usage is not None


async def test_short_prompt_stays_on_decode() -> None:
    async with pd_fleet("nixl", always_prefill=False) as (pre, dec, _app, client):
        resp, text, usage = await _ask(client, False, content="hi")
        assert resp.status_code == 200 and text
        assert "x-kvgate-prefill-engine" not in resp.headers
        assert pre[0].engine.scheduler.stats.prompt_tokens == 0
        assert usage is not None and dec[0].engine.scheduler.stats.prompt_tokens_external == 0


async def test_stream_without_client_usage_is_stripped_and_billed() -> None:
    async with pd_fleet("sglang") as (_pre, _dec, app, client):
        for _ in range(2):
            resp = await client.post("/v1/chat/completions", json=_body(True))
            assert resp.status_code == 200
            text, usage = _sse_usage(resp.text)
            assert text and usage is None  # the client did not ask for usage
        assert _cached_metric(app) > 0  # but the gateway read (and rewrote) it


@contextlib.asynccontextmanager
async def _admission_fleet(**params: Any) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient]]:
    async with contextlib.AsyncExitStack() as stack:
        pre, dec = await _one_pair(stack, 1.0)
        data = pd_config_data([pre.url], [dec.url], "nixl")
        data["plugins"].append({"type": "pd-admission", "params": params})
        data["pool"] = FAST_POOL
        yield await stack.enter_async_context(gateway(data))


async def test_admission_queues_when_both_pools_are_saturated() -> None:
    params = {"max_prefill_tokens": 1, "max_decode_requests": 1, "poll_s": 0.01}
    async with _admission_fleet(**params) as (app, client):
        resps = await asyncio.gather(*(
            client.post("/v1/chat/completions", json=_body(False)) for _ in range(4)))
        assert [r.status_code for r in resps] == [200] * 4
        adm = app.pipeline.plugins["pd-admission"]
        assert isinstance(adm, PdAdmission)
        assert adm.stats["waited"] >= 2 and adm.stats["admitted"] == 4


async def test_admission_queue_bound_is_429_with_retry_after() -> None:
    params = {"max_prefill_tokens": 1, "max_decode_requests": 1, "max_waiting": 1,
              "retry_after_s": 2}
    async with _admission_fleet(**params) as (_app, client):
        resps = await asyncio.gather(*(
            client.post("/v1/chat/completions", json=_body(False)) for _ in range(4)))
        codes = sorted(r.status_code for r in resps)
        assert codes.count(200) >= 2 and 429 in codes
        limited = next(r for r in resps if r.status_code == 429)
        assert limited.headers["retry-after"] == "2"
        assert limited.json()["error"]["code"] == "rate_limited"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_client_disconnect_cancels_the_prefill(protocol: str) -> None:
    """A client leaving during the prefill hop aborts it on the prefill engine (and, for the
    concurrent protocols, the waiting decode), and releases every in-flight counter."""
    slow = {"time_scale": 20.0, "seed": 7}  # an ~8k-token prefill takes seconds
    async with serve_sim(SimConfig(engine_id="p0", role="prefill", pd=BOOTSTRAP, **slow)) as pre, \
            serve_sim(SimConfig(engine_id="d0", role="decode", **slow)) as dec, \
            serve_gateway(_pd_data([pre], [dec], protocol)) as (app, url):
        body = _body(True, content=LONG * 12)
        async with aiohttp.ClientSession() as session:
            pending = asyncio.create_task(session.post(url + "/v1/chat/completions", json=body))
            # the concurrent protocols' decode is waiting for its KV (its poll is on the prefill
            # side's board) before the client leaves: a poll that arrived after the prefill's
            # abort would wait out its own timeout (the simulated decode does not watch its
            # client), a race of the test's, not the gateway's
            waits = 0 if protocol == "nixl" else 1
            await _until(lambda: pre.engine.num_running == 1
                         and len(sim_handles(pre.app).board) == waits)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
        await _until(lambda: pre.engine.num_running == 0 and pre.engine.num_waiting == 0)
        assert pre.engine.scheduler.stats.finished["abort"] == 1
        await _until(lambda: all(e.in_flight_requests == 0 for e in app.pool.snapshot()))
        await _until(lambda: len(sim_handles(pre.app).board) == 0)
        assert dec.engine.num_running == 0


async def _until(predicate: Any, limit_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("protocol", ["nixl", "sglang"])
@pytest.mark.parametrize("stream", [False, True])
async def test_ledger_bills_the_prefill_hit(protocol: str, stream: bool, tmp_path: Path) -> None:
    """The billing plugin (a usage hook) records the same cached tokens the client sees: the
    prefill side's hit, not the KV the decode engine received."""
    keys = write_keys(tmp_path)
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES_YAML)
    async with contextlib.AsyncExitStack() as stack:
        pre, dec = await _one_pair(stack, 0.0)
        data = _pd_data([pre], [dec], protocol)
        data["plugins"] = [
            {"type": "api-keys", "params": {"file": str(keys.path)}},
            {"type": "billing", "params": {"prices": str(prices),
                                           "ledger": f"sqlite://{tmp_path}/ledger.sqlite",
                                           "spool": str(tmp_path / "spool")}},
            *data["plugins"]]
        app, client = await stack.enter_async_context(gateway(data))
        client.headers["authorization"] = f"Bearer {keys.user}"
        seen: dict[str, int | None] = {}
        for _ in range(2):
            resp, _, usage = await _ask(client, stream)
            assert resp.status_code == 200, resp.text
            assert usage is not None
            seen[resp.headers["x-request-id"]] = usage["prompt_tokens_details"]["cached_tokens"]
        rows = await ledger_rows(app)
        assert {rid: rows[rid].cached_tokens for rid in seen} == seen
        cold, warm = seen.values()
        assert cold == 0 and (warm or 0) > 256
        assert dec.engine.scheduler.stats.prompt_tokens_external > 0


async def test_cache_aware_decider_skips_the_hop_when_decode_holds_the_prompt() -> None:
    """The P/D quick start (``kvgate serve --prefill --decode``, no tokenizer, no events): its
    prefix record sees that a repeated prompt is on the decode engine that received its KV, so
    the request stays there: no second prefill hop."""
    async with contextlib.AsyncExitStack() as stack:
        pre, dec = await _one_pair(stack, 0.0)
        data = pd_config_data([pre.url], [dec.url], "nixl")
        data["pool"] = FAST_POOL
        _app, client = await stack.enter_async_context(gateway(data))
        first, _, _ = await _ask(client, False)
        assert first.headers.get("x-kvgate-prefill-engine") == "prefill-0"
        second, _, usage = await _ask(client, False)
        assert second.status_code == 200 and "x-kvgate-prefill-engine" not in second.headers
        assert usage is not None
        # served from the decode engine's own cache (the blocks it received the first time)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16
        assert pre.engine.scheduler.stats.prompt_tokens == first.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_prefill_load_released_when_the_prefill_hop_ends(protocol: str) -> None:
    """Token-load accounting: while decode streams, the prefill engine carries no prefill load
    for the request any more; the decode engine carries its expected output until the end."""
    async with contextlib.AsyncExitStack() as stack:
        pre, dec = await _one_pair(stack, 1.0)
        data = _pd_data([pre], [dec], protocol)
        app, url = await stack.enter_async_context(serve_gateway(data))
        scorer = app.pipeline.plugins["token-load-scorer"]
        assert isinstance(scorer, TokenLoadScorer)
        body = _body(True, max_tokens=200)
        async with aiohttp.ClientSession() as session, \
                session.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.content.readany()).startswith(b"data: ")
            await _until(lambda: scorer.tracker.load("prefill-0").prefill_tokens == 0)
            assert scorer.tracker.load("prefill-0").requests == 1
            assert scorer.tracker.load("decode-0").decode_tokens == 200
            await resp.read()
        await _until(lambda: len(scorer.tracker) == 0)



def _messages_usage(resp: httpx.Response, stream: bool) -> dict[str, Any]:
    """The usage an Anthropic client ends with (the SDK's merge of message_start and
    message_delta in a stream)."""
    if not stream:
        data = resp.json()
        assert data["type"] == "message" and "kv_transfer_params" not in data
        return dict(data["usage"])
    usage: dict[str, Any] = {}
    for block in resp.text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] != "error", event
                assert "kv_transfer_params" not in event.get("message", event)
                found = event.get("usage") or event.get("message", {}).get("usage")
                usage.update(found or {})
    return usage


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reports", ["transferred", "prefill-hit"])
async def test_messages_two_hops_report_the_prefill_hit(protocol: str, stream: bool,
                                                        reports: str, tmp_path: Path) -> None:
    """Anthropic Messages under P/D: the prefill hop answers in Messages' shape, its hit
    (``cache_read_input_tokens``) is found through the adapter and shown to the client and
    billed (cold 0, then the block-aligned prefix), with input + reads + writes = prompt."""
    keys = write_keys(tmp_path)
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES_YAML)
    billing = [{"type": "api-keys", "params": {"file": str(keys.path)}},
               {"type": "billing", "params": {"prices": str(prices),
                                              "ledger": f"sqlite://{tmp_path}/ledger.sqlite",
                                              "spool": str(tmp_path / "spool")}}]
    async with contextlib.AsyncExitStack() as stack:
        pd = PdSimConfig(decode_reports=reports, bootstrap_port=0)
        pre_sim = await stack.enter_async_context(serve_sim(SimConfig(
            engine_id="p0", role="prefill", time_scale=0.0, seed=7, pd=pd)))
        dec_sim = await stack.enter_async_context(serve_sim(SimConfig(
            engine_id="d0", role="decode", time_scale=0.0, seed=7, pd=pd)))
        data = _pd_data([pre_sim], [dec_sim], protocol)
        data["plugins"] = [*billing, *data["plugins"]]
        app, client = await stack.enter_async_context(gateway(data))
        client.headers["x-api-key"] = keys.user
        seen: dict[str, int | None] = {}
        for _ in range(2):
            resp = await client.post("/v1/messages", json={
                "model": "sim-model", "max_tokens": 8, "stream": stream,
                "messages": [{"role": "user", "content": LONG}]})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvgate-prefill-engine"] == "prefill-0"
            usage = _messages_usage(resp, stream)
            prompt = (usage["input_tokens"] + usage["cache_read_input_tokens"]
                      + usage.get("cache_creation_input_tokens", 0))
            assert prompt > 256
            seen[resp.headers["x-request-id"]] = usage["cache_read_input_tokens"]
        assert list(seen.values()) == [0, (prompt - 1) // 16 * 16]
        rows = await ledger_rows(app)
        assert {rid: rows[rid].cached_tokens for rid in seen} == seen
        assert all(rows[rid].prompt_tokens == prompt for rid in seen)
