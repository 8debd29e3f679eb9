"""A Horovod elastic script moved onto Regatta by its import line alone
(examples/horovod_mnist_elastic.py; tests/workers/horovod_mnist_elastic_stock.py is the
same file on stock Horovod): under `regatta local` on three simulated hosts, one
SIGKILLed from outside at a random instant, and beside the stock script on horovodrun."""
import difflib
import json
import re
import sqlite3
import textwrap
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT, kinds, regatta_local, run
from monitor.store import Store

DROP_IN = ROOT / "examples" / "horovod_mnist_elastic.py"
STOCK = ROOT / "tests" / "workers" / "horovod_mnist_elastic_stock.py"
KILL_AT = 30
TEST_LINE = re.compile(r"Test set: average loss ([0-9.]+), accuracy ([0-9.]+)%")
TRAIN_LINE = re.compile(r"Train epoch (\d+) batch (\d+) workers \d+ loss ([0-9.]+)")


def test_the_two_scripts_differ_in_the_import_line_only():
    diff = [line for line in difflib.unified_diff(STOCK.read_text().splitlines(),
                                                  DROP_IN.read_text().splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert diff == ["-import horovod.torch as hvd", "+import regatta.horovod as hvd"]


def printed_train(run_dir: Path) -> dict[tuple[int, int], float]:
    """Rank 0's training log: (epoch, batch) -> that batch's loss."""
    found = TRAIN_LINE.findall((run_dir / "horovodrun.log").read_text())
    return {(int(epoch), int(batch)): float(loss) for epoch, batch, loss in found}


def printed_test(run_dir: Path) -> tuple[float, float]:
    """The script's own last line: test loss and accuracy (%), as rank 0 printed them."""
    found = TEST_LINE.findall((run_dir / "horovodrun.log").read_text())
    assert found, "the script printed no test result"
    loss, accuracy = found[-1]
    return float(loss), float(accuracy)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dropin-kill")
    report = regatta_local(tmp, str(DROP_IN), "--hosts", "3", "--sigkill", f"2@{KILL_AT}",
                           "--commit-every", "10", "--db", str(tmp / "m.db"), timeout=240)
    return tmp, report


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """Both scripts on three hosts without a fault: Regatta's runtime under the first,
    stock horovodrun (no lifelines, no warm agents) under the second."""
    runs = {}
    for name, script, extra in (("regatta", DROP_IN, []), ("stock", STOCK, ["--stock-recovery", "--cold-workers"])):
        tmp = tmp_path_factory.mktemp(f"dropin-{name}")
        runs[name] = tmp, regatta_local(tmp, str(script), "--hosts", "3", "--db", str(tmp / "m.db"),
                                        *extra, timeout=240, job_args=["--epochs", "3", "--log-interval", "5"])
    return runs


def test_the_killed_run_finishes_on_the_survivors_from_their_live_state(killed):
    tmp, report = killed
    assert report["exit_code"] == 0 and report["final_world_size"] == 2
    (change,) = report["changes"]
    assert change["kind"] == "failure" and change["size_after"] == 2
    after = lambda kind: [e for e in kinds(report, kind) if e["wall_time"] > change["wall_time"]]
    # A survivor whose step's collective outlived the sever is restarted in place (seen
    # in a fresh clone, 2026-12-07): its replacement starts without live state, takes the
    # other's, and costs the first step about 1.5 s more.
    restarted = {e["host"] for e in after("restart_in_place")}
    assert len(restarted) <= 1, restarted
    # loose: the bench holds the figure (0.25 s here on 2026-12-06)
    assert change["first_step_done_s"] < (4.0 if restarted else 2.0), (change, restarted)
    assert change["recovered_from"] == "recovered_live" and change["steps_redone"] == 0
    # every survivor went on from one state: the digests of model, momentum and the
    # attributes (epoch, batch, the sampler's position) agree after the reset
    synced = after("sync")
    assert len(synced) == 2 and len({e["state_hash"] for e in synced}) == 1
    # only a replacement receives state; a survivor that kept its own receives nothing
    received = {e["host"]: e["received_bytes"] for e in synced}
    assert {host for host, n in received.items() if n > 0} == restarted, (received, restarted)
    assert change["moved_bytes"] == max(received.values())
    loss, accuracy = printed_test(tmp / "run")
    assert accuracy > 80.0


def test_the_store_has_its_steps_hosts_and_the_failure_with_its_phases(killed):
    tmp, report = killed
    db = sqlite3.connect(tmp / "m.db")
    (run_id, status), = db.execute("select id, status from run").fetchall()
    assert status == "finished" and run_id.startswith("horovod_mnist_elastic-local-")
    rows = db.execute("select host, rank, world_size, step, samples, bytes_sent, comm_time "
                      "from step_metric where run_id = ?", (run_id,)).fetchall()
    hosts = {r[0] for r in rows}
    assert len(hosts) == 3
    before = [r for r in rows if r[2] == 3]
    after = [r for r in rows if r[2] == 2]
    # a step is one commit of the loop: a batch of 32 a rank (an epoch's last is shorter),
    # its gradients on the wire
    samples = sorted(r[4] for r in rows)
    assert before and after and 0 < samples[0] and samples[-1] == samples[len(samples) // 2] == 32
    assert all(r[5] > 0 for r in rows) and max(r[3] for r in before) >= KILL_AT
    # steps go on from the kill's step at the new size: none done twice
    assert min(r[3] for r in after) >= max(r[3] for r in before)
    assert {r[0] for r in db.execute("select host from host_sample where run_id = ?", (run_id,))} == hosts
    (failure,) = [r for r in Store(str(tmp / "m.db")).recoveries(run_id) if r["kind"] == "failure"]
    for phase in ("detected_s", "reset_done_s", "state_synced_s", "first_step_done_s"):
        assert 0 <= failure[phase] < 2.0, (phase, failure)
    assert failure["steps_redone"] == 0


def test_without_faults_it_trains_as_the_stock_script_does(healthy):
    """The same seeds, batches, dropout masks and averaged gradients: the same training,
    to the rounding of summation orders. Those roundings grow as the loss falls steeply
    (epoch 3 here), and stock Horovod's own vary from run to run with what its fusion
    buffer happens to hold (test loss 0.221 and 0.244 for the stock script alone after 5
    epochs; 0.420 stock and 0.471 Regatta after 3): the first epoch is compared closely,
    where rounding has not yet grown, and the end loosely."""
    (regatta_dir, regatta), (stock_dir, stock) = healthy["regatta"], healthy["stock"]
    assert regatta["exit_code"] == stock["exit_code"] == 0
    ours, theirs = printed_train(regatta_dir / "run"), printed_train(stock_dir / "run")
    assert ours.keys() == theirs.keys() and len(ours) == 9    # 3 epochs x batches 5, 10, 15
    first_epoch = [key for key in ours if key[0] == 1]
    assert [ours[k] for k in first_epoch] == pytest.approx([theirs[k] for k in first_epoch], abs=2e-3)
    ours, theirs = printed_test(regatta_dir / "run"), printed_test(stock_dir / "run")
    assert ours[0] == pytest.approx(theirs[0], abs=0.15) and abs(ours[1] - theirs[1]) <= 10.0
    assert ours[1] > 75.0 and theirs[1] > 75.0   # 3 epochs: 82 to 88 % (5: 95 %)
    # the replicas end as one model
    finals = [json.loads(p.read_text()) for p in (regatta_dir / "run" / "final").glob("*.json")]
    assert len(finals) == 3 and len({f["param_hash"] for f in finals}) == 1
    # the stock script wrote nothing to the store; Regatta's run is there, finished
    assert not (stock_dir / "m.db").exists() or not sqlite3.connect(stock_dir / "m.db").execute(
        "select count(*) from step_metric").fetchone()[0]
    assert sqlite3.connect(regatta_dir / "m.db").execute("select status from run").fetchall() == [("finished",)]


REFUSALS = textwrap.dedent("""
    import json, sys, torch
    import regatta.horovod as hvd
    hvd.init()
    model = torch.nn.Linear(4, 2)
    out = {}
    for name, options in [("adasum", {"op": hvd.Adasum}), ("passes", {"backward_passes_per_step": 2}),
                          ("predivide", {"gradient_predivide_factor": 2.0})]:
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options)
            out[name] = None
        except hvd.RefusedOption as err:
            out[name] = str(err)
    try:
        hvd.elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), step=0)
        out["step"] = None
    except TypeError as err:
        out["step"] = str(err)
    # one process: the wrapped optimizer is the user's class, its step the plain one's
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    reference = torch.nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for m, o in ((model, opt), (reference, plain)):
        o.zero_grad(); m(x).square().mean().backward(); o.step()
    out["same"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    out["isinstance"] = isinstance(opt, torch.optim.SGD)
    json.dump(out, sys.stdout)
""")


def test_what_cannot_be_kept_is_refused_with_the_reason(tmp_path):
    script = tmp_path / "refusals.py"
    script.write_text(REFUSALS)
    args = f"--run-dir {tmp_path / 'run'} --db {tmp_path / 'm.db'}"
    out = run([PYTHON, str(script)], timeout=120, env={"REGATTA_ARGS": args}).stdout
    found = json.loads(out[out.index("{"):])
    assert "use op=hvd.Average" in found["adasum"]
    assert "accumulate in your loop" in found["passes"]
    assert "divides by the global" in found["predivide"]
    assert "TorchState(step=...)" in found["step"] and "another name" in found["step"]
    assert found["same"] and found["isinstance"]
