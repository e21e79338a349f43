"""A throwaway PostgreSQL cluster for tests and benchmarks: initdb into a temp dir, pg_ctl on a free loopback port
with its unix socket in that dir, stoppable and restartable, removed at the end.

initdb refuses to run as root, so as root the cluster runs as the `postgres` user (runuser), in a temp dir that
user owns; fsync stays on, as in production: the receiver's ack-after-commit is what the tests check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.broker import free_port

PG_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


def pg_bin() -> Path | None:
    """The newest installed PostgreSQL server's bin dir, or None."""
    return next((d for d in PG_BIN_DIRS if (d / "initdb").exists() and (d / "pg_ctl").exists()), None)


def missing_reason() -> str | None:
    if pg_bin() is None:
        return "PostgreSQL server is not installed (/usr/lib/postgresql/*/bin/initdb; apt-get install postgresql)"
    if os.geteuid() == 0 and (shutil.which("runuser") is None or _uid("postgres") is None):
        return "running as root needs runuser and the postgres user to start PostgreSQL"
    return None


def _uid(user: str) -> int | None:
    import pwd

    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


@dataclass
class PgCluster:
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="edgetune-pg-")))
    port: int = field(default_factory=free_port)
    running: bool = False

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(pg_bin() / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if check and r.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({r.returncode}): {r.stderr[-2000:]}{self._log_tail()}")
        return r

    def _log_tail(self) -> str:
        log = self.dir / "postgres.log"
        return f"\n{log.read_text()[-2000:]}" if log.exists() else ""

    def init(self) -> "PgCluster":
        if os.geteuid() == 0:
            uid = _uid("postgres")
            os.chown(self.dir, uid, -1)
        os.chmod(self.dir, 0o700)
        self._run("initdb", "-D", str(self.dir / "data"), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--no-sync", "--locale=C.UTF-8")
        return self.start()

    def start(self) -> "PgCluster":
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=100"
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "postgres.log"), "-o", opts, "-w",
                  "-t", "60", "start")
        self.running = True
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", mode, "-w", "-t", "60", "stop")
        self.running = False

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_db(self) -> str:
        """A fresh database on the cluster; returns its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def destroy(self) -> None:
        if self.running:
            self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "-w", "stop", check=False)
            self.running = False
        shutil.rmtree(self.dir, ignore_errors=True)
