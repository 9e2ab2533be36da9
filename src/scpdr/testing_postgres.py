"""A throwaway PostgreSQL cluster for tests, benchmarks and ``.ci/run`` only (never the server).

:func:`start_cluster` runs the system's ``initdb`` and ``pg_ctl`` (found on ``PATH`` or under
``/usr/lib/postgresql/*/bin``) into a fresh temporary directory: trust authentication for the
user ``scpdr``, a free TCP port on 127.0.0.1 and the unix socket in that directory, ``fsync`` off
(nothing in it needs to survive a crash of the machine). PostgreSQL refuses to run as root, so
under root the cluster runs as the ``postgres`` account (else ``nobody``). :meth:`PostgresCluster.stop`
stops it and deletes the directory.

``python -m scpdr.testing_postgres start`` starts one and prints two shell lines (``export
SCPDR_TEST_POSTGRES=URL`` and ``export SCPDR_TEST_POSTGRES_DIR=DIR``) for ``eval``;
``python -m scpdr.testing_postgres stop DIR`` stops it. The tests use the cluster that
``SCPDR_TEST_POSTGRES`` names when it is set (``.ci/run`` sets it), else start their own.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ENV_URL",
    "PostgresCluster",
    "PostgresUnavailableError",
    "create_database",
    "find_bindir",
    "start_cluster",
]

#: The maintenance URL of a running throwaway cluster (set by ``.ci/run``).
ENV_URL = "SCPDR_TEST_POSTGRES"
USER = "scpdr"


class PostgresUnavailableError(RuntimeError):
    """No PostgreSQL could be started here (no binaries, no account to run them, or they failed)."""


def find_bindir() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, or None."""
    candidates = []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for d in candidates:
        if all((d / exe).is_file() for exe in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> pwd.struct_passwd | None:
    """The account the cluster runs as: None (this one) unless this is root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise PostgresUnavailableError("running as root and there is no postgres or nobody account")


@dataclass
class PostgresCluster:
    """A running throwaway cluster: ``root`` (data, log, socket), ``port``, ``bindir``."""

    root: Path
    port: int
    bindir: Path

    @property
    def url(self) -> str:
        """The maintenance database's URL (TCP on 127.0.0.1, trust authentication)."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    def create_database(self) -> str:
        """A new, empty database; returns its URL."""
        return create_database(self.url)

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its directory."""
        _pg_ctl(self.bindir, self.root, "stop", "-m", "fast")
        shutil.rmtree(self.root, ignore_errors=True)


def create_database(url: str) -> str:
    """Create an empty database on the cluster of ``url`` (a maintenance URL); return its URL."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:16]
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return url.rsplit("/", 1)[0] + "/" + name


def _pg_ctl(bindir: Path, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _run([str(bindir / "pg_ctl"), "-D", str(root / "data"), *args], timeout=60)


def _run(cmd: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    account = _run_as()
    kwargs: dict[str, object] = {}
    if account is not None:
        kwargs = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd="/",
        check=False,
        **kwargs,  # type: ignore[arg-type]
    )


def start_cluster() -> PostgresCluster:
    """initdb + pg_ctl start into a new temporary directory (see the module docstring).

    Raises:
        PostgresUnavailableError: no binaries, or initdb / the server failed (the message has
            their output).
    """
    bindir = find_bindir()
    if bindir is None:
        raise PostgresUnavailableError(
            "no PostgreSQL binaries (initdb, pg_ctl, postgres) on PATH or under "
            "/usr/lib/postgresql/*/bin; install them (apt-get install -y postgresql)"
        )
    account = _run_as()
    root = Path(tempfile.mkdtemp(prefix="scpdr-pg-"))
    try:
        if account is not None:
            os.chown(root, account.pw_uid, account.pw_gid)
        out = _run(
            [
                str(bindir / "initdb"),
                "-D",
                str(root / "data"),
                "-U",
                USER,
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            ],
            timeout=120,
        )
        if out.returncode != 0:
            raise PostgresUnavailableError(f"initdb failed: {out.stderr.strip()[-2000:]}")
        for _attempt in range(3):  # a free port can be taken between the probe and the start
            port = _free_port()
            opts = (
                f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off"
            )
            out = _pg_ctl(
                bindir, root, "-l", str(root / "log"), "-w", "-t", "60", "-o", opts, "start"
            )
            if out.returncode == 0:
                return PostgresCluster(root, port, bindir)
        log = (root / "log").read_text(errors="replace")[-2000:] if (root / "log").exists() else ""
        raise PostgresUnavailableError(f"pg_ctl start failed: {out.stderr.strip()} {log}")
    except BaseException:
        _pg_ctl(bindir, root, "stop", "-m", "immediate")
        shutil.rmtree(root, ignore_errors=True)
        raise


def main(argv: list[str]) -> int:
    if argv[:1] == ["start"]:
        try:
            cluster = start_cluster()
        except PostgresUnavailableError as exc:
            sys.stderr.write(f"error: {exc}\n")
            return 1
        sys.stdout.write(f"export {ENV_URL}={cluster.url}\n")
        sys.stdout.write(f"export {ENV_URL}_DIR={cluster.root}\n")
        return 0
    if argv[:1] == ["stop"] and len(argv) == 2:
        bindir = find_bindir()
        if bindir is not None:
            _pg_ctl(bindir, Path(argv[1]), "stop", "-m", "fast")
        shutil.rmtree(argv[1], ignore_errors=True)
        return 0
    sys.stderr.write("usage: python -m scpdr.testing_postgres start | stop DIR\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
