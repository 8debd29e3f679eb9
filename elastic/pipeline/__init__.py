"""Pipeline parallelism: hand-partitioned stages of an ``nn.Sequential`` over MPI (or a
Gloo group under horovodrun), GPipe and 1F1B schedules, hybrid dp x pp.

    config.py      [pipeline] section; make_plan checks it against world and model
    grid.py        rank -> (replica, stage); cut() keeps a stage's children
    schedule.py    per-rank action lists (GPipe, 1F1B) and a deadlock simulator
    transport.py   point-to-point tensors: mpi4py (mpirun) or torch.distributed Gloo
    executor.py    runs one stage's action list, measures busy/wait/bytes/bubble
    stage.py       microbatches, schedule, gradient sum over a stage's replicas
    checkpoint.py  per-stage files that reload under any other partition
    engine.py      the engine the runtime runs: build the state, one step, finish
    run.py         one rank's pipeline in one world (plan, grid, stage, optimizer, cursor)
    step.py        one optimizer step, top to bottom
    fixed_state.py mpirun / one process: commits are the durable checkpoint
    supervisor.py  relaunches a failed mpirun job from the last checkpoint
    planner.py     [planner] section; (dp, pp) and boundaries from measured layer costs; regatta plan
    rebalance.py   moves boundaries from measured stage times while training; slowdown injection
    shards.py      committed stage shards, buddy copies, digests (elastic pipeline)
    elastic_state.py   horovodrun elastic: re-plan and move state on every reset

Run: ``mpirun -np 4 --hostfile hostfiles/pipeline.txt python -m jobs.charlm --pp 2 --dp 2
--schedule 1f1b --microbatches 8``.
"""
