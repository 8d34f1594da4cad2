"""``kvgate isolation``: what an operator recomputes from the gateway secret (same env var and
file as the gateway: ``KVGATE_SECRET``, else ``.kvgate/secret``; docs/operations.md "Tenant
isolation").

* ``kvgate isolation session-digest --tenant T --model M SESSION``: the ``session`` value the
  ledger holds for that session id (to find a session's records in ``kvgate usage export``).
* ``kvgate isolation salt --tenant T [--group G]``: the ``cache_salt`` the engines see for that
  tenant (or sharing group), e.g. to recognise it in KV events.

Neither creates a secret: with no env var and no file, they fail (exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvgate.plugins.load.session_affinity import session_key
from kvgate.plugins.tenancy.cache_salt import derive_salt, group_scope, tenant_scope
from kvgate.plugins.tenancy.gateway_secret import (
    CACHE_SALT_PURPOSE,
    DEFAULT_ENV,
    DEFAULT_FILE,
    SESSION_PURPOSE,
    GatewaySecret,
    load_secret,
    session_digest,
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    iso = sub.add_parser("isolation", help="recompute tenant cache salts and ledger session "
                         "digests from the gateway secret")
    isub = iso.add_subparsers(dest="isolation_command", required=True)
    d = isub.add_parser("session-digest", help="the ledger's session value for a session id")
    d.add_argument("session", help="the session header's value")
    d.add_argument("--tenant", required=True)
    d.add_argument("--model", required=True, help="the request's model as the gateway saw it")
    d.set_defaults(func=_digest)
    s = isub.add_parser("salt", help="the cache_salt of a tenant (or of a sharing group)")
    s.add_argument("--tenant", help="tenant name")
    s.add_argument("--group", help="share_groups name (instead of --tenant)")
    s.set_defaults(func=_salt)
    for p in (d, s):
        p.add_argument("--secret-env", default=DEFAULT_ENV)
        p.add_argument("--secret-file", default=DEFAULT_FILE)


def _secret(args: argparse.Namespace) -> GatewaySecret | None:
    if not os.environ.get(args.secret_env) and not Path(args.secret_file).exists():
        print(f"no gateway secret: {args.secret_env} is unset and {args.secret_file} does not "
              "exist", file=sys.stderr)
        return None
    return load_secret(args.secret_env, args.secret_file)


def _digest(args: argparse.Namespace) -> int:
    secret = _secret(args)
    if secret is None:
        return 2
    key = secret.derive(SESSION_PURPOSE)
    print(session_digest(key, session_key(args.tenant, args.model, args.session)))
    return 0


def _salt(args: argparse.Namespace) -> int:
    if (args.tenant is None) == (args.group is None):
        print("give exactly one of --tenant and --group", file=sys.stderr)
        return 2
    secret = _secret(args)
    if secret is None:
        return 2
    scope = tenant_scope(args.tenant) if args.group is None else group_scope(args.group)
    print(derive_salt(secret.derive(CACHE_SALT_PURPOSE), scope))
    return 0
