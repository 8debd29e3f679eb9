"""Shared fixtures: run real commands (mpirun, horovodrun via `regatta local`) with a
timeout, and always clean up their whole process group; a throwaway PostgreSQL server;
the session's one headless browser."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

import capabilities

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(PYTHON).parent


def pytest_sessionstart(session):
    if os.environ.get(capabilities.REQUIRE_ENV) == "1":
        lacking = capabilities.missing()
        if lacking:
            pytest.exit("this machine cannot run the whole suite (" + capabilities.REQUIRE_ENV
                        + "=1):\n- " + "\n- ".join(lacking), returncode=3)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant: mpirun puts its ranks in other process
    groups, so killing the group alone leaves them running."""
    try:
        parent = psutil.Process(pid)
        victims = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for proc in victims:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10)


# Every process of the session spools to a folder of its own, never the machine's
# /tmp/regatta-spool: a worker adopts the spools that dead processes left there for the
# same destination, and the user's own runs (and other checkouts) leave them too.
os.environ["REGATTA_SPOOL_DIR"] = tempfile.mkdtemp(prefix="regatta-test-spool-")
atexit.register(shutil.rmtree, os.environ["REGATTA_SPOOL_DIR"], ignore_errors=True)


def outside_pid(host: str, pid: int) -> int:
    """The pid, as this process sees it, of the worker of ``host`` whose events say
    ``pid``: under ``regatta local --netns`` workers live in the launch's pid namespace
    and record the pid they have there (NSpid's last field). Told apart from a process
    that merely has that number by its host: a warm agent names itself and its forks after
    its host (/proc/PID/comm), a cold worker has HOROVOD_HOSTNAME in its environment."""
    for proc in psutil.process_iter(["pid"]):
        try:
            with open(f"/proc/{proc.pid}/status") as status:
                nspid = [int(p) for p in next(line.split()[1:] for line in status
                                              if line.startswith("NSpid:"))]
            if nspid[-1] != pid:
                continue
            forked = Path(f"/proc/{proc.pid}/comm").read_text().strip() == host[:15]
            if forked or proc.environ().get("HOROVOD_HOSTNAME") == host:
                return proc.pid
        except (OSError, StopIteration, ValueError, psutil.Error):
            continue
    raise ProcessLookupError(f"no worker of {host} with pid {pid} in its namespace")


def run(cmd: list[str], timeout: float, env: dict | None = None, check: bool = True,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole group and fail."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s:\n{out[-4000:]}")
    finally:
        kill_tree(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-4000:]}")
    return result


def regatta_local(tmp: Path, *args: str, timeout: float = 240, env: dict | None = None,
                  job_args: list[str] = ()) -> dict:
    """Run `regatta local` and return its JSON report."""
    report = tmp / "report.json"
    cmd = [str(BIN / "regatta"), "local", *args, "--run-dir", str(tmp / "run"),
           "--report", str(report), "--timeout", str(timeout - 20)]
    if job_args:
        cmd += ["--", *job_args]
    run(cmd, timeout, env={"REGATTA_AUDIT": "1", **(env or {})})
    return json.loads(report.read_text())


def mpirun(np: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np),
                "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED", *args], timeout)


def kinds(report: dict, kind: str) -> list[dict]:
    return [e for e in report["events"] if e["kind"] == kind]


def committed(report: dict, step: int, before: float, hash_of=lambda e: e["param_hash"]):
    """The one hash (``hash_of`` a commit event) every rank's commit at ``step`` recorded
    before ``before`` agrees on. A commit whose exchange ended just before a kill is
    recorded just after it, so bound it by the first recovery event, not the kill."""
    commits = [e for e in kinds(report, "commit") if e["step"] == step and e["wall_time"] < before]
    found = {hash_of(e) for e in commits if "param_hash" in e}
    if not found and any("digests" in e for e in commits):
        found = {whole_model_digest(commits)}
    assert len(found) == 1, found
    return found.pop()


def whole_model_digest(commits: list[dict]) -> str:
    """The pipeline's model digest from the tensors its ranks held at one commit, for the
    commit whose audit (a collective) a failure cut short on every rank that recorded it."""
    from elastic.pipeline.shards import model_digest
    digests = {}
    for event in commits:
        for name, digest in event.get("digests", {}).items():
            assert digests.setdefault(name, digest) == digest, (name, event["host"])
    return model_digest(digests)


# -- a throwaway PostgreSQL server, one per test session ---------------------------

def _postgres_bin() -> Path:
    """Debian's PostgreSQL binaries (never /usr/local/bin's pg_ctl wrapper)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    if not found:
        pytest.fail("PostgreSQL is not installed: run `bash tools/setup.sh` (Debian's "
                    "postgresql package)")
    return found[-1].parent


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """initdb + pg_ctl in a temporary folder, listening on 127.0.0.1 only, trust auth.
    PostgreSQL refuses to run as root, so as root (CI) the server runs as ``nobody``."""

    def __init__(self):
        import pwd
        import tempfile
        self.bin = _postgres_bin()
        self.folder = Path(tempfile.mkdtemp(prefix="regatta-pg-"))
        self.data = self.folder / "data"
        self.port = _free_port()
        self.user = None
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.folder, nobody.pw_uid, nobody.pw_gid)
            self.user = (nobody.pw_uid, nobody.pw_gid)
        self._pg("initdb", "-D", str(self.data), "-U", "regatta", "--auth=trust", "-E", "UTF8",
                 "--no-sync", "--no-instructions")
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "log"), "-w", "-t", "60",
                 "-o", f"-k {self.folder} -p {self.port} -c listen_addresses=127.0.0.1 -F "
                       f"-c max_connections=300 -c full_page_writes=off", "start")
        self.url = f"postgresql+psycopg://regatta@127.0.0.1:{self.port}"
        self._count = 0

    def _pg(self, tool: str, *args: str) -> None:
        kw = {"user": self.user[0], "group": self.user[1], "extra_groups": []} if self.user else {}
        done = subprocess.run([str(self.bin / tool), *args], capture_output=True, text=True,
                              timeout=120, cwd=self.folder, **kw)
        if done.returncode != 0:
            log = (self.folder / "log").read_text() if (self.folder / "log").exists() else ""
            pytest.fail(f"{tool} failed: {done.stdout}{done.stderr}{log[-2000:]}")

    def new_database(self) -> str:
        """A fresh, empty database; its SQLAlchemy URL."""
        import psycopg
        self._count += 1
        name = f"t{os.getpid()}_{self._count}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=regatta dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"{self.url}/{name}"

    def stop(self) -> None:
        import shutil
        try:
            self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def own_environment():
    """Each test starts from the environment the one before it started from: a test that
    trains in this process (the user API's single-process runs) leaves the settings the
    runtime gives Horovod in os.environ (HOROVOD_CYCLE_TIME, HOROVOD_WAKE_ON_ENQUEUE),
    and every command a later test started inherited them (seen: a user-script run on
    3 hosts at the unwoken 5 ms)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def postgres():
    """The session's PostgreSQL server (started on first use)."""
    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty store location on each database: a SQLite path, a PostgreSQL URL."""
    if request.param == "sqlite":
        return str(tmp_path / "m.db")
    return request.getfixturevalue("postgres").new_database()


# -- the session's browser (Debian's chromium driven by playwright) ------------------------

CHROMIUM = capabilities.CHROMIUM


@pytest.fixture(scope="session")
def browser():
    """One headless chromium for every browser test module of the session."""
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium")
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def context(browser):
    # One context per module: its HTTP cache keeps the 4.8 MB plotly.min.js (and V8's
    # compiled code of it) between pages, which halves every page load.
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    yield ctx
    ctx.close()


@pytest.fixture
def page(context, server):
    """A page on the module's ``server`` that fails the test on a script error or a
    request outside the server."""
    import browsing
    with browsing.watched_page(context, server) as pg:
        yield pg
