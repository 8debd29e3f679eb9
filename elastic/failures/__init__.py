"""Failure detection and what a worker does about a death: lifelines between ranks
(lifeline.py) and the stalls they carry (liveness.py), Gloo's connections cut so a blocked
collective raises (gloo_sockets.py), the recovery's phases (recovery.py), a worker
replaced in place with its hand-off (restart.py, handoff.py), the faults a launch plans
(faults.py), and the address peers reach a host at (addresses.py)."""
