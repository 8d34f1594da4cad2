"""``kvgate keys``: API keys from the command line.

Offline, on a keys file (no gateway needed)::

    kvgate keys create --file keys.yaml --tenant acme [--id ID] [--model M ...] [--admin]
                       [--budget-usd X]

Online, through a running gateway's admin API (plugins/tenancy/keys_admin.py; an admin key)::

    kvgate keys list [--tenant T] [--json]
    kvgate keys create --tenant acme [--id ID] [--model M ...] [--admin] [--budget-usd X]
    kvgate keys revoke ID
    kvgate keys rotate ID [--grace-s S]
    kvgate keys set-limits (ID | --tenant T) [--requests-per-min N] [--input-tokens-per-min N]
                       [--output-tokens-per-min N] [--max-concurrent N] [--budget-usd X]
                       [--clear]
    kvgate keys reload

Common: ``--base-url`` (default ``$KVGATE_BASE_URL`` or ``http://127.0.0.1:8080``; a trailing
``/v1`` is dropped), ``--api-key`` (default ``$KVGATE_ADMIN_KEY``, then ``$KVGATE_API_KEY``;
never printed). A new secret (create, rotate) is printed alone on standard output, once; what
happened goes to standard error. Exit status: 0 done, 1 the gateway refused (its OpenAI-shaped
error is printed), 2 usage or connection error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from kvgate.plugins.tenancy.keys_model import KeysFile, utcnow
from kvgate.plugins.tenancy.keys_store import NewKey, create_key, update_file

DEFAULT_BASE_URL = "http://127.0.0.1:8080"
LIMITS = ("requests_per_min", "input_tokens_per_min", "output_tokens_per_min", "max_concurrent")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="manage API keys (a keys file, or a gateway's admin API)")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    p = _online(ksub.add_parser("create", help="create a key; prints it once"))
    p.add_argument("--file", help="offline: keys file (created if missing)")
    p.add_argument("--tenant", required=True)
    p.add_argument("--id", help="key id (default <tenant>-<n>)")
    p.add_argument("--model", action="append", default=[], help="allowed model (repeatable)")
    p.add_argument("--admin", action="store_true", help="may use the admin and usage APIs")
    p.add_argument("--budget-usd", type=Decimal, help="spend limit in USD")
    p.set_defaults(func=_create)
    p = _online(ksub.add_parser("list", help="list keys (never secrets)"))
    p.add_argument("--tenant")
    p.add_argument("--json", action="store_true", help="the API's JSON")
    p.set_defaults(func=_list)
    p = _online(ksub.add_parser("revoke", help="revoke a key (refused at once, everywhere)"))
    p.add_argument("key_id")
    p.set_defaults(func=_revoke)
    p = _online(ksub.add_parser("rotate", help="new secret for a key; prints it once"))
    p.add_argument("key_id")
    p.add_argument("--grace-s", type=float, default=0.0,
                   help="seconds the old secret keeps working (default 0)")
    p.set_defaults(func=_rotate)
    p = _online(ksub.add_parser("set-limits", help="set a key's or a tenant's limits, budget"))
    p.add_argument("key_id", nargs="?")
    p.add_argument("--tenant", help="set the tenant's (shared by its keys) instead")
    for name in LIMITS:
        p.add_argument("--" + name.replace("_", "-"), type=int, metavar="N")
    p.add_argument("--budget-usd", type=Decimal)
    p.add_argument("--clear", action="store_true", help="start from no limits and no budget")
    p.set_defaults(func=_set_limits)
    p = _online(ksub.add_parser("reload", help="reload keys, catalog and prices everywhere"))
    p.set_defaults(func=_reload)


def _online(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", default=os.environ.get("KVGATE_BASE_URL", DEFAULT_BASE_URL))
    p.add_argument("--api-key", default=os.environ.get("KVGATE_ADMIN_KEY")
                   or os.environ.get("KVGATE_API_KEY"), help="an admin key")
    return p


class _Refused(Exception):
    pass


def _call(args: argparse.Namespace, method: str, path: str,
          body: dict[str, Any] | None = None) -> Any:
    base = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers["content-type"] = "application/json"
    req = Request(f"{base}/v1/admin{path}", data=data, headers=headers, method=method)
    try:  # the standard library: the base install has no HTTP client of its own to spare
        with urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except HTTPError as exc:
        print(f"kvgate keys: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        raise _Refused from exc


def _run(args: argparse.Namespace, fn: Any) -> int:
    try:
        return int(fn(args))
    except _Refused:
        return 1
    except (URLError, OSError) as exc:
        print(f"kvgate keys: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 2


def _secret(obj: dict[str, Any], what: str) -> int:
    print(f"{what} key {obj['id']!r} for tenant {obj['tenant']!r}", file=sys.stderr)
    print(obj["key"])
    return 0


def _create(args: argparse.Namespace) -> int:
    fields: dict[str, Any] = {"tenant": args.tenant, "admin": args.admin}
    if args.id:
        fields["id"] = args.id
    if args.model:
        fields["models"] = args.model
    if args.budget_usd is not None:
        fields["budget_usd"] = str(args.budget_usd)
    if args.file is None:
        return _run(args, lambda a: _secret(_call(a, "POST", "/keys", fields), "created"))
    made: list[NewKey] = []
    path = Path(args.file)
    update_file(path, lambda parsed: create_key(parsed, fields, utcnow(), made))
    print(f"created key {made[-1].entry.id!r} for tenant {args.tenant!r} in {path}",
          file=sys.stderr)
    print(made[-1].secret)
    return 0


def _list(args: argparse.Namespace) -> int:
    def run(a: argparse.Namespace) -> int:
        out = _call(a, "GET", "/keys" + (f"?tenant={a.tenant}" if a.tenant else ""))
        if a.json:
            print(json.dumps(out, indent=2))
            return 0
        print(f"{'ID':24} {'TENANT':16} {'STATUS':8} {'ADMIN':5} {'BUDGET':>10}  MODELS")
        for k in out["data"]:
            print(f"{k['id']:24} {k['tenant']:16} {k['status']:8} {k['admin']!s:5} "
                  f"{k['budget_usd'] or '-':>10}  {','.join(k['models'] or ['*'])}")
        return 0
    return _run(args, run)


def _revoke(args: argparse.Namespace) -> int:
    def run(a: argparse.Namespace) -> int:
        _call(a, "POST", f"/keys/{a.key_id}/revoke")
        print(f"revoked key {a.key_id!r}", file=sys.stderr)
        return 0
    return _run(args, run)


def _rotate(args: argparse.Namespace) -> int:
    return _run(args, lambda a: _secret(
        _call(a, "POST", f"/keys/{a.key_id}/rotate", {"grace_s": a.grace_s}), "rotated"))


def _set_limits(args: argparse.Namespace) -> int:
    if (args.key_id is None) == (args.tenant is None):
        print("kvgate keys set-limits: give a key id or --tenant, not both", file=sys.stderr)
        return 2

    def run(a: argparse.Namespace) -> int:
        current: dict[str, Any]
        if a.tenant is not None:
            current = next((t for t in _call(a, "GET", "/tenants")["data"]
                            if t["id"] == a.tenant), {"limits": {}, "budget_usd": None})
            path, method = f"/tenants/{a.tenant}", "PUT"
        else:
            current = _call(a, "GET", f"/keys/{a.key_id}")
            path, method = f"/keys/{a.key_id}", "PATCH"
        limits = {} if a.clear else dict(current["limits"])
        limits.update({n: getattr(a, n) for n in LIMITS if getattr(a, n) is not None})
        budget = None if a.clear else current["budget_usd"]
        if a.budget_usd is not None:
            budget = str(a.budget_usd)
        out = _call(a, method, path, {"limits": limits, "budget_usd": budget})
        print(json.dumps(out, indent=2))
        return 0
    return _run(args, run)


def _reload(args: argparse.Namespace) -> int:
    return _run(args, lambda a: print(json.dumps(_call(a, "POST", "/reload"), indent=2)) or 0)


__all__ = ["KeysFile", "register"]
