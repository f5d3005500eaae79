"""libpq's conventions for the password of a PostgreSQL URL without one: ``PGPASSWORD``, a
password file (``~/.pgpass``, ``PGPASSFILE``) and a service file (``PGSERVICEFILE``, with
``?service=`` in the URL or ``PGSERVICE``). ``batching init`` and ``status`` as a user runs
them, against a private PostgreSQL cluster that asks for a password (scram-sha-256): the
machine's shared server trusts every local connection, so it cannot tell. Without a password
the command fails with one line naming where to put it, never the password itself.

The cluster is the tests' own (:mod:`tests.pgcluster`): ``initdb`` and ``pg_ctl`` on a spare
loopback port, started once for the session. It skips only where the PostgreSQL server
binaries are not installed.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from tests.e2e.test_cli import Result, one_error_line
from tests.e2e.test_cli import batching as run_batching
from tests.pgcluster import PASSWORD, Cluster

LIBPQ_ENV = ("PGPASSWORD", "PGPASSFILE", "PGSERVICE", "PGSERVICEFILE", "PGUSER", "PGHOST")


@pytest.fixture
def cluster(pg_cluster: Cluster) -> Cluster:
    return pg_cluster


def batching(*args: str, cwd: Path, env: dict[str, str]) -> Result:
    """``batching ARGS`` without the libpq variables of the caller (an empty one is not unset:
    libpq looks for a service file named "")."""
    saved = {k: os.environ.pop(k) for k in LIBPQ_ENV if k in os.environ}
    try:
        return run_batching(*args, cwd=cwd, env=env)
    finally:
        os.environ.update(saved)


def init_and_status(url: str, cwd: Path, env: dict[str, str]) -> tuple[Result, Result]:
    init = batching("init", "--db", url, cwd=cwd, env=env)
    assert init.rc == 0, init.err
    assert "schema" in init.out
    status = batching("status", "--db", url, "--json", cwd=cwd, env=env)
    assert status.rc == 0, status.err
    assert "by_state" in status.json()
    for text in (init.out, init.err, status.out, status.err):
        assert PASSWORD not in text
    return init, status


def _secret_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)  # libpq ignores a password file others can read
    return path


def test_a_url_without_password_works_with_pgpassword(cluster: Cluster, tmp_path: Path) -> None:
    init, _ = init_and_status(cluster.url, tmp_path, cluster.env(PGPASSWORD=PASSWORD))
    assert f"scorer@127.0.0.1:{cluster.port}/scoring" in init.out  # the URL as given, no ***


def test_a_url_without_password_works_with_a_password_file(
    cluster: Cluster, tmp_path: Path
) -> None:
    line = f"127.0.0.1:{cluster.port}:scoring:scorer:{PASSWORD}\n"
    pgpass = _secret_file(tmp_path / "pgpass", line)
    init_and_status(cluster.url, tmp_path, cluster.env(PGPASSFILE=str(pgpass)))


def test_a_url_without_password_works_with_pgpass_in_home(cluster: Cluster, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    _secret_file(home / ".pgpass", f"127.0.0.1:{cluster.port}:*:scorer:{PASSWORD}\n")
    init_and_status(cluster.url, tmp_path, cluster.env(HOME=str(home)))


@pytest.mark.parametrize("how", ["url", "PGSERVICE"])
def test_a_service_names_the_server_and_the_password(
    cluster: Cluster, tmp_path: Path, how: str
) -> None:
    services = _secret_file(
        tmp_path / "pg_service.conf",
        f"[batching]\nhost=127.0.0.1\nport={cluster.port}\nuser=scorer\npassword={PASSWORD}\n",
    )
    env = cluster.env(PGSERVICEFILE=str(services))
    if how == "url":
        url = "postgresql+psycopg:///scoring?service=batching"
    else:
        url, env = "postgresql:///scoring", env | {"PGSERVICE": "batching"}
    init, _ = init_and_status(url, tmp_path, env)
    assert url.removeprefix("postgresql+psycopg://") in init.out


def test_without_a_password_it_fails_in_one_line_saying_where_to_put_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    for command in ("init", "status"):
        r = batching(command, "--db", cluster.url, cwd=tmp_path, env=cluster.env())
        assert r.rc == 1, (r.out, r.err)
        line = one_error_line(r)
        assert "no password supplied" in line
        assert "PGPASSWORD" in line
        assert "docs/operations.md" in line


def test_a_wrong_password_fails_in_one_line_without_it(cluster: Cluster, tmp_path: Path) -> None:
    wrong = "wrong-Pw 3"
    with contextlib.suppress(FileNotFoundError):
        (cluster.home / ".pgpass").unlink()
    for url, env in (
        (cluster.url, cluster.env(PGPASSWORD=wrong)),
        (f"{cluster.url}?password={wrong.replace(' ', '%20')}", cluster.env()),
    ):
        r = batching("status", "--db", url, cwd=tmp_path, env=env)
        assert r.rc == 1, (r.out, r.err)
        line = one_error_line(r)
        assert "password authentication failed" in line
        assert "wrong-Pw" not in r.out + r.err
        assert "%20" not in line


def test_a_password_in_the_url_query_works_and_is_never_shown(
    cluster: Cluster, tmp_path: Path
) -> None:
    url = f"{cluster.url}?password={PASSWORD.replace(' ', '%20')}"
    init, _ = init_and_status(url, tmp_path, cluster.env())
    assert "password=***" in init.out
    assert "scorer-Pw" not in init.out


def test_a_service_that_is_not_there_or_names_no_database_is_one_line(tmp_path: Path) -> None:
    """Neither needs a server: libpq refuses an unknown service before connecting, and a URL
    without a database is refused before libpq is asked."""
    services = _secret_file(tmp_path / "pg_service.conf", "[other]\nhost=127.0.0.1\n")
    env = {"HOME": str(tmp_path), "PGSERVICEFILE": str(services)}
    r = batching("status", "--db", "postgresql:///scoring?service=batching", cwd=tmp_path, env=env)
    assert r.rc == 1, (r.out, r.err)
    line = one_error_line(r)
    assert 'definition of service "batching" not found' in line
    assert "check the service name and the service file (PGSERVICEFILE" in line
    r = batching("init", "--db", "postgresql://?service=batching", cwd=tmp_path, env=env)
    assert r.rc == 2, (r.out, r.err)
    assert "postgresql:///DB?service=NAME" in one_error_line(r)
