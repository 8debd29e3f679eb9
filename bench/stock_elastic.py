"""The baseline for bench_recovery: a stock Horovod elastic training loop, written the way
Horovod's elastic documentation does it (DistributedOptimizer, TorchState, commit every
K steps, host updates checked at commit), on the same digits job and data split.

Launched by the bench through `regatta local digits --module bench.stock_elastic
--stock-recovery ...`. It records only what the bench reads (injected kill, reset,
first step done) in the same event files as Regatta's workers.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from elastic.runtime.events import EventLog, Progress
from elastic.failures.faults import FaultPlan
from elastic.runtime.world import World
from elastic.command_line import parse
from jobs.digits import DigitsConfig, DigitsJob


def main() -> None:
    # Imported here, not at the top: a script importing horovod.torch at its top is taken
    # for a Horovod script, whose flags would come in REGATTA_ARGS (elastic/launch/target.py)
    import horovod.torch as hvd
    config = parse("stock_elastic", {"model": DigitsConfig},
                   toml=str(Path(__file__).resolve().parents[1] / "jobs" / "digits.toml"))
    cfg, job = config["train"], DigitsJob(config["model"])
    hvd.init()
    torch.set_num_threads(1)
    events = EventLog(cfg.run_dir, os.environ.get("HOROVOD_HOSTNAME", "local"),
                      int(os.environ.get("HOROVOD_LOCAL_RANK", 0)))
    faults = FaultPlan.from_env()
    progress = Progress(cfg.run_dir)   # the launcher's step counter, as Regatta's rank 0 writes
    torch.manual_seed(cfg.seed)
    model = job.build_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=cfg.lr),
                                         named_parameters=model.named_parameters())
    x, y = job.train_data()
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    state.register_reset_callbacks([lambda: events.record("reset", state.step, size_after=hvd.size())])

    @hvd.elastic.run
    def train(state):
        first = True
        while state.step < cfg.steps:
            world = World.from_horovod(hvd, os.environ.get("HOROVOD_HOSTNAME", "local"))
            faults.before_step(world, state.step, events)
            generator = torch.Generator().manual_seed(state.step * 1000 + hvd.rank())
            batch = torch.randint(0, len(x), (cfg.global_batch // hvd.size(),), generator=generator)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            state.step += 1
            if hvd.rank() == 0:
                progress.update(state.step, hvd.size())
            if first:
                events.record("resumed", state.step, size=hvd.size())
                first = False
            if state.step % (cfg.fixed_commit_every or 10) == 0:   # "auto" is Regatta's alone
                state.commit()

    train(state)
    events.record("finish", state.step, size=hvd.size())


if __name__ == "__main__":
    main()
