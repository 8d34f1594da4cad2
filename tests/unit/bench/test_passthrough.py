"""bench/passthrough.py: every variant (aiohttp, httpx, and kvgate's own server and client,
``passthrough-h1``: the floor under kvgate's CPU per request) forwards a chat body to the fake
engine and answers with the engine's bytes, JSON and streamed, as real processes; and
bench/flat_bound.py (``flat-bound``) answers and logs like the gateway it bounds."""

from __future__ import annotations

import io
import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import procs, systems
from bench.loadgen import make_body


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = procs.free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    argv = [sys.executable, "-m", "bench.upstream", "--host", "127.0.0.1", "--port", str(port)]
    with procs.running(argv, "0-1", log) as proc:
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(url + "/health", proc, 30.0, log)
        yield url


def _post(url: str, body: bytes) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.status, r.headers.get("content-type", ""), r.read()


@pytest.mark.parametrize("name", [systems.PASS_AIOHTTP, systems.PASS_HTTPX, systems.PASS_H1])
@pytest.mark.parametrize("stream", [False, True])
def test_forwards_the_engines_answer(tmp_path: Path, engine: str, name: str,
                                     stream: bool) -> None:
    body = make_body(1024, stream, systems.MODEL)
    direct = _post(engine + "/v1/chat/completions", body)
    system = systems.catalogue()[name]
    with systems.launched(system, engine, 0, tmp_path / "log", tmp_path) as endpoint:
        for _ in range(3):  # kept-alive engine connections are reused
            status, ctype, answer = _post(endpoint.base_url + "/v1/chat/completions", body)
            assert (status, ctype.split(";")[0]) == (direct[0], direct[1].split(";")[0])
            assert answer == direct[2]  # the fake engine answers a body alike every time
            if stream:
                assert answer.startswith(b"data: ") and answer.rstrip().endswith(b"[DONE]")
            else:
                assert json.loads(answer)["usage"]["prompt_tokens"] > 0


def test_flat_bound_forwards_and_logs(tmp_path: Path, engine: str) -> None:
    """bench/flat_bound.py: the engine's answer unchanged, the engine named, one access-log
    line per request with the answer's usage."""
    port, log = procs.free_port(), tmp_path / "access.log"
    argv = [sys.executable, "-m", "bench.flat_bound", "--upstream", engine,
            "--port", str(port), "--access-log", str(log)]
    body = make_body(1024, False, systems.MODEL)
    direct = _post(engine + "/v1/chat/completions", body)
    with procs.running(argv, "0-1", tmp_path / "flat.log") as proc:
        base = f"http://127.0.0.1:{port}"
        procs.wait_healthy(base + "/v1/models", proc, 30.0, tmp_path / "flat.log",
                           must_contain=systems.MODEL.encode())
        answers = [_post(base + "/v1/chat/completions", body) for _ in range(2)]
    assert [a[2] for a in answers] == [direct[2]] * 2
    usage = json.loads(direct[2])["usage"]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["status"], x["engines"], x["prompt_tokens"], x["output_tokens"])
            for x in lines] == [(200, ["engine-0"], usage["prompt_tokens"],
                                 usage["completion_tokens"])] * 2


def test_flat_bound_routes_on_its_record() -> None:
    """The flat bound's routing work: the second time a prompt comes, the index holds its
    blocks, so less work is charged; the tight-loop timer gives its figures."""
    from bench.flat_bound import ENGINE, FlatGateway, routing_us

    gateway = FlatGateway("http://127.0.0.1:1", io.BytesIO())
    data = json.loads(make_body(1024, False, systems.MODEL))
    first = gateway.route(data, 100.0)
    second = gateway.route(data, 101.0)
    assert first[0] == second[0] == ENGINE
    assert 0 < second[1] < first[1]  # its blocks are held: only the tail and output remain
    assert gateway.queued[ENGINE] == first[1] + second[1]  # charged until released
    figures = routing_us(1024, rounds=50, trials=2)
    assert len(figures) == 2 and all(f > 0 for f in figures) and figures == sorted(figures)
