"""Adapter options from the config's ``apis`` section: validated strictly at startup against
each adapter's ``Params`` (unknown adapter, unknown option, wrong type: ConfigError), passed to
the adapters the gateway serves with, and visible in what they do."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.errors import ConfigError
from tests.integration.conftest import gateway, gateway_config

INLINE_SYSTEM: dict[str, Any] = {
    "model": "sim-model", "max_tokens": 2, "system": "Be brief.",
    "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "Be kind."},
                 {"role": "user", "content": "again"}]}
BACKGROUND: dict[str, Any] = {"model": "sim-model", "input": "hi", "background": True,
                              "max_output_tokens": 2}

#: (case, apis section, merge_inline_system, allow_background).
GOOD: list[tuple[str, dict[str, Any] | None, bool, bool]] = [
    ("absent", None, False, False),
    ("empty", {}, False, False),
    ("defaults spelled out", {"messages": {}, "responses": {}}, False, False),
    ("merge inline system", {"messages": {"merge_inline_system": True}}, True, False),
    ("allow background", {"responses": {"allow_background": True}}, False, True),
    ("both", {"messages": {"merge_inline_system": True},
              "responses": {"allow_background": True}}, True, True),
]


def _adapter(app: KvgateApp, path: str) -> Any:
    found = app.apis.match("POST", path)
    assert found is not None
    return found[0]


@pytest.mark.parametrize(("case", "section", "merge", "background"), GOOD,
                         ids=[c[0] for c in GOOD])
async def test_options_reach_the_adapters(fleet: list[RunningSim], case: str,
                                          section: dict[str, Any] | None, merge: bool,
                                          background: bool) -> None:
    data = gateway_config([s.url for s in fleet])
    if section is not None:
        data["apis"] = section
    async with gateway(data) as (app, client):
        messages = _adapter(app, "/v1/messages")
        assert messages.merge_inline_system is merge
        assert _adapter(app, "/v1/responses").allow_background is background
        prompt = messages.parse(INLINE_SYSTEM, {}).prompt
        roles = [m["role"] for m in prompt.messages]
        assert roles == (["system", "user", "user"] if merge
                         else ["system", "user", "system", "user"])
        assert (await client.post("/v1/messages", json=INLINE_SYSTEM)).status_code == 200
        resp = await client.post("/v1/responses", json=BACKGROUND)
        if background:
            assert resp.status_code == 200, resp.text
            assert resp.json()["status"] == "queued"
        else:
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "background"


#: (case, apis section, words the ConfigError has).
BAD: list[tuple[str, Any, str]] = [
    ("unknown adapter", {"mesages": {"merge_inline_system": True}}, "unknown API adapter"),
    ("unknown option", {"messages": {"merge_system": True}}, "apis.messages: merge_system"),
    ("option of the other adapter", {"messages": {"allow_background": True}},
     "apis.messages: allow_background"),
    ("string for a bool", {"responses": {"allow_background": "yes"}},
     "apis.responses: allow_background"),
    ("int for a bool", {"messages": {"merge_inline_system": 1}},
     "apis.messages: merge_inline_system"),
    ("adapter without options", {"chat": {"x": 1}}, "takes no options"),
    ("options not a mapping", {"messages": True}, "apis.messages"),
    ("section not a mapping", ["messages"], "apis"),
]


@pytest.mark.parametrize(("case", "section", "words"), BAD, ids=[c[0] for c in BAD])
def test_bad_options_refuse_to_start(case: str, section: Any, words: str) -> None:
    data = gateway_config(["http://127.0.0.1:1"])
    data["apis"] = section
    with pytest.raises(ConfigError, match=words) as caught:
        create_app(parse_config(data, "kvgate.yaml"))
    assert "kvgate.yaml" in str(caught.value)
