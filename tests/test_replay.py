"""Nothing stranded: a real training run streamed by --ingest to a dashboard that is down
until after the run ended is complete and ``finished`` after ``regatta replay``, or after
the server's own start (it replays what producers on its machine left spooled)."""
import glob
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

from sqlalchemy import func, select

from conftest import ROOT, run
from monitor.models import StepMetric
from monitor.store import Store
from webui.serve import make_server, stop

TOKEN = "replay-t0ken"
STEPS = 30
# `regatta replay` is this module's main; called as a module so the test does not depend
# on which console script is installed
REPLAY = [sys.executable, "-m", "monitor.replay"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_while_down(tmp: Path, port: int, spool: Path) -> None:
    """`python -m jobs.digits --ingest http://127.0.0.1:PORT` with nobody listening."""
    run([sys.executable, "-m", "jobs.digits", "--steps", str(STEPS), "--run-dir", str(tmp / "run"),
         "--ingest", f"http://127.0.0.1:{port}", "--no-progress"], timeout=180,
        env={"REGATTA_SPOOL_DIR": str(spool), "REGATTA_INGEST_TOKEN": TOKEN})
    assert glob.glob(str(spool / "*.jsonl")), "the run left nothing spooled"


def serve(db: str, port: int, spool: Path):
    server = make_server(db, port=port, token=TOKEN, spool_dir=str(spool))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    return server, thread


def check_complete(db: str) -> None:
    store = Store(db)
    try:
        (run_row,) = store.runs()
        assert run_row["status"] == "finished" and run_row["last_step"] == STEPS
        steps = store.all(select(StepMetric.step, func.count()).group_by(StepMetric.step)
                          .order_by(StepMetric.step))
        assert steps == [(s, 1) for s in range(1, STEPS + 1)]   # every step, exactly once
        assert store.count("event", run_row["id"]) > 0
    finally:
        store.close()


def test_regatta_replay_delivers_a_run_the_server_missed(tmp_path):
    port, spool = free_port(), tmp_path / "spool"
    train_while_down(tmp_path, port, spool)
    db = str(tmp_path / "m.db")
    server, thread = serve(db, port, tmp_path / "other-spool")   # starts with nothing to replay
    try:
        # without the token: refused, said, and every row kept for the next try
        env = {k: v for k, v in os.environ.items() if k != "REGATTA_INGEST_TOKEN"}
        refused = subprocess.run(REPLAY + ["--spool-dir", str(spool)], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "HTTP 401" in refused.stderr
        assert glob.glob(str(spool / "*.jsonl"))
        (tmp_path / "token").write_text(TOKEN + "\n")
        done = run(REPLAY + ["--spool-dir", str(spool), "--token-file", str(tmp_path / "token")],
                   timeout=60)
        assert "replayed" in done.stdout and "left in" not in done.stdout
        check_complete(db)
        assert glob.glob(str(spool / "*.jsonl")) == []
        again = run(REPLAY + ["--spool-dir", str(spool)], timeout=60,
                    env={"REGATTA_INGEST_TOKEN": TOKEN})
        assert "replayed 0 rows" in again.stdout
    finally:
        stop(server)
        thread.join(timeout=10)


def test_the_server_replays_at_its_start(tmp_path):
    port, spool = free_port(), tmp_path / "spool"
    train_while_down(tmp_path, port, spool)
    db = str(tmp_path / "m.db")
    server, thread = serve(db, port, spool)
    try:
        server.regatta_replay.join(timeout=60)
        check_complete(db)
        assert glob.glob(str(spool / "*.jsonl")) == []
    finally:
        stop(server)
        thread.join(timeout=10)

