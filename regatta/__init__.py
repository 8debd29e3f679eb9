"""Regatta: fault-tolerant, elastic distributed training on Horovod and MPI (PyTorch).

    import regatta

    configs = regatta.config({"model": MyModelConfig})          # TOML + --flags + --set
    regatta.fit(model=model, data=dataset, loss=loss_fn, optimizer=optimizer,
                scheduler=scheduler, evaluate=evaluate, config=configs)
    regatta.log({"val/accuracy": accuracy})                     # during fit, any rank

The same script runs as one process, under ``mpirun``, under ``horovodrun`` (elastic),
and under ``regatta local`` with injected faults; see README.md.
"""
from importlib import import_module

# Where each public name lives. Imported on first use (PEP 562): the ``regatta`` command
# is in this package, and launching a job must not pay for importing torch first.
_HOMES = {"fit": ".api", "train": ".api", "config": ".api", "log": ".api", "context": ".api",
          "Context": ".api", "TrainConfig": "elastic.config", "ConfigError": "elastic.config",
          "PipelineConfig": "elastic.pipeline.config", "PlannerConfig": "elastic.pipeline.planner",
          "Job": "elastic.job", "World": "elastic.runtime.world"}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'regatta' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
