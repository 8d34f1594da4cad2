"""``kvgate keys create``: make an API key, store its hash in a keys file, print it once."""

from __future__ import annotations

import argparse
import sys
from decimal import Decimal
from pathlib import Path

import yaml

from plugins.auth import KeysFile, format_entry, new_key


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="manage API keys (stored hashed in a keys file)")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    p = ksub.add_parser("create", help="create a key; prints it once")
    p.add_argument("--file", required=True, help="keys file (created if missing)")
    p.add_argument("--tenant", required=True)
    p.add_argument("--id", help="key id (default <tenant>-<n>)")
    p.add_argument("--model", action="append", default=[], help="allowed model (repeatable)")
    p.add_argument("--admin", action="store_true", help="may read the usage API")
    p.add_argument("--budget-usd", type=Decimal, help="spend limit in USD")
    p.set_defaults(func=_create)


def _create(args: argparse.Namespace) -> int:
    path = Path(args.file)
    data = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    entries = list((data or {}).get("keys", []))
    key = new_key()
    key_id = args.id or f"{args.tenant}-{len(entries) + 1}"
    entry = format_entry(key_id, args.tenant, key, args.model, args.admin)
    if args.budget_usd is not None:
        entry["budget_usd"] = str(args.budget_usd)
    KeysFile.model_validate({"keys": [*entries, entry]})  # refuses duplicates / bad values
    path.write_text(yaml.safe_dump({"keys": [*entries, entry]}, sort_keys=False), "utf-8")
    print(f"created key {key_id!r} for tenant {args.tenant!r} in {path}", file=sys.stderr)
    print(key)
    return 0
