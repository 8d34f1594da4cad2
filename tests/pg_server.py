"""A throwaway PostgreSQL server for tests (Debian's ``postgresql`` package: ``initdb`` /
``pg_ctl`` under /usr/lib/postgresql/*/bin; run as the ``postgres`` user when the tests run as
root). :func:`pg_server` skips the calling test, with the reason, when the server binaries or
psycopg are missing: ``apt-get install -y postgresql`` and ``pip install 'kvgate[postgres]'``.

Use it from a module-scoped fixture::

    @pytest.fixture(scope="module")
    def pg() -> Iterator[PgServer]:
        with pg_server() as server:
            yield server
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import free_port


def _pg_bin() -> Path | None:
    found = shutil.which("pg_ctl")
    candidates = [found] if found else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), reverse=True)
    for c in candidates:
        if (Path(c).parent / "initdb").exists():
            return Path(c).parent
    return None


class PgServer:
    """One throwaway cluster: trust auth on 127.0.0.1, socket in its data directory."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.run_as = "postgres" if os.geteuid() == 0 else None
        self.dir = Path(tempfile.mkdtemp(prefix="kvgate-pg-"))
        if self.run_as:
            user = pwd.getpwnam(self.run_as)
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        self.data = self.dir / "data"
        self.port = free_port()

    def _pg(self, tool: str, *args: str) -> None:
        cmd = [str(self.bindir / tool), *args]
        if self.run_as:
            cmd = ["runuser", "-u", self.run_as, "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)

    def init(self) -> None:
        self._pg("initdb", "-D", str(self.data), "-A", "trust", "-U", "kvgate", "-E", "UTF8",
                 "--no-sync")

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-o", opts,
                 "-w", "-t", "30", "start")

    def stop(self) -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://kvgate@127.0.0.1:{self.port}/{db}"

    def fresh_db(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def _skip_reason() -> str | None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is missing: pip install 'kvgate[postgres]'"
    if _pg_bin() is None:
        return "PostgreSQL server binaries not found (apt-get install -y postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and no 'postgres' user to run the server as"
        if shutil.which("runuser") is None:
            return "running as root and runuser is missing"
    return None


@contextlib.contextmanager
def pg_server() -> Iterator[PgServer]:
    """A started server, stopped and deleted afterwards (skips the test when impossible)."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    bindir = _pg_bin()
    assert bindir is not None
    server = PgServer(bindir)
    try:
        server.init()
        server.start()
        yield server
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)
