"""A slowed host shows up in the store: its compute time, the imbalance, a straggler
event naming it; a balanced run flags nobody."""
import statistics

import pytest

from conftest import kinds, regatta_local
from monitor.store import Store

# 60 ms of simulated accelerator time per step: three ranks on two cores would otherwise
# measure how the OS shares the cores (one rank alone on a core computes 2x faster).
JOB = ["--set", "model.simulated_compute_ms=60", "--no-progress"]


def per_host_median_compute(db, run_id, after_step=5):
    store = Store(str(db))
    series = store.step_series(run_id, "compute_time", by="host", max_points=10_000)["series"]
    store.close()
    return {s["key"]: statistics.median(
        v for step, v in zip(s["step"], s["value"]) if step > after_step) for s in series}


@pytest.mark.parametrize("slow", [True, False], ids=["slowed", "balanced"])
def test_slowed_host_is_measured_and_flagged(tmp_path, slow):
    db = tmp_path / "m.db"
    args = ["digits", "--hosts", "3", "--steps", "60", "--commit-every", "20"]
    report = regatta_local(tmp_path, *args, *(["--slow", "3:1.5"] if slow else []),
                           job_args=["--db", str(db), *JOB])
    assert report["exit_code"] == 0
    store = Store(str(db))
    (run,) = store.runs()
    events = store.events(run["id"], kinds=["straggler"])
    store.close()
    medians = per_host_median_compute(db, run["id"])
    assert set(medians) == {"127.0.0.2", "127.0.0.3", "127.0.0.4"}
    ratio = max(medians.values()) / statistics.median(medians.values())
    print("per-host median compute time", medians, "max/median", round(ratio, 3))
    if slow:
        assert max(medians, key=medians.get) == "127.0.0.4"
        # 1.5x by construction; sleep wake-ups on a busy machine move it a little
        assert 1.35 <= ratio <= 1.75, medians
        first = events[0]
        assert first["detail"]["straggler_host"] == "127.0.0.4"
        # flagged within its first few windows (the first one holds warm-up steps)
        assert first["step"] <= 20 and 1.3 < first["detail"]["ratio"] < 1.8
        assert {e["detail"]["straggler_host"] for e in events} == {"127.0.0.4"}
    else:
        assert ratio < 1.2, medians
        assert events == []


def test_detector_flags_a_sustained_straggler_once():
    from elastic.runtime.stragglers import StragglerDetector
    detector = StragglerDetector(factor=1.3, window=8)
    flagged = []
    for step in range(40):
        slow = 1.5 if step % 5 else 1.25     # hovering around the threshold now and then
        flagged += [(step, r) for r in detector.observe([1.0, 1.02, slow])]
    assert flagged == [(7, 2)]               # after a full window, once
    for step in range(20):
        detector.observe([1.0, 1.0, 1.0])
    assert detector.flagged == set()
    assert detector.observe([1.0, 1.0, 1.0]) == []


def test_detector_ignores_noise_on_a_balanced_run():
    import random
    from elastic.runtime.stragglers import StragglerDetector
    rng = random.Random(0)
    detector = StragglerDetector()
    assert not any(detector.observe([rng.uniform(0.9, 1.15) for _ in range(4)]) for _ in range(500))
