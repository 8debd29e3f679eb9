"""Regatta's training side: one worker runtime, engines plugged into it.

    train.py        the entry every job and script trains through (chooses the engine)
    runtime/        a worker's life: Env, World, collectives, the step's agreement, state
                    contract, events, commits, reporting, stragglers, checkpoints
    dataparallel/   the data-parallel engine: state, step, gradient reduction
    pipeline/       the pipeline engine: stages, schedules, transports, planner, elastic re-plans
    data/           which samples each rank takes (the global cursor)
    launch/         launcher side: hostfiles, regatta local, warm agents, reports
    lifeline.py, liveness.py, recovery.py   failure and stall detection between ranks, and
                    how a Horovod worker acts on it (gloo_sockets.py: severing Gloo;
                    restart.py, handoff.py: being replaced in place)
    config.py, job.py, optim.py, faults.py   typed configs, the Job protocol, optimizers, fault plans
"""
