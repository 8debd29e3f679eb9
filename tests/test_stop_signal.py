"""SIGTERM (scancel, a Slurm time limit's --signal) stops a run: after the step every rank
agrees on, with the state committed and on disk, the run `stopped` in the store, exit 0;
`--resume auto` goes on from that step."""
import os
import signal
import sqlite3
import subprocess
import time

import torch

from conftest import PYTHON, ROOT, kill_tree, run
from elastic.runtime.control import Agreed, Control, Pending


def test_one_ranks_stop_stops_every_rank():
    controls = [Pending(stop=rank == 1).control(1.0, 4, 0.1) for rank in range(3)]
    summed = sum(c.encode(rank, 3, torch.float64) for rank, c in enumerate(controls))
    agreed = Agreed.decode(summed)
    assert agreed.stop and agreed.count == 12 and not agreed.host_update
    assert not Agreed.decode(sum(Control(1.0, 4, 0, 0, 0.1).encode(r, 3, torch.float64)
                                 for r in range(3))).stop


def progress(run_dir):
    try:
        return int((run_dir / "progress").read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return 0


def test_sigterm_checkpoints_marks_stopped_and_resume_goes_on(tmp_path):
    run_dir, db = tmp_path / "run", tmp_path / "m.db"
    args = ["--run-dir", str(run_dir), "--db", str(db), "--no-progress", "--commit-every", "7"]
    proc = subprocess.Popen([PYTHON, "-m", "jobs.digits", "--steps", "100000", *args], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while progress(run_dir) < 30 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert progress(run_dir) >= 30, proc.stdout.read() if proc.poll() is not None else "no progress"
        told = time.time()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        ended = time.time() - told
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, out[-3000:]
    assert ended < 10
    store = sqlite3.connect(db)
    (run_id, status), = store.execute("select id, status from run").fetchall()
    assert status == "stopped"
    (stopped_at,), = store.execute("select step from event where kind = 'run_stopped'").fetchall()
    checkpoint_steps = [s for (s,) in store.execute("select step from event where kind = 'checkpoint'")]
    assert stopped_at >= 30 and max(checkpoint_steps) == stopped_at
    # not at a commit interval: the stop commits where it is
    commits = {s: reason for s, reason in store.execute(
        "select step, json_extract(detail, '$.reason') from event where kind = 'commit'")}
    assert commits[stopped_at] == "stopped"
    resumed = run([PYTHON, "-m", "jobs.digits", "--steps", str(stopped_at + 10), "--resume", "auto", *args],
                  timeout=120)
    assert resumed.returncode == 0
    statuses = dict(store.execute("select id, status from run").fetchall())
    (resume_step,), = store.execute("select step from event where kind = 'resume'").fetchall()
    assert resume_step == stopped_at and statuses[run_id] == "finished"
