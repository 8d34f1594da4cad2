"""The key stores and operations (plugins/tenancy/keys_store.py), the key index's grace period
(plugins/tenancy/keys_model.py) and keep-last-good reloads (plugins/common/reload.py): through their real
interfaces, with a real redis-server for the Redis store."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.middleware.framework.errors import ConfigError, HTTPError, NotFound
from kvgate.plugins.common.reload import FileReloader
from kvgate.plugins.tenancy.keys_model import (
    KeysFile,
    Limits,
    build_index,
    hash_key,
    read_keys_file,
)
from kvgate.plugins.tenancy.keys_store import (
    Conflict,
    FileKeyStore,
    NewKey,
    RedisKeyStore,
    create_key,
    patch_key,
    revoke_key,
    rotate_key,
    set_tenant,
    update_file,
)
from tests.servers import RedisServer

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _made(parsed: KeysFile, **fields: Any) -> tuple[KeysFile, NewKey]:
    out: list[NewKey] = []
    new = create_key(parsed, {"tenant": "acme", **fields}, T0, out)
    return new, out[-1]


def test_create_revoke_rotate_patch_tenant() -> None:
    kf, first = _made(KeysFile())
    kf, second = _made(kf, id="mine", models=["m"], limits={"requests_per_min": 5})
    assert [k.id for k in kf.keys] == ["acme-1", "mine"]
    index = build_index(kf)
    assert index.lookup(hash_key(first.secret), 0)
    assert index.by_id["mine"].limits == Limits(requests_per_min=5)
    assert index.lookup(hash_key(second.secret), 0) == index.by_id["mine"]
    with pytest.raises(Conflict):
        _made(kf, id="mine")
    kf = patch_key(kf, "mine", {"budget_usd": Decimal("3"), "models": None})
    assert build_index(kf).by_id["mine"].budget_usd == Decimal("3")
    assert build_index(kf).by_id["mine"].models is None
    kf = set_tenant(kf, "acme", Decimal("9"), Limits(max_concurrent=2))
    assert build_index(kf).by_id["mine"].tenant_limits == Limits(max_concurrent=2)
    revoked = revoke_key(kf, "acme-1", T0)
    assert revoke_key(revoked, "acme-1", T0) == revoked  # idempotent
    assert build_index(revoked).lookup(hash_key(first.secret), 0) is None
    assert "acme-1" not in build_index(revoked).by_id
    with pytest.raises(Conflict):  # ids are never reused
        _made(revoked, id="acme-1")
    with pytest.raises(Conflict):
        rotate_key(revoked, "acme-1", 0, T0, [])
    with pytest.raises(NotFound):
        revoke_key(kf, "nope", T0)


@pytest.mark.parametrize(("grace_s", "at_s", "old_works"), [
    (0, 0, False), (60, 0, True), (60, 59.9, True), (60, 60, False)])
def test_rotation_grace_period(grace_s: float, at_s: float, old_works: bool) -> None:
    kf, made = _made(KeysFile())
    out: list[NewKey] = []
    kf = rotate_key(kf, "acme-1", grace_s, T0, out)
    index = build_index(kf)
    now = T0.timestamp() + at_s
    assert (index.lookup(hash_key(made.secret), now) is not None) is old_works
    assert index.lookup(hash_key(out[-1].secret), now) == index.by_id["acme-1"]
    # a revoke ends the grace period too
    assert build_index(revoke_key(kf, "acme-1", T0)).lookup(hash_key(made.secret), now) is None


async def test_file_store_writes_atomically_and_keeps_tenants(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("# hand-written\ntenants: {acme: {budget_usd: '5'}}\n")
    store = FileKeyStore(path)
    before = await store.token()
    made: list[NewKey] = []
    await store.update(lambda kf: create_key(kf, {"tenant": "acme"}, T0, made))
    assert await store.token() != before
    on_disk = read_keys_file(path)
    assert on_disk.tenants["acme"].budget_usd == Decimal("5")
    assert [k.sha256 for k in on_disk.keys] == [hash_key(made[0].secret)]
    assert made[0].secret not in path.read_text()  # hashed only
    assert sorted(await asyncio.to_thread(os.listdir, tmp_path)) == ["keys.yaml", "keys.yaml.lock"]
    with pytest.raises(HTTPError) as err:  # a refused change writes nothing
        await store.update(lambda kf: revoke_key(kf, "nope", T0))
    assert err.value.status == 404
    assert read_keys_file(path) == on_disk


class _Target:
    """A Reloadable over one YAML file holding a positive integer."""

    def __init__(self, path: Path) -> None:
        self.path, self.value = path, 0

    def watched(self) -> tuple[Path, ...]:
        return (self.path,)

    def load_new(self) -> object:
        value = yaml.safe_load(self.path.read_text())
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{self.path}: not a positive integer")
        return value

    def commit(self, new: object) -> str:
        assert isinstance(new, int)
        self.value = new
        return str(new)


@pytest.mark.parametrize(("writes", "final", "failed"), [
    (["1"], 1, 0), (["1", "oops"], 1, 1), (["1", "-2", "3"], 3, 1), (["x", "y"], 0, 2)])
async def test_reload_keeps_last_good(tmp_path: Path, writes: list[str], final: int,
                                      failed: int) -> None:
    path = tmp_path / "v.yaml"
    path.write_text("0")
    target = _Target(path)
    reloader = FileReloader("t", target)
    for i, text in enumerate(writes):
        path.write_text(text + "\n" * (i + 1))  # the size changes: seen even within one mtime
        await reloader.poll()
    assert (target.value, reloader.status.failed) == (final, failed)
    assert (reloader.status.error is not None) is (writes[-1] in ("oops", "y"))
    await reloader.poll()  # nothing changed: nothing re-read
    assert reloader.status.failed == failed


async def test_an_empty_watched_file_is_a_failed_reload_until_it_is_written(
        tmp_path: Path) -> None:
    path = tmp_path / "v.yaml"
    path.write_text("1")
    target = _Target(path)
    reloader = FileReloader("t", target)
    await reloader.reload()
    path.write_text("")  # truncated by a writer that has not written yet
    await reloader.poll()
    assert target.value == 1 and reloader.status.failed == 1
    assert "empty" in (reloader.status.error or "")
    path.write_text("2\n")
    await reloader.poll()
    assert (target.value, reloader.status.error) == (2, None)


@pytest.mark.parametrize("text", ["", "\n", "# keys written below\n"])
def test_an_empty_keys_file_is_refused_not_read_as_no_keys(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="keys file is empty"):
        read_keys_file(path)
    with pytest.raises(ConfigError, match="keys file is empty"):  # nor overwritten by a change
        update_file(path, lambda kf: kf)
    assert path.read_text() == text
    path.write_text("keys: []\n")
    assert read_keys_file(path).keys == ()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[Any]:
    from redis.asyncio import Redis
    client = Redis.from_url(redis_server.url, socket_timeout=2)
    yield client
    await client.aclose()


async def test_redis_store_seeds_once_and_writes_concurrently(redis_client: Any) -> None:
    seed, made = _made(KeysFile())
    seed = set_tenant(seed, "acme", Decimal("7"), Limits())
    store = RedisKeyStore(redis_client, "t:")
    assert await store.seed(seed) is True
    assert await store.seed(KeysFile()) is False  # seeded already: the second file is ignored
    version, got = await store.read()
    assert (version, got) == (1, seed)

    async def add(i: int) -> None:
        await store.update(lambda kf: create_key(kf, {"tenant": "t", "id": f"k{i}"}, T0, []))
    await asyncio.gather(*(add(i) for i in range(8)))  # optimistic retries: none lost
    version, got = await store.read()
    assert version == 9 and {k.id for k in got.keys} == {"acme-1", *(f"k{i}" for i in range(8))}
    await store.update(lambda kf: revoke_key(kf, "acme-1", T0))
    assert build_index((await store.read())[1]).lookup(hash_key(made.secret), 0) is None
    assert await store.tokens() == (10, 0)
    assert await store.bump_reload() == 1


async def test_redis_store_bad_data_is_a_config_error(redis_client: Any) -> None:
    store = RedisKeyStore(redis_client, "t:")
    await redis_client.hset("t:entries", "x", "{not json")
    with pytest.raises(ConfigError, match="invalid keys in Redis"):
        await store.read()
