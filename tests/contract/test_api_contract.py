"""Every API adapter registered in ``kvgate.apis`` keeps the contract of middleware/framework/api.py."""

from __future__ import annotations

import json

import pytest

from kvgate.middleware.framework.api import ApiAdapter, UsageTap, is_by_id
from kvgate.middleware.framework.composition.registry import load_apis
from kvgate.middleware.framework.errors import BadRequest, NoEndpointAvailable, NotFound
from kvgate.middleware.serving.gateway import ApiRoutes

APIS = sorted(load_apis().items())


def test_the_shipped_routes_fit_in_one_table() -> None:
    ApiRoutes([factory() for _, factory in APIS], frozenset({"/v1/models", "/health",
                                                             "/metrics"}))


@pytest.mark.parametrize(("name", "factory"), APIS, ids=[n for n, _ in APIS])
def test_adapter_contract(name: str, factory: type) -> None:
    adapter = factory()
    assert isinstance(adapter, ApiAdapter) and adapter.name == name
    assert adapter.routes and all(m in ("GET", "POST", "DELETE") and p.startswith("/")
                                  for m, p in adapter.routes)
    assert isinstance(adapter.disaggregable, bool)
    assert isinstance(getattr(adapter, "billed", True), bool)
    for err in (BadRequest("bad", param="model"), NotFound("gone"),
                NoEndpointAvailable("none")):
        body = json.loads(adapter.error_body(err))
        assert isinstance(body, dict) and err.message in json.dumps(body)
    end = adapter.stream_error("engine stream broke")
    assert end.endswith(b"\n\n") and b"engine stream broke" in end
    for wants in (False, True):
        tap = adapter.new_tap(wants)
        assert isinstance(tap, UsageTap) and tap.usage is None and tap.state_ids == []
        markers = getattr(tap, "markers", None)
        assert markers is None or all(isinstance(m, bytes) and m for m in markers)
    for _, path in adapter.routes:
        if not is_by_id(path):
            assert adapter.upstream_path(path).startswith("/")
