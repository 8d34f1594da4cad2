"""Tenant cache salts: derivation, the secret, the request hook, the ledger's session digest,
and kvgate's salted block hashes against what vLLM 0.32 itself publishes
(``vllm_salt_fixture.json``, written in the engine venv by ``make_vllm_salt_fixture.py``)."""

from __future__ import annotations

import json
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvgate.middleware.cli import main
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.types import CycleState, InferenceRequest
from kvgate.plugins.common.state import CACHE_SALT
from kvgate.plugins.load.session_affinity import session_key
from kvgate.plugins.prefix.index.hashing import request_extra_keys
from kvgate.plugins.prefix.index.index import KvIndex
from kvgate.plugins.tenancy.auth import ApiKey
from kvgate.plugins.tenancy.cache_salt import CacheSalt, derive_salt, tenant_scope
from kvgate.plugins.tenancy.gateway_secret import (
    CACHE_SALT_PURPOSE,
    SESSION_PURPOSE,
    GatewaySecret,
    load_secret,
    session_digest,
)

FIXTURE = json.loads(Path(__file__).with_name("vllm_salt_fixture.json").read_text())
SECRET = GatewaySecret(b"s" * 40, "env TEST")


class _Auth:
    def __init__(self, disabled: bool) -> None:
        self.disabled = disabled

#: vLLM 0.32's cache_salt rule (entrypoints/generate/base/protocol.py:38-58).
FORBIDDEN = set("@/\\\x00")


def _plugin(lookup: dict[str, object] | None = None, **params: Any) -> CacheSalt:
    known = {"api-keys": _Auth(disabled=False)} if lookup is None else lookup

    class Lookup:
        def lookup(self, name: str) -> object:
            return known[name]

    return CacheSalt("cache-salt", CacheSalt.Params.model_validate(params), Lookup(),
                     secret=SECRET)


def _req(api: str = "chat", tenant: str | None = "acme", body: dict[str, Any] | None = None,
         ) -> InferenceRequest:
    req = InferenceRequest(
        request_id="r", api=api, model="m",
        body=dict(body or {"messages": []}), headers={}, stream=False,
        client_wants_usage=False, prompt_token_estimate=1, received_at=time.monotonic(),
        raw_body=b"{}")
    if tenant is not None:
        req.principal = ApiKey(f"{tenant}-1", tenant, None, False, None)
        req.tenant, req.key_id = tenant, f"{tenant}-1"
    return req


# -- derivation ----------------------------------------------------------------------------------
def test_salts_are_valid_for_vllm_distinct_and_keyed() -> None:
    key = SECRET.derive(CACHE_SALT_PURPOSE)
    salts = {t: derive_salt(key, tenant_scope(t)) for t in ("acme", "globex", "a", "acme ")}
    assert len(set(salts.values())) == len(salts)
    for salt in salts.values():
        assert salt.startswith("kvg1.") and len(salt) == 37
        assert len(salt) <= 128 and not FORBIDDEN & set(salt)
    assert derive_salt(key, tenant_scope("acme")) == salts["acme"]  # replicas agree
    other = GatewaySecret(b"t" * 40, "env X").derive(CACHE_SALT_PURPOSE)
    assert derive_salt(other, tenant_scope("acme")) != salts["acme"]  # needs the secret
    assert SECRET.derive(SESSION_PURPOSE) != key  # one key per purpose
    assert "s" * 40 not in repr(SECRET)


def test_secret_from_env_file_and_generated(tmp_path: Path) -> None:
    env = {"KVS": "e" * 32}
    assert load_secret("KVS", str(tmp_path / "x"), env).source == "env KVS"
    assert not (tmp_path / "x").exists()
    made = load_secret("KVS", str(tmp_path / "d" / "secret"), {})
    assert made.source.startswith("generated ")
    path = tmp_path / "d" / "secret"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = load_secret("KVS", str(path), {})
    assert again.key == made.key and again.source.startswith("file ")
    with pytest.raises(ConfigError, match="shorter than 32"):
        load_secret("KVS", str(path), {"KVS": "short"})


def test_session_digest_is_keyed_and_stable() -> None:
    key = SECRET.derive(SESSION_PURPOSE)
    session = '["acme","m","conv-1"]'
    digest = session_digest(key, session)
    assert digest.startswith("hs1:") and len(digest) == 36 and "conv-1" not in digest
    assert session_digest(key, session) == digest
    assert session_digest(key, '["acme","m","conv-2"]') != digest
    assert session_digest(SECRET.derive(CACHE_SALT_PURPOSE), session) != digest


# -- the request hook ------------------------------------------------------------------------
HOOK_CASES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    # (case, params, request kwargs, expected: "tenant", "group", "client", "none")
    ("tenant salt injected", {}, {}, "tenant"),
    ("client salt replaced", {}, {"body": {"cache_salt": "mine"}}, "tenant"),
    ("client salt kept", {"client_salt": "keep"}, {"body": {"cache_salt": "mine"}}, "client"),
    ("keep mode injects when absent", {"client_salt": "keep"}, {}, "tenant"),
    ("sharing group", {"share_groups": {"public": ["acme", "globex"]}}, {}, "group"),
    ("no principal", {}, {"tenant": None, "body": {"cache_salt": "mine"}}, "none"),
    ("api without salts", {}, {"api": "tokenize"}, "none"),
    ("api list narrowed", {"apis": ["completions"]}, {}, "none"),
    ("messages salted", {}, {"api": "messages"}, "tenant"),
    ("embeddings salted", {}, {"api": "embeddings"}, "tenant"),
]


@pytest.mark.parametrize(("case", "params", "kw", "expected"), HOOK_CASES,
                         ids=[c[0] for c in HOOK_CASES])
async def test_hook(case: str, params: dict[str, Any], kw: dict[str, Any],
                    expected: str) -> None:
    plugin = _plugin(**params)
    req, state = _req(**kw), CycleState()
    before = dict(req.body)
    await plugin.on_request(req, state)
    key = SECRET.derive(CACHE_SALT_PURPOSE)
    want = {"tenant": derive_salt(key, tenant_scope("acme")),
            "group": derive_salt(key, "group\x00public"), "client": "mine"}.get(expected)
    if want is None:
        assert req.body == before and CACHE_SALT not in state and req.raw_body == b"{}"
    else:
        assert req.body["cache_salt"] == want and state.get(CACHE_SALT) == want
    counted = {"tenant": "tenant", "group": "group", "client": "client_kept",
               "none": "not_salted"}[expected]
    assert plugin.counts[counted] == 1 and sum(plugin.counts.values()) == 1


async def test_group_members_share_and_others_do_not() -> None:
    plugin = _plugin(share_groups={"public": ["acme", "globex"]})
    salts = {}
    for tenant in ("acme", "globex", "initech"):
        req = _req(tenant=tenant)
        await plugin.on_request(req, CycleState())
        salts[tenant] = req.body["cache_salt"]
    assert salts["acme"] == salts["globex"] != salts["initech"]


@pytest.mark.parametrize("lookup", [{"api-keys": _Auth(disabled=True)}, {}],
                         ids=["auth disabled", "no authenticator"])
async def test_inactive_without_auth(lookup: dict[str, object]) -> None:
    plugin = _plugin(lookup)
    req = _req(body={"cache_salt": "mine"})
    await plugin.on_request(req, CycleState())
    assert req.body == {"cache_salt": "mine"} and plugin.health()["injecting"] is False
    assert plugin.secret is None and plugin.counts["not_salted"] == 1
    enabled = _plugin({"api-keys": _Auth(disabled=False)})
    assert enabled.health() == {"secret": "env", "injecting": True, "client_salt": "replace",
                                "share_groups": {}}


def test_a_tenant_in_two_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="at most one group"):
        CacheSalt.Params.model_validate({"share_groups": {"a": ["x"], "b": ["x", "y"]}})


# -- kvgate's salted hashes vs vLLM 0.32 ----------------------------------------------------------
@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"{c['cache_salt']}-{c['lora']}")
def test_extra_keys_match_vllm_events(case: dict[str, Any]) -> None:
    """The extra keys kvgate attaches to a prompt's blocks are the ones vLLM publishes in its
    BlockStored events: the salt on the first block only, after the LoRA name."""
    n = len(FIXTURE["tokens"]) // FIXTURE["block_size"]
    ours = request_extra_keys(n, case["lora"], case["cache_salt"])
    theirs = case["event_extra_keys"] or [None] * n
    assert ours == [None if k is None else tuple(k) for k in theirs]


def test_vllm_salt_changes_every_block_of_the_chain() -> None:
    """The fact kvgate relies on: a salt in the first block's keys changes every block's hash
    (vLLM chains them), so differently salted prompts share nothing."""
    hashes = {(c["cache_salt"], c["lora"]): c["block_hashes"] for c in FIXTURE["cases"]}
    plain, a, b = hashes[(None, None)], hashes[("kvg1.tenant-a", None)], hashes[
        ("kvg1.tenant-b", None)]
    assert all(x != y != z != x for x, y, z in zip(plain, a, b, strict=True))


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"{c['cache_salt']}-{c['lora']}")
def test_index_matches_a_salted_prompt_only_with_its_salt(case: dict[str, Any]) -> None:
    """A BlockStored built from vLLM's own hashes and extra keys is found by the prompt hashed
    with the same salt (and LoRA), and by no other."""
    tokens, size = FIXTURE["tokens"], FIXTURE["block_size"]
    index = KvIndex(1000)
    extra = [None if k is None else tuple(k) for k in (case["event_extra_keys"] or [])] or None
    n = len(case["block_hashes"])
    assert index.store("e0", [bytes.fromhex(h) for h in case["block_hashes"]], None,
                       tokens[: n * size], size, extra_keys=extra) == n
    for other in FIXTURE["cases"]:
        found = index.match_tokens(tokens, 0.0, block_size=size, lora=other["lora"],
                                   cache_salt=other["cache_salt"])
        same = (other["cache_salt"], other["lora"]) == (case["cache_salt"], case["lora"])
        assert found == ({"e0": (n * size, 0)} if same else {})


# -- kvgate isolation (the operator's side) ---------------------------------------------------
def test_cli_recomputes_what_the_gateway_derives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVGATE_SECRET", "s" * 40)
    assert main(["isolation", "session-digest", "--tenant", "acme", "--model", "m",
                 "conv-1"]) == 0
    want = session_digest(SECRET.derive(SESSION_PURPOSE), session_key("acme", "m", "conv-1"))
    assert capsys.readouterr().out.strip() == want
    assert main(["isolation", "salt", "--group", "public"]) == 0
    assert capsys.readouterr().out.strip() == derive_salt(SECRET.derive(CACHE_SALT_PURPOSE),
                                                          "group\x00public")
    monkeypatch.delenv("KVGATE_SECRET")
    assert main(["isolation", "salt", "--tenant", "acme", "--secret-file",
                 str(tmp_path / "absent")]) == 2  # never creates a secret
    assert "no gateway secret" in capsys.readouterr().err
    assert not (tmp_path / "absent").exists()


def test_processes_starting_together_agree_on_one_secret(tmp_path: Path) -> None:
    """--workers siblings create the file at once: one generates it, all read the same."""
    path = str(tmp_path / "secret")
    with ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(lambda _: load_secret("UNSET", path, {}), range(8)))
    assert len({s.key for s in loaded}) == 1
    assert sum(s.source.startswith("generated") for s in loaded) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret"]  # no temporary file left


def test_replicas_in_different_directories_share_the_secret_through_redis(
        tmp_path: Path) -> None:
    from tests.servers import REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer()
    server.start()
    try:
        first, second = (load_secret(file=str(tmp_path / d / "secret"), environ={},
                                     redis_url=server.url) for d in ("a", "b"))
        assert first.key == second.key and first.source == "redis kvgate:gateway-secret"
        assert not (tmp_path / "a").exists()  # no file is written with shared state
        # the environment variable still wins over Redis
        env = load_secret(environ={"KVGATE_SECRET": "x" * 40}, redis_url=server.url)
        assert env.key == b"x" * 40
    finally:
        server.stop()
    with pytest.raises(ConfigError, match="unreachable") as failed:
        load_secret(file=str(tmp_path / "c"), environ={}, redis_url=server.url)
    assert server.url not in str(failed.value)
