"""The keys file's limits and tenants sections reach the authenticated key."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from kvgate.middleware.framework.errors import ConfigError
from kvgate.plugins.tenancy.auth import NO_LIMITS, Limits, hash_key, load_keys


def test_key_and_tenant_limits_are_loaded(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"""
keys:
  - {{id: a, tenant: acme, sha256: {hash_key("ka")}, limits: {{requests_per_min: 60}}}}
  - {{id: b, tenant: other, sha256: {hash_key("kb")}}}
tenants:
  acme: {{budget_usd: "5.00", limits: {{max_concurrent: 4, output_tokens_per_min: 1000}}}}
""")
    keys = load_keys(path)
    a, b = keys[hash_key("ka")], keys[hash_key("kb")]
    assert a.limits == Limits(requests_per_min=60)
    assert a.tenant_budget_usd == Decimal("5.00")
    assert a.tenant_limits == Limits(max_concurrent=4, output_tokens_per_min=1000)
    assert (b.limits, b.tenant_limits, b.tenant_budget_usd) == (NO_LIMITS, NO_LIMITS, None)


@pytest.mark.parametrize("body", [
    "keys: []\ntenants: {acme: {limits: {requests_per_min: 0}}}",
    "keys: []\ntenants: {acme: {budget_usd: '-1'}}",
    "keys: []\ntenants: {acme: {limits: {tokens: 5}}}",
])
def test_bad_limits_are_config_errors(tmp_path: Path, body: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError, match="invalid keys file"):
        load_keys(path)
