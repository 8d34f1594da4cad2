"""The revocation list's rules (plugins/tenancy/keys_revoked.py): what a key set refuses, what a
rotation replaced, how a list applies to keys and to the index, and the file's merge."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest

from kvgate.middleware.framework.errors import ConfigError
from kvgate.plugins.tenancy.keys_model import KeyEntry, KeysFile, build_index, hash_key
from kvgate.plugins.tenancy.keys_revoked import (
    Refusal,
    Revocations,
    read_list,
    refusals,
    replaced,
    write_list,
)

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
A, B, C = hash_key("a"), hash_key("b"), hash_key("c")


def _key(sha: str, **more: object) -> KeyEntry:
    return KeyEntry.model_validate({"id": "k1", "tenant": "acme", "sha256": sha, **more})


def _refused(sha: str, at: dt.datetime) -> dict[str, Refusal]:
    return {sha: Refusal(sha256=sha, id="k1", at=at)}


def test_refusals_are_revoked_keys_and_rotated_out_secrets() -> None:
    revoked = KeysFile(keys=(_key(A, revoked_at=NOW),))
    assert refusals(revoked) == _refused(A, NOW)
    later = NOW + dt.timedelta(hours=1)
    graced = KeysFile(keys=(_key(B, previous_sha256=A, previous_valid_until=later),))
    assert refusals(graced) == _refused(A, later)


def test_a_replaced_secret_is_a_rotation_a_removed_key_is_not() -> None:
    old = KeysFile(keys=(_key(A), KeyEntry(id="k2", tenant="acme", sha256=C)))
    assert replaced(old, KeysFile(keys=(_key(B),)), NOW) == _refused(A, NOW)


def test_apply_revokes_a_listed_secret_and_ends_a_grace_period_early() -> None:
    past, future = NOW - dt.timedelta(days=1), NOW + dt.timedelta(days=1)
    listed = Revocations(None, {**_refused(A, past), **_refused(C, NOW)})
    keys = KeysFile(keys=(_key(A),))
    applied = listed.apply(keys, NOW)
    assert applied.keys[0].revoked_at == past
    assert listed.apply(KeysFile(keys=(_key(B),)), NOW).keys == (_key(B),)  # unchanged
    graced = KeysFile(keys=(_key(B, previous_sha256=C, previous_valid_until=future),))
    assert listed.apply(graced, NOW).keys[0].previous_sha256 is None
    early = Revocations(None, _refused(C, NOW + dt.timedelta(hours=1)))
    assert early.apply(graced, NOW).keys[0].previous_valid_until == NOW + dt.timedelta(hours=1)


def test_cap_bounds_a_secret_listed_for_later() -> None:
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)
    listed = Revocations(None, _refused(A, soon))
    now = dt.datetime.now(dt.UTC)
    index = listed.cap(build_index(listed.apply(KeysFile(keys=(_key(A),)), now)))
    assert index.lookup(A, time.time()) is not None
    assert index.lookup(A, soon.timestamp() + 1) is None


def test_the_file_merges_and_the_earliest_time_wins(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml.revoked"
    assert read_list(path) == (None, {})
    write_list(path, _refused(A, NOW))
    write_list(path, {**_refused(A, NOW - dt.timedelta(days=1)), **_refused(B, NOW)})
    write_list(path, _refused(A, NOW + dt.timedelta(days=1)))
    listed = read_list(path)[1]
    assert listed[A].at == NOW - dt.timedelta(days=1) and listed[B].at == NOW
    path.write_text("revoked: nope")
    with pytest.raises(ConfigError, match="invalid revocation list"):
        Revocations.load(path)
