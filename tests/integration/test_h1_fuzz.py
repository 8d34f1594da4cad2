"""HTTP-level fuzz of the front end ``kvgate serve`` ships (middleware/transport/h1server.py with the
limits of middleware/transport/h1limits.py), as a real process in front of a simulated engine, over raw
sockets: malformed request lines and heads, request smuggling shapes, oversized and slow
requests, pipelining, half-closed sockets, and a few hundred seeded random byte mutations of a
valid request. Every answer must be whole, valid HTTP responses with a status in
:data:`~tests.integration.h1_wire.ALLOWED`, or a clean close; the server must neither crash nor
hang, and a normal request on a fresh connection is served after every case. Then a slow-client
attack: half-sent heads held open while normal traffic runs (docs/reliability.md)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.slow_clients import attack_while_serving
from tests.integration.h1_wire import (
    ALLOWED,
    CHAT,
    CHAT_BODY,
    HEALTH,
    Answer,
    exchange,
    request_ok,
    served_gateway,
)

#: The server section of the gateway under test: short deadlines, so slow cases take ~1 s.
SERVER = {"head_timeout_s": 1.0, "body_timeout_s": 1.0, "keep_alive_timeout_s": 1,
          "max_body_bytes": 64 * 1024}
#: Slack on a deadline on the loaded two-core machine.
SLACK_S = 2.0
MUTATIONS = 300
H = b"host: gw\r\n"
CHUNKED = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json"
           b"\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    with served_gateway(tmp_path_factory.mktemp("h1fuzz"), **SERVER) as served:
        yield served


def _chunks(*parts: bytes, tail: bytes = b"0\r\n\r\n") -> bytes:
    return CHUNKED + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + tail


#: (name, what is sent, the statuses it may get, whether a close without an answer is fine)
CASES: list[tuple[str, bytes, set[int], bool]] = [
    ("garbage line", b"GARBAGE\r\n\r\n", {400}, False),
    ("HTTP/0.9 line", b"GET /health\r\n\r\n", {200, 400}, True),
    ("HTTP/9.9", b"GET /health HTTP/9.9\r\n" + H + b"\r\n", {400, 505}, False),
    ("HTTP/1.0", b"GET /health HTTP/1.0\r\n\r\n", {200}, False),
    ("lowercase method", b"get /health HTTP/1.1\r\n" + H + b"\r\n", {400, 405, 501}, False),
    ("unknown method", b"BREW /health HTTP/1.1\r\n" + H + b"\r\n", {400, 405, 501}, False),
    ("absolute form", b"GET http://gw/health HTTP/1.1\r\n" + H + b"\r\n", {200, 400, 404},
     False),
    ("asterisk target", b"OPTIONS * HTTP/1.1\r\n" + H + b"\r\n", {400, 404, 405}, False),
    ("NUL in target", b"GET /hea\x00lth HTTP/1.1\r\n" + H + b"\r\n", {400}, False),
    ("space in target", b"GET /he alth HTTP/1.1\r\n" + H + b"\r\n", {400}, False),
    ("bare LF", b"GET /health HTTP/1.1\n" + H.replace(b"\r", b"") + b"\n", {200, 400}, False),
    ("binary", bytes(range(256)), {400}, True),
    ("header without colon", b"GET /health HTTP/1.1\r\n" + H + b"nocolon\r\n\r\n", {400}, False),
    ("space before colon", b"GET /health HTTP/1.1\r\nhost : gw\r\n\r\n", {400}, False),
    ("bad header name", b"GET /health HTTP/1.1\r\n" + H + b"x(y): 1\r\n\r\n", {400}, False),
    ("CR in value", b"GET /health HTTP/1.1\r\n" + H + b"x-a: 1\r2\r\n\r\n", {400}, False),
    ("101 headers", b"GET /health HTTP/1.1\r\n" + b"".join(
        b"x-%d: v\r\n" % i for i in range(101)) + b"\r\n", {431}, False),
    ("33 KiB head", b"GET /health HTTP/1.1\r\n" + H + b"x-big: " + b"a" * (33 << 10)
     + b"\r\n\r\n", {431}, False),
    ("9 KiB target", b"GET /" + b"a" * (9 << 10) + b" HTTP/1.1\r\n" + H + b"\r\n", {414}, False),
    # request smuggling shapes
    ("CL and TE", b"POST /v1/chat/completions HTTP/1.1\r\n" + H + b"content-length: 3\r\n"
     b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n", {400}, False),
    ("two CLs", b"POST /v1/chat/completions HTTP/1.1\r\n" + H + b"content-length: 1\r\n"
     b"content-length: 2\r\n\r\nab", {400}, False),
    ("CL with sign", b"POST /v1/chat/completions HTTP/1.1\r\n" + H + b"content-length: +2\r\n"
     b"\r\nab", {400}, False),
    ("obs-fold", b"GET /health HTTP/1.1\r\n" + H + b"x-a: 1\r\n folded\r\n\r\n", {400}, False),
    ("TE gzip, chunked", CHUNKED.replace(b"chunked", b"gzip, chunked") + b"0\r\n\r\n",
     {400, 422, 501}, False),
    ("TE not chunked last", CHUNKED.replace(b"chunked", b"chunked, gzip") + b"0\r\n\r\n",
     {400, 411, 501}, False),
    ("bad chunk size", CHUNKED + b"zz\r\nab\r\n0\r\n\r\n", {400}, False),
    ("huge chunk size", CHUNKED + b"ffffffffffffffffffff\r\nab\r\n", {400, 413}, False),
    ("chunk extension", _chunks(CHAT_BODY).replace(b"\r\n{", b";ext=1\r\n{", 1), {200, 400},
     False),
    ("trailers", _chunks(CHAT_BODY, tail=b"0\r\nx-trailer: 1\r\n\r\n"), {200}, False),
    ("chunked body", _chunks(CHAT_BODY[:10], CHAT_BODY[10:]), {200}, False),
    # oversized and slow
    ("body over max_body_bytes", CHAT.replace(b"content-length: %d" % len(CHAT_BODY),
     b"content-length: 100000000")[:-len(CHAT_BODY)] + b"{", {413, 408}, True),
    ("half a head", b"GET /health HTTP/1.1\r\nhost: g", {408}, False),
    ("half a body", CHAT[:-10], {408}, False),
    ("nothing", b"", set(), True),
    # pipelining
    ("two in one write", HEALTH.replace(b"connection: close\r\n", b"") + HEALTH, {200}, False),
    # a refusal drops the requests before it on the connection unanswered (h1limits.refuse):
    # the connection is closed without an answer, the good request's included
    ("good then refused", HEALTH.replace(b"connection: close\r\n", b"") + b"GARBAGE\r\n\r\n",
     {200, 400}, True),
    ("good then too large", HEALTH.replace(b"connection: close\r\n", b"") + b"GET /health "
     b"HTTP/1.1\r\n" + b"x-big: " + b"a" * (40 << 10) + b"\r\n\r\n", {200, 431}, True),
]


def _check(answer: Answer, allowed: set[int], silent_ok: bool) -> None:
    assert set(answer.statuses) <= allowed and set(answer.statuses) <= ALLOWED, answer.raw[:300]
    assert answer.statuses or silent_ok or not allowed, f"no answer: {answer}"
    assert answer.closed or answer.statuses, f"neither answered nor closed: {answer}"


@pytest.mark.parametrize(("name", "raw", "allowed", "silent_ok"),
                         [pytest.param(*case, id=case[0]) for case in CASES])
def test_malformed_oversized_slow_and_pipelined(gw: tuple[int, Path], name: str, raw: bytes,
                                                allowed: set[int], silent_ok: bool) -> None:
    port, _ = gw
    _check(exchange(port, [raw]), allowed, silent_ok)
    request_ok(port)


def test_pipelined_requests_are_answered_in_order(gw: tuple[int, Path]) -> None:
    port, _ = gw
    keep = HEALTH.replace(b"connection: close\r\n", b"")
    chat = CHAT.replace(b"connection: close\r\n", b"")
    answer = exchange(port, [keep + chat + keep + HEALTH])
    assert answer.statuses == [200] * 4 and answer.closed, answer.raw[-300:]
    assert answer.raw.index(b'"status"') < answer.raw.index(b'"chat.completion"')


@pytest.mark.parametrize("raw", [HEALTH, CHAT], ids=["health", "chat"])
def test_half_closed_after_a_full_request(gw: tuple[int, Path], raw: bytes) -> None:
    """The client shuts its write side after a whole request: the server answers it, or, as
    for a client that left (a FIN is all it sees of either), closes cleanly without a byte."""
    port, _ = gw
    answer = exchange(port, [raw], shut=True)
    assert answer.closed and not answer.reset
    assert answer.statuses in ([200], []), answer.raw[:300]
    request_ok(port)


def mutate(rng: random.Random, raw: bytes) -> bytes:
    """One random edit of ``raw``: a byte replaced (by a random or a delimiter byte), bytes
    inserted, a slice deleted or duplicated."""
    data = bytearray(raw)
    at = rng.randrange(len(data))
    match rng.randrange(5):
        case 0:
            data[at] = rng.randrange(256)
        case 1:
            data[at] = rng.choice(b"\r\n :\x00\x7f\xff\t;,")
        case 2:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        case 3:
            del data[at:at + rng.randint(1, 16)]
        case _:
            data[at:at] = data[at:at + rng.randint(1, 32)]
    return bytes(data)


def _mutant(port: int, raw: bytes) -> Answer:
    answer = exchange(port, [raw])
    request_ok(port)
    return answer


def test_random_mutations_of_a_valid_request(gw: tuple[int, Path]) -> None:
    port, _ = gw
    rng = random.Random(29)
    mutants = [CHAT if i == 0 else mutate(rng, CHAT) for i in range(MUTATIONS)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda raw: _mutant(port, raw), mutants))
    assert answers[0].statuses == [200]
    for raw, answer in zip(mutants, answers, strict=True):
        assert set(answer.statuses) <= ALLOWED, (raw, answer.raw[:300])
        assert answer.statuses or answer.closed, (raw, answer)


async def test_slow_clients_are_closed_at_the_head_deadline_while_others_are_served(
        gw: tuple[int, Path]) -> None:
    port, _ = gw
    result = await attack_while_serving(port, attackers=100, normal_s=None)
    assert result["normal"]["errors"] == 0 and result["normal"]["requests"] > 0
    late = [t for t in result["attackers"]["closed_after_s"]
            if t is None or t > SERVER["head_timeout_s"] + SLACK_S]
    assert not late, result["attackers"]


def test_the_server_logged_no_failure(gw: tuple[int, Path]) -> None:
    """After all of the above: the process is up and its log has no traceback or ERROR."""
    port, log = gw
    request_ok(port)
    text = log.read_text()
    at = max(text.find("Traceback"), text.find(" ERROR "))
    assert at < 0, text[max(0, at - 500):at + 2500]

