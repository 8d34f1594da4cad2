"""vLLM 0.32's Mooncake protocol end to end on simulated engines (engines/sim/core/pd.py checks the
fields as vLLM does): what happens to a request whose fields drift (the old names, each
required field missing, an unknown engine id), to a restarted prefill engine, an unreachable
bootstrap server, and a prefill whose one token is EOS. The valid pairing itself is covered
with the other protocols in test_pd.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import httpx
import pytest

from kvgate.engines.connectors import VllmMooncakeConnector, bootstrap_address, transfer_id
from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.pd import PdStats
from kvgate.engines.sim.http.app import sim_handles
from kvgate.engines.sim.testing import serve_sim
from kvgate.plugins.load.token_load import TokenLoadScorer
from tests.integration.conftest import gateway, serve_gateway
from tests.integration.test_pd import BOOTSTRAP, _ask, _body, _one_pair, _pd_data, _until
from tests.servers import free_port


async def _parked_until_cancelled(url: str, body: dict[str, Any], pd: PdStats) -> None:
    """POST ``body`` and wait until the simulator parks it (vLLM's wait for KV that never
    comes), then leave: the simulator lets it go."""
    async with aiohttp.ClientSession() as session:
        pending = asyncio.create_task(session.post(url + "/v1/chat/completions", json=body))
        await _until(lambda: pd.parked == 1)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
    await _until(lambda: pd.parked == 0)


def _old_decode_body(self: VllmMooncakeConnector, req: Any, body: dict[str, Any], ctx: Any,
                     prefill_answer: Any) -> dict[str, Any]:
    """The decode body kvgate sent before it followed vLLM 0.32 (bootstrap host/port keys)."""
    host, port = bootstrap_address(ctx.prefill, 8998)
    return {**body, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id(ctx),
        "bootstrap_server_host": host, "bootstrap_server_port": port}}


async def test_mooncake_old_field_names_leave_the_decode_waiting_as_vllm_does(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A connector sending ``bootstrap_server_host/port`` instead of ``remote_engine_id`` and
    ``remote_bootstrap_addr``: the decode engine logs "Got invalid KVTransferParams", pulls
    nothing, computes nothing, and holds the request until the client leaves (vLLM 0.32 parks
    it waiting for remote KV); the prefill's KV stays offered, never taken."""
    monkeypatch.setattr(VllmMooncakeConnector, "decode_body", _old_decode_body)
    async with contextlib.AsyncExitStack() as stack:
        pre, dec = await _one_pair(stack, 0.0)
        _app, url = await stack.enter_async_context(
            serve_gateway(_pd_data([pre], [dec], "mooncake")))
        pd = sim_handles(dec.app).pd
        await _parked_until_cancelled(url, _body(False), pd)
        assert len(sim_handles(pre.app).board) == 1  # the finished prefill nobody pulled
    assert pd == PdStats(invalid_params=1)
    assert dec.engine.scheduler.stats.prompt_tokens == 0
    assert "Got invalid KVTransferParams" in caplog.text


_VALID = {"do_remote_prefill": True, "transfer_id": "t-1", "remote_engine_id": "p0"}


@pytest.mark.parametrize("drop", ["transfer_id", "remote_engine_id", "remote_bootstrap_addr"])
async def test_mooncake_decode_without_a_required_field_is_parked(
    drop: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Each of vLLM's three required decode fields, left out (the prefill did run)."""
    async with contextlib.AsyncExitStack() as stack:
        pre, dec = await _one_pair(stack, 0.0)
        params = {**_VALID, "remote_bootstrap_addr": f"http://127.0.0.1:{pre.bootstrap_port}"}
        prefill = _body(False, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "transfer_id": "t-1"})
        async with httpx.AsyncClient(base_url=pre.url) as client:
            assert (await client.post("/v1/chat/completions", json=prefill)).status_code == 200
        del params[drop]
        pd = sim_handles(dec.app).pd
        await _parked_until_cancelled(dec.url, _body(False, kv_transfer_params=params), pd)
    assert pd == PdStats(invalid_params=1)
    assert f"Got invalid KVTransferParams: {params}" in caplog.text


async def test_mooncake_unknown_engine_id_fails_the_transfer() -> None:
    """All fields present but an engine id the bootstrap server does not list (a guessed name,
    or a restarted engine's old id): the pull fails (vLLM's default policy fails the request)."""
    async with contextlib.AsyncExitStack() as stack:
        pre, dec = await _one_pair(stack, 0.0)
        params = {**_VALID, "remote_engine_id": "prefill-0",
                  "remote_bootstrap_addr": f"http://127.0.0.1:{pre.bootstrap_port}"}
        async with httpx.AsyncClient(base_url=dec.url) as client:
            resp = await client.post("/v1/chat/completions",
                                     json=_body(False, kv_transfer_params=params))
    assert resp.status_code == 503 and "not found from bootstrap" in resp.text
    assert sim_handles(dec.app).pd == PdStats(transfer_failures=1)


async def test_mooncake_restarted_prefill_is_asked_again_after_a_failed_hop() -> None:
    """The gateway keeps the prefill engine's id; when the engine restarts under a new id the
    next decode fails (unknown id), the connector forgets the id, and the request after that
    pairs again with the new one."""
    async with contextlib.AsyncExitStack() as stack:
        pre, dec = await _one_pair(stack, 0.0)
        _app, client = await stack.enter_async_context(
            gateway(_pd_data([pre], [dec], "mooncake")))
        assert (await _ask(client, False))[0].status_code == 200
        bootstrap = sim_handles(pre.app).bootstrap
        assert bootstrap is not None
        bootstrap.engine_id = "p0-restarted"
        assert (await _ask(client, False))[0].status_code != 200
        resp, text, _ = await _ask(client, False)
        assert resp.status_code == 200 and text
        assert resp.headers["x-kvgate-prefill-engine"] == "prefill-0"
    assert sim_handles(dec.app).pd == PdStats(transfers=2, transfer_failures=1)


async def test_mooncake_unreachable_bootstrap_decodes_locally() -> None:
    """No engine id to be had: no hop is sent to the prefill engine, the decode engine serves
    the request alone, the fallback is counted, and the prefill load charged at dispatch is
    released at once (not only when the request ends)."""
    async with contextlib.AsyncExitStack() as stack:
        pre, dec = await _one_pair(stack, 1.0)
        data = _pd_data([pre], [dec], "mooncake")
        data["engines"][0]["labels"] = {"bootstrap_port": str(free_port())}  # nothing listens
        app, url = await stack.enter_async_context(serve_gateway(data))
        scorer = app.pipeline.plugins["token-load-scorer"]
        assert isinstance(scorer, TokenLoadScorer)
        async with aiohttp.ClientSession() as session, session.post(
                url + "/v1/chat/completions", json=_body(True, max_tokens=200)) as resp:
            assert resp.status == 200 and "x-kvgate-prefill-engine" not in resp.headers
            assert (await resp.content.readany()).startswith(b"data: ")
            assert scorer.tracker.load("prefill-0").prefill_tokens == 0
            await resp.read()
        assert pre.engine.scheduler.stats.prompt_tokens == 0
        dstats = dec.engine.scheduler.stats
        assert dstats.prompt_tokens_local_compute == dstats.prompt_tokens > 0
        assert sim_handles(dec.app).pd == PdStats()
        assert app.gateway.two_hop is not None and app.gateway.two_hop.stats["fallback"] == 1
        assert 'kvgate_pd_requests_total{result="fallback"} 1.0' in app.metrics.render().decode()


@pytest.mark.parametrize(("ignore_eos", "paired"), [(True, True), (False, False)])
async def test_mooncake_prefill_stopped_by_eos_offers_no_kv(ignore_eos: bool,
                                                            paired: bool) -> None:
    """vLLM 0.32's Mooncake producer offers the KV only on a length-capped finish: a one-token
    prefill whose token is EOS ("stop") leaves the waiting decode nothing (why the connector
    sends ``ignore_eos``)."""
    eos_first = {"natural_output_len": (1, 1), "time_scale": 0.0}  # the 1st token is EOS
    async with serve_sim(SimConfig(engine_id="p0", role="prefill", pd=BOOTSTRAP,
                                   **eos_first)) as pre, \
            serve_sim(SimConfig(engine_id="d0", role="decode", **eos_first)) as dec, \
            httpx.AsyncClient() as client:
        params = {**_VALID, "remote_bootstrap_addr": f"http://127.0.0.1:{pre.bootstrap_port}"}
        decode = asyncio.create_task(client.post(
            dec.url + "/v1/chat/completions", json=_body(False, kv_transfer_params=params)))
        await _until(lambda: len(sim_handles(pre.app).board) == 1)  # the decode is waiting
        prefill = await client.post(pre.url + "/v1/chat/completions", json=_body(
            False, max_tokens=1, ignore_eos=ignore_eos,
            kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-1"}))
        assert prefill.json()["choices"][0]["finish_reason"] == ("length" if ignore_eos
                                                                 else "stop")
        assert (await decode).status_code == (200 if paired else 503)
    assert sim_handles(dec.app).pd == (PdStats(transfers=1) if paired
                                       else PdStats(transfer_failures=1))
