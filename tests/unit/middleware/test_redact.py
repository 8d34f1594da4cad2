"""What unauthenticated callers see of /health: addresses scrubbed, address keys dropped."""

from __future__ import annotations

import pytest

from kvgate.middleware.framework.redact import public_view, scrub

SCRUB_CASES = [
    ("aiohttp refusal", "Cannot connect to host 10.0.0.1:8000 ssl:default "
     "[Connect call failed ('10.0.0.1', 8000)]",
     "Cannot connect to host <address> ssl:default [Connect call failed ('<address>', 8000)]"),
    ("socket url", "asking the replay socket tcp://10.0.0.2:5558 for 3..9",
     "asking the replay socket <address> for 3..9"),
    ("redis url with password", "redis://u:pw@cache.internal:6379/0 down", "<address> down"),
    ("host name and port", "host engine-a.internal:8000 refused", "host <address> refused"),
    ("ipv6", "at [::1]:8000", "at <address>"),
    ("engine names stay", "engine vllm-0 exact -> degraded: topic 'kv@vllm-0'",
     "engine vllm-0 exact -> degraded: topic 'kv@vllm-0'"),
    ("numbers stay", "lost KV-event batches 3..9 (rank 0) at 14:44", None),
]


@pytest.mark.parametrize(("case", "text", "want"), SCRUB_CASES, ids=[c[0] for c in SCRUB_CASES])
def test_scrub(case: str, text: str, want: str | None) -> None:
    assert scrub(text) == (text if want is None else want)


def test_public_view_drops_address_keys_everywhere() -> None:
    body = {"engines": [{"name": "e0", "url": "http://10.0.0.1:8000", "healthy": False,
                         "last_error": "Cannot connect to host 10.0.0.1:8000"}],
            "plugins": {"q": {"consumer": "host-1-abc", "ok": True, "n": 3, "since": None}}}
    assert public_view(body) == {
        "engines": [{"name": "e0", "healthy": False,
                     "last_error": "Cannot connect to host <address>"}],
        "plugins": {"q": {"ok": True, "n": 3, "since": None}}}
