"""A private PostgreSQL cluster for the tests that must do to a server what no test may do to the
machine's shared one: ask for a password (scram-sha-256), revoke a role's login, terminate
every backend, restart the server.

``initdb`` and ``pg_ctl`` on a spare loopback port, started once per test session (a few
seconds) on the first test that asks for :func:`pg_cluster`, stopped at the end. Run as root,
the server runs as ``postgres`` (it refuses root) from a folder that user can reach. It skips
only where the PostgreSQL server binaries are not installed (``BATCHING_TEST_PG_BIN`` names
another folder), and fails instead in CI.

Each test takes its own database (:meth:`Cluster.database`) and, when it changes a role, its
own role (:meth:`Cluster.role`): the cluster is shared by the session.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

PG_BIN = Path(os.environ.get("BATCHING_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
ADMIN_PASSWORD = "admin-Pw-1"
ROLE = "scorer"
PASSWORD = "scorer-Pw 2"  # a space: libpq's files must quote nothing for it
DATABASE = "scoring"  # owned by ROLE


@dataclass(frozen=True)
class Cluster:
    """A running private cluster: ``postgres`` (superuser, :data:`ADMIN_PASSWORD`) and the
    login role :data:`ROLE` (:data:`PASSWORD`), owner of the database :data:`DATABASE`."""

    port: int
    root: Path
    owner: str | None  # the OS user the server runs as (None: this one)
    home: Path  # a HOME without a .pgpass: the tests choose where passwords come from

    @property
    def url(self) -> str:
        """:data:`DATABASE` as :data:`ROLE`, without its password (libpq finds it)."""
        return f"postgresql+psycopg://{ROLE}@127.0.0.1:{self.port}/{DATABASE}"

    def env(self, **values: str) -> dict[str, str]:
        """What a command's environment sets: a HOME without a password file, then ``values``."""
        return {"HOME": str(self.home)} | values

    def url_for(self, database: str, role: str = ROLE, password: str = PASSWORD) -> str:
        """A SQLAlchemy URL with the password in it."""
        return (
            f"postgresql+psycopg://{role}:{quote(password, safe='')}"
            f"@127.0.0.1:{self.port}/{database}"
        )

    def sql(
        self, statement: str, *params: Any, database: str = "postgres"
    ) -> list[tuple[Any, ...]]:
        """Run ``statement`` as the superuser (autocommit); its rows, if it returns any."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            password=ADMIN_PASSWORD,
            dbname=database,
            autocommit=True,
        ) as conn:
            cur = conn.execute(statement, params or None)
            return list(cur.fetchall()) if cur.description else []

    def role(self, prefix: str = "drill", password: str = PASSWORD) -> str:
        """A new login role with ``password``: a test that revokes a login revokes its own."""
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        self.sql(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
        return name

    def database(self, owner: str = ROLE, prefix: str = "t") -> str:
        """A new empty database owned by ``owner``; its name."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self.sql(f'CREATE DATABASE "{name}" OWNER {owner}')
        return name

    def terminate(self, *, role: str | None = None, database: str | None = None) -> int:
        """``pg_terminate_backend`` every client backend of ``role`` / ``database``; how many."""
        where = ["pid <> pg_backend_pid()", "backend_type = 'client backend'"]
        params: list[str] = []
        if role is not None:
            where.append("usename = %s")
            params.append(role)
        if database is not None:
            where.append("datname = %s")
            params.append(database)
        rows = self.sql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE "
            + " AND ".join(where),
            *params,
        )
        return int(rows[0][0])

    def pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``pg_ctl -D DATA -l LOG -w ARGS`` as the server's user."""
        base = [str(PG_BIN / "pg_ctl"), "-D", str(self.root / "data"), "-l", str(self.log), "-w"]
        done = subprocess.run(
            _as_owner([*base, *args], self.owner),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check:
            assert done.returncode == 0, f"pg_ctl {' '.join(args)}: {done.stdout}{done.stderr}"
        return done

    @property
    def log(self) -> Path:
        return self.root / "log"

    def start(self) -> None:
        self.pg_ctl("-o", self._options(), "start")

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("-m", mode, "stop")

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m MODE``: every connection is cut, the server is back when it
        returns."""
        self.pg_ctl("-m", mode, "-o", self._options(), "restart")

    def _options(self) -> str:
        sockets = self.root / "sockets"
        return f"-p {self.port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off"


def _spare_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_owner(args: list[str], owner: str | None) -> list[str]:
    """``args`` run as ``owner`` (the server refuses to run as root)."""
    return ["runuser", "-u", owner, "--", *args] if owner else args


def _run(args: list[str], owner: str | None) -> None:
    done = subprocess.run(_as_owner(args, owner), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{args[0]} failed: {done.stdout}{done.stderr}"


def start_cluster(root: Path) -> Cluster:
    """``initdb`` in ``root`` (password auth only), start it, create :data:`ROLE` and
    :data:`DATABASE`. The caller stops it (:meth:`Cluster.stop`)."""
    owner = "postgres" if os.geteuid() == 0 else None
    data, sockets, pwfile, home = root / "data", root / "sockets", root / "pw", root / "home"
    sockets.mkdir()
    home.mkdir()
    pwfile.write_text(ADMIN_PASSWORD + "\n")
    if owner:
        for path in (root, sockets, pwfile):
            shutil.chown(path, owner)
    initdb = [str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--no-sync"]
    initdb += ["--auth=scram-sha-256", f"--pwfile={pwfile}", "--no-instructions"]
    _run(initdb, owner)
    cluster = Cluster(_spare_port(), root, owner, home)
    cluster.start()
    cluster.sql(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}'")
    cluster.sql(f"CREATE DATABASE {DATABASE} OWNER {ROLE}")
    return cluster


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Cluster]:
    """The session's private cluster (see the module docstring)."""
    if not (PG_BIN / "initdb").is_file():
        reason = f"no PostgreSQL server binaries in {PG_BIN} (set BATCHING_TEST_PG_BIN)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI needs them)")
        pytest.skip(reason)
    # Not under pytest's temporary folder: the server's user must reach it (pytest's is 0700).
    root = Path(tempfile.mkdtemp(prefix="batching-pgcluster-"))
    cluster = None
    try:
        cluster = start_cluster(root)
        yield cluster
    finally:
        if cluster is not None:
            cluster.pg_ctl("-m", "immediate", "stop", check=False)
        shutil.rmtree(root, ignore_errors=True)
