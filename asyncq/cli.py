"""``kvgate batch ...``: the OpenAI Batch API from the command line, through the ``openai`` SDK
against any kvgate (or OpenAI-compatible) server.

    kvgate batch submit FILE --endpoint /v1/chat/completions [--wait] [--metadata K=V ...]
    kvgate batch status ID
    kvgate batch cancel ID
    kvgate batch results ID [-o FILE] [--errors]
    kvgate batch list [--limit N]

Common: ``--base-url`` (default ``$KVGATE_BASE_URL`` or ``http://127.0.0.1:8080``; ``/v1`` is
added when missing), ``--api-key`` (default ``$KVGATE_API_KEY``, then ``$OPENAI_API_KEY``;
never printed). ``--wait`` polls every ``--poll`` seconds (default 2) and shows a progress bar
(tqdm when installed, a plain line per change otherwise) until the batch is terminal; the exit
status is 0 for ``completed``, 1 for ``failed`` / ``expired`` / ``cancelled``, 2 for a usage or
connection error. ``results`` streams the output (or ``--errors``: error) file to ``-o FILE``
(written to a temporary name and renamed) or standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import openai

from kvgate.asyncq.batch.lines import ENDPOINTS

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
DEFAULT_BASE_URL = "http://127.0.0.1:8080"


def _sdk() -> ModuleType:
    """The ``openai`` SDK, an extra (``pip install 'kvgate[batch]'``): imported when a ``batch``
    command runs, so that ``kvgate --help`` and the server need none of it."""
    try:
        import openai as sdk
    except ImportError as exc:
        raise SystemExit("kvgate batch needs the openai SDK: pip install 'kvgate[batch]'") from exc
    return sdk


class Progress(Protocol):
    def update(self, done: int, total: int, status: str) -> None: ...

    def close(self) -> None: ...


class _Lines:
    """Plain progress: one line whenever the counts or the status change."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.last: tuple[int, int, str] | None = None

    def update(self, done: int, total: int, status: str) -> None:
        if (done, total, status) != self.last:
            self.last = (done, total, status)
            print(f"{status}: {done}/{total} requests done", file=self.out, flush=True)

    def close(self) -> None:
        return None


class _Bar:
    def __init__(self, out: Any) -> None:
        from tqdm import tqdm
        self.bar = tqdm(total=0, unit="req", file=out, dynamic_ncols=True)

    def update(self, done: int, total: int, status: str) -> None:
        self.bar.total = total
        self.bar.n = done
        self.bar.set_description(status)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def progress(out: Any) -> Progress:
    try:
        return _Bar(out)
    except ImportError:
        return _Lines(out)


def client_of(args: argparse.Namespace) -> openai.OpenAI:
    base = (args.base_url or os.environ.get("KVGATE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    key = args.api_key or os.environ.get("KVGATE_API_KEY") or os.environ.get(
        "OPENAI_API_KEY") or "none"
    client: openai.OpenAI = _sdk().OpenAI(base_url=base, api_key=key, max_retries=2,
                                          timeout=args.timeout)
    return client


def _print(obj: Any) -> None:
    print(json.dumps(obj.model_dump(mode="json", exclude_none=True), indent=2))


def _metadata(pairs: list[str] | None) -> dict[str, str] | None:
    if not pairs:
        return None
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"kvgate batch: --metadata wants KEY=VALUE, not {pair!r}")
        out[key] = value
    return out


def wait(client: openai.OpenAI, batch_id: str, poll_s: float, show: Progress,
         sleep: Callable[[float], None] = time.sleep) -> Any:
    """Poll until the batch is terminal; the last batch object."""
    try:
        while True:
            batch = client.batches.retrieve(batch_id)
            counts = batch.request_counts
            total = counts.total if counts else 0
            done = (counts.completed + counts.failed) if counts else 0
            show.update(done, total, batch.status)
            if batch.status in TERMINAL:
                return batch
            sleep(poll_s)
    finally:
        show.close()


def cmd_submit(args: argparse.Namespace) -> int:
    client = client_of(args)
    path = Path(args.file)
    with path.open("rb") as f:
        uploaded = client.files.create(file=(path.name, f), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=args.endpoint,
                                  completion_window=args.completion_window,
                                  metadata=_metadata(args.metadata))
    print(batch.id, flush=True)
    if not args.wait:
        return 0
    final = wait(client, batch.id, args.poll, progress(sys.stderr))
    _print(final)
    return 0 if final.status == "completed" else 1


def cmd_status(args: argparse.Namespace) -> int:
    _print(client_of(args).batches.retrieve(args.batch_id))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    _print(client_of(args).batches.cancel(args.batch_id))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    for batch in client_of(args).batches.list(limit=args.limit).data:
        counts = batch.request_counts
        done = f"{counts.completed}/{counts.total}" if counts else "-"
        print(f"{batch.id}\t{batch.status}\t{batch.endpoint}\t{done}")
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    client = client_of(args)
    batch = client.batches.retrieve(args.batch_id)
    file_id = batch.error_file_id if args.errors else batch.output_file_id
    if file_id is None:
        which = "error" if args.errors else "output"
        print(f"kvgate batch: batch {batch.id} ({batch.status}) has no {which} file",
              file=sys.stderr)
        return 1
    with client.files.with_streaming_response.content(file_id) as resp:
        if args.output is None:
            for chunk in resp.iter_bytes():
                sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            return 0
        out = Path(args.output)
        tmp = out.with_name(out.name + ".part")
        with tmp.open("wb") as f:
            for chunk in resp.iter_bytes():
                f.write(chunk)
        tmp.replace(out)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="server URL (default $KVGATE_BASE_URL or "
                   f"{DEFAULT_BASE_URL}; /v1 added when missing)")
    p.add_argument("--api-key", help="API key (default $KVGATE_API_KEY, then $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="per HTTP call (s)")


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        sdk = _sdk()
        try:
            return fn(args)
        except sdk.APIStatusError as exc:
            print(f"kvgate batch: HTTP {exc.status_code}: {exc.message}", file=sys.stderr)
            return 2
        except sdk.APIConnectionError as exc:
            print(f"kvgate batch: cannot reach the server: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"kvgate batch: {exc}", file=sys.stderr)
            return 2
    return run


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``batch`` and its subcommands to the ``kvgate`` parser."""
    batch = sub.add_parser("batch", help="OpenAI Batch API: submit, status, cancel, results")
    bsub = batch.add_subparsers(dest="batch_command", required=True)
    p = bsub.add_parser("submit", help="upload a JSONL file and create a batch")
    p.add_argument("file", help="JSONL input: one {custom_id, method, url, body} per line")
    p.add_argument("--endpoint", required=True, choices=ENDPOINTS)
    p.add_argument("--completion-window", default="24h", choices=["24h"])
    p.add_argument("--metadata", action="append", metavar="KEY=VALUE")
    p.add_argument("--wait", action="store_true", help="poll with a progress bar until done")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between polls (--wait)")
    p.set_defaults(func=_guarded(cmd_submit))
    for name, fn, text in (("status", cmd_status, "print the batch object"),
                           ("cancel", cmd_cancel, "cancel the batch")):
        q = bsub.add_parser(name, help=text)
        q.add_argument("batch_id")
        q.set_defaults(func=_guarded(fn))
        _common(q)
    r = bsub.add_parser("results", help="download the output (or error) file")
    r.add_argument("batch_id")
    r.add_argument("-o", "--output", help="write to FILE (default: standard output)")
    r.add_argument("--errors", action="store_true", help="the error file instead")
    r.set_defaults(func=_guarded(cmd_results))
    ls = bsub.add_parser("list", help="the most recent batches")
    ls.add_argument("--limit", type=int, default=20)
    ls.set_defaults(func=_guarded(cmd_list))
    for q in (p, r, ls):
        _common(q)
