"""bench_chaos's split of goodput: the pace away from faults, on a made-up run."""
from bench.bench_chaos import quiet_pace, stopped_seconds


def run(commits, marks=()):
    events = [{"kind": "commit", "step": s, "wall_time": t} for s, t in commits]
    events += [{"kind": kind, "step": None, "wall_time": t} for kind, t in marks]
    return {"events": events}


def test_the_pace_away_from_faults_leaves_out_every_commit_near_one():
    # 40 steps/s, except 10 s after t = 20 where a kill and its recovery took 3 s
    commits = [(s, s / 40) for s in range(0, 800, 10)]
    commits += [(800 + s, 23 + s / 40) for s in range(0, 800, 10)]
    whole = (commits[-1][0] - commits[0][0]) / (commits[-1][1] - commits[0][1])
    marks = [("fault_injected", 20.1), ("peer_lost", 20.2), ("reset", 22.5), ("resumed", 22.9)]
    assert whole < 38
    assert abs(quiet_pace(run(commits, marks)) - 40.0) < 1e-9
    assert quiet_pace(run(commits[:1], marks)) is None     # no interval at all


def test_a_run_with_no_faults_keeps_every_interval():
    commits = [(s, s / 50 + (0.1 if s >= 500 else 0)) for s in range(0, 1000, 10)]
    assert abs(quiet_pace(run(commits)) - 990 / (990 / 50 + 0.1)) < 1e-9


def test_time_stopped_counts_overlapping_recoveries_once():
    events = [{"kind": "fault_injected", "fault": "kill", "host": "launcher", "wall_time": 10.0},
              {"kind": "fault_injected", "fault": "kill", "host": "launcher", "wall_time": 10.2},
              {"kind": "resumed", "host": "h", "wall_time": 10.7},      # both: 0.7 s, not 1.2
              {"kind": "host_added", "host": "launcher", "wall_time": 13.5},   # the plan's
              {"kind": "host_added", "host": "127.0.0.3", "wall_time": 14.0},  # rank 0's notice
              {"kind": "resumed", "host": "h", "wall_time": 14.9},
              {"kind": "fault_injected", "fault": "vanish", "host": "launcher", "wall_time": 20.0},
              {"kind": "fault_injected", "fault": "partition", "host": "launcher", "wall_time": 30.0},
              {"kind": "resumed", "host": "h", "wall_time": 22.5}]
    assert abs(stopped_seconds({"events": events}) - (0.7 + 0.9 + 2.5)) < 1e-9
