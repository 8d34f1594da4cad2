"""SSE relay with the OpenAI tap: event-granular relay, usage pickup, usage-chunk stripping,
split reads, only marked events parsed."""

from __future__ import annotations

import json

import pytest

from kvgate.apis.openai import OpenAITap
from kvgate.middleware.framework.types import Usage
from kvgate.middleware.serving import sse
from kvgate.middleware.serving.sse import EventRelay, error_event


def SSETap(strip_usage: bool) -> EventRelay:  # noqa: N802 - reads like the relay it builds
    return EventRelay(OpenAITap(client_wants_usage=not strip_usage))


def _events(data: bytes) -> list[object]:
    return [e[6:] if e == b"data: [DONE]" else json.loads(e[6:])
            for e in data.split(b"\n\n") if e]


def _ev(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CHUNK1 = _ev({"choices": [{"delta": {"content": "a"}}]})
CHUNK2 = _ev({"choices": [{"delta": {"content": "b"}}]})
USAGE = {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}
USAGE_CHUNK = _ev({"choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"
STREAM = CHUNK1 + CHUNK2 + USAGE_CHUNK + DONE


def _split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 50, len(STREAM)])
@pytest.mark.parametrize("strip", [False, True])
def test_relay_any_split(size: int, strip: bool) -> None:
    tap = SSETap(strip_usage=strip)
    out = b"".join(tap.feed(c) for c in _split(STREAM, size)) + tap.flush()
    expected = CHUNK1 + CHUNK2 + (b"" if strip else USAGE_CHUNK) + DONE
    assert _events(out) == _events(expected)
    assert tap.usage == Usage(10, 2, 8)
    assert tap.done
    assert tap.events == 2 + (0 if strip else 1)


def test_events_forwarded_as_soon_as_complete() -> None:
    tap = SSETap(strip_usage=True)
    assert tap.feed(CHUNK1[:5]) == b""
    assert tap.feed(CHUNK1[5:]) == CHUNK1
    assert tap.feed(CHUNK2 + CHUNK1[:3]) == CHUNK2


def test_usage_in_content_chunk_is_removed_not_dropped() -> None:
    both = _ev({"choices": [{"delta": {"content": "x"}}], "usage": USAGE})
    tap = SSETap(strip_usage=True)
    out = tap.feed(both)
    assert json.loads(out[6:]) == {"choices": [{"delta": {"content": "x"}}]}
    assert tap.usage == Usage(10, 2, 8)


def test_unmarked_chunks_relayed_byte_for_byte() -> None:
    """Chunks without a usage marker are passed on untouched (not parsed, not re-serialised)."""
    odd = b'data: {"choices":  [ {"delta": {"content": "\\u00e9"}} ]}\n\n'
    tap = SSETap(strip_usage=True)
    assert tap.feed(odd) == odd


@pytest.mark.parametrize(("usage", "cached"), [
    ({"prompt_tokens": 5, "completion_tokens": 1}, None),
    ({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None}, None),
    ({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}, 0),
])
def test_cached_unknown_is_none(usage: dict[str, object], cached: int | None) -> None:
    tap = SSETap(strip_usage=False)
    tap.feed(_ev({"choices": [], "usage": usage}))
    assert tap.usage is not None
    assert tap.usage.cached_tokens == cached


def test_missing_done_and_null_usage() -> None:
    tap = SSETap(strip_usage=True)
    chunk = _ev({"choices": [{"delta": {}}], "usage": None})
    assert tap.feed(chunk) == chunk
    assert not tap.done
    assert tap.usage is None


def test_error_event_is_openai_shaped() -> None:
    event = error_event("boom")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["error"]["message"] == "boom"


# Found by tests/integration/test_fuzz_gateway.py: bytes an engine sent after ``data: [DONE]``
# reached the client (events after the end, or a partial event with no blank line after it).
@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize(("after", "marked"), [
    (CHUNK1, False), (b"\x00\x00", False), (b"data: {", False), (USAGE_CHUNK, True),
    (b"event: error\n", False),
])
def test_nothing_after_the_end_marker(size: int, after: bytes, marked: bool) -> None:
    tap = SSETap(strip_usage=False)
    stream = CHUNK1 + (USAGE_CHUNK if marked else b"") + DONE + after + CHUNK2
    out = b"".join(tap.feed(c) for c in _split(stream, size)) + tap.flush()
    assert _events(out) == _events(CHUNK1 + (USAGE_CHUNK if marked else b"") + DONE)
    assert out.endswith(DONE) and tap.done and tap.events == 1 + marked


@pytest.mark.parametrize("data", [b"data: {data: [DONE]\n\n",
                                  b'data: {"t": "data: [DONE]\\n\\n"}\n\n'])
def test_end_marker_only_as_a_whole_line(data: bytes) -> None:
    tap = SSETap(strip_usage=False)
    assert tap.feed(data) == data and not tap.done


def test_a_partial_last_event_is_terminated() -> None:
    tap = SSETap(strip_usage=False)
    assert tap.feed(CHUNK1 + b"event: x\ndata: {}") == CHUNK1
    assert tap.flush() == b"event: x\ndata: {}\n\n"
    assert tap.flush() == b""


@pytest.mark.parametrize("size", [7, 100, 5000])
def test_an_event_that_never_ends_is_bounded(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 1000)
    tap = SSETap(strip_usage=False)
    assert tap.feed(CHUNK1 + b"data: xx") == CHUNK1  # the whole events before it are relayed
    chunks = _split(b"x" * 2000, size)
    fed = 0
    while 8 + sum(map(len, chunks[: fed + 1])) <= 1000:  # under the bound: held
        assert tap.feed(chunks[fed]) == b""
        fed += 1
    assert tap.feed(chunks[fed]) == b"" and tap.overflow  # dropped; the next feed raises
    with pytest.raises(sse.EventTooLarge):
        tap.feed(b"\n\n")
