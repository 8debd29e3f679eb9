"""The elastic pipeline's state: dp x pp under ``horovodrun`` elastic, re-planned on every
reset (the runtime runs the loop; engine.py plugs this in).

    regatta local charlm --hosts 4 --steps 120 --commit-every 10 --kill 2@60 -- \
        --pp 2 --global-batch 24 --microbatches 2

On every (re)entry ``sync_state`` makes the grid fit the world: the configured
``pipeline.pp`` (and ``dp``) when the world size allows, otherwise the planner's choice
within ``planner.pp_min..pp_max`` from layer costs rank 0 measured once (every rank keeps
them, so the costs outlive rank 0). The stage state comes from the survivors' live stages
where those make a whole model (dp >= 2: a replica of every stage survived; the newest
step they reach wins: ``recovered_live``, or ``adopted`` where some were one step behind),
else from the last commit held in memory (shards.py: own shards, dp peers, buddy copies;
``restored_commit``), else from the durable pipeline checkpoint (``restored_checkpoint``),
else from the seed. Only what a rank lacks for its stage under the new plan moves to it,
point to point from a rank holding it. The torch.distributed Gloo group is destroyed and
rebuilt (rank 0 picks a port and broadcasts the address over Horovod under an explicit
name), and a transport error is re-raised as ``HorovodInternalError`` so
``hvd.elastic.run`` restores.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from elastic.data.sampler import Cursor
from elastic.runtime import checkpoint as saving
from elastic.runtime.shards import buddies, cover, covering_step, kept_by, transfers
from elastic.runtime.state import RuntimeState
from elastic.runtime.torch_group import meeting_point, translated as translated_as

from . import checkpoint as ckpt
from .config import Plan, make_plan
from .planner import LayerCosts, choose, measure_job, plan_grid
from .rebalance import export_stage, import_stage
from .run import build_run, resume
from .shards import exchange, model_digest, send_pieces, shard_bytes, tensor_digests
from .gloo_transport import GlooTransport


HANDOFF_FORMAT = "regatta-pipeline-handoff/1"


def translated():
    """torch.distributed's failures as the error ``hvd.elastic.run`` restores from."""
    return translated_as("pipeline transport")


class ElasticPipeline(RuntimeState):
    def __init__(self, runtime, engine):
        super().__init__(runtime)
        self.engine = engine
        self.run = None                    # run.Run, rebuilt on every sync
        # Commits, newest first: {"step", "epoch", "consumed", "extent", "held": {(start, end): shard}}.
        # The previous one stays until every rank has finished the newest (a rank that died
        # during a commit's buddy exchange must not leave the survivors with half of each).
        self.gens: list[dict] = []
        self.buddy: list[int] = []
        self.costs = None                  # planner.LayerCosts, measured once by rank 0
        self.last_plan: dict | None = None
        # This rank's stage as it was when a step failed, held like a commit of that step
        # ({"step", ..., "held": {children: shard}}) until the next world is built from it.
        self.live: dict | None = None

    @property
    def step(self) -> int:
        if self.run is not None:
            return self.run.step
        if self.live is not None:   # a failure during the sync after one: still that step
            return self.live["step"]
        return self.gens[0]["step"] if self.gens else 0

    @property
    def hvd(self):
        return self.runtime.hvd

    # -- the engine's half of RuntimeState ------------------------------------------------
    def save(self) -> dict:
        """Snapshot this rank's stage in memory and pass it to the buddy (dp = 1)."""
        run = self.run
        with translated():
            own = export_stage(run.stage.module, run.optimizer)
            held = {run.children: own}
            me = run.world.rank
            if run.plan.dp == 1 and run.world.size > 1:
                senders = kept_by(self.buddy, me)[1:]
                for rng, shard in exchange(run.transport, (run.children, own), self.buddy[me], senders):
                    held[tuple(rng)] = shard
        self.gens = [{"step": run.step, "epoch": run.cursor.epoch, "consumed": run.cursor.consumed,
                      "extent": run.plan.stages[-1][1], "held": held}] + self.gens[:1]
        detail = {"held": [list(r) for r in held], "held_bytes": shard_bytes(held)}
        if self.runtime.env.audit:  # what this rank holds, known without a collective
            detail["digests"] = {name: digest for shard in held.values()
                                 for name, digest in tensor_digests(shard["model"]).items()}
        return detail

    def step_done(self) -> None:
        """Every rank got past its last commit: the one before it is not needed."""
        self.gens = self.gens[:1]

    def leave_world(self) -> None:
        """Close the Gloo group: peers blocked on this rank fail at once, not at the timeout."""
        if self.run is not None and self.run.transport is not None:
            close_quietly(self.run.transport)
            self.run.transport = None

    def restore_committed(self) -> None:
        """Keep the stage's live state; the sync rebuilds from it, or from the commit
        where the survivors' live stages do not make a whole model. A failed step left
        it whole at ``run.step``: the update (optimizer.step, then step += 1) comes after
        the step's last collective, so a failure stops a step before it or not at all."""
        if self.run is not None:
            self.live = self._live_gen()
        self.run = None

    def sync_state(self) -> dict:
        started, world = time.perf_counter(), self.runtime.world
        first = not self.gens
        live = self._live_gen() if self.run is not None else self.live   # a planned change keeps its run
        with translated():
            held = self.gens + ([live] if live else [])
            gens = [{k: g[k] for k in ("step", "epoch", "consumed", "extent")}
                    | {"ranges": list(g["held"]), "live": g is live} for g in held]
            inventory = self.hvd.allgather_object({"host": world.host, "costs": self.costs, "gens": gens},
                                                  name="regatta.pipe.inventory")
            self._share_costs(inventory, world)
            plan = self._plan(world.size)
            items = [{"rank": r, **g} for r, i in enumerate(inventory) for g in i["gens"]]
            step = self._covering(items)
            from_disk = step is None and (bool(items) or (first and bool(self.engine.train.resume)))
            moved = self._build(world, plan, items, step, held, [i["host"] for i in inventory], from_disk)
            self.live = None
            self.save()
        self._record_replan(plan, step is not None, moved, started)
        # live: the survivors' live stages alone make the model (commit pieces of the same
        # step may fill in where they are nearer, the same bytes)
        source = "checkpoint" if from_disk else "seed" if step is None else \
            "live" if cover([i for i in items if i["live"]], step) else "memory"
        # moved_bytes as the data-parallel engine counts it: the state this rank received
        detail = {"source": source, "from_step": self.run.step, "children": list(self.run.children),
                  **moved, "moved_bytes": moved["received_bytes"]}
        return {**detail, **recovery_of(source, items, step)}

    def write_checkpoint(self) -> dict | None:
        from .run import save_checkpoint
        with translated():
            return save_checkpoint(self.run, self.runtime.run_id)

    def load_checkpoint(self) -> dict | None:
        return resume(self.run)

    def write_handoff(self, path: Path) -> None:
        """This rank's commits (its stage, and its buddy's copy when dp = 1), for the worker
        that replaces it in place (elastic/failures/restart.py): it rejoins holding what this rank held."""
        gens = [{**g, "held": [[*rng, shard] for rng, shard in g["held"].items()]} for g in self.gens]
        saving.save_atomic({"format": HANDOFF_FORMAT, "gens": gens, "buddy": self.buddy,
                            "costs": asdict(self.costs) if self.costs else None,
                            "last_plan": self.last_plan}, Path(path))

    def load_handoff(self, path: Path, live: Path | None = None) -> None:
        """``live``: never given (a stage hands over no live state, only its commit)."""
        saved = saving.load(path, expect=HANDOFF_FORMAT)
        if saved is None:
            raise saving.CheckpointError(f"no hand-over at {path}")
        self.gens = [{**g, "held": {(start, end): shard for start, end, shard in g["held"]}}
                     for g in saved["gens"]]
        self.buddy, self.last_plan = saved["buddy"], saved["last_plan"]
        self.costs = LayerCosts(**saved["costs"]) if saved["costs"] else None
        self.restore_committed()

    def audit_hash(self) -> str | None:
        """The whole model's digest (replica 0 of each stage contributes; a collective)."""
        if self.run is None:
            return None
        digests = tensor_digests(self.run.stage.module.state_dict()) if self.run.grid.replica == 0 else {}
        everyone = self.hvd.allgather_object(digests, name="regatta.pipe.audit")
        return model_digest({k: v for d in everyone for k, v in d.items()})

    # -- pieces of sync ------------------------------------------------------------------
    def _share_costs(self, inventory: list[dict], world) -> None:
        known = next((i["costs"] for i in inventory if i["costs"] is not None), None)
        if known is None:   # the first start: rank 0 measures, everyone keeps a copy
            e = self.engine
            known = measure_job(e.job, e.train, e.pipe.microbatches) if world.is_root else None
            known = self._broadcast(known, "regatta.pipe.costs")
        self.costs = known

    def _broadcast(self, obj, name: str):
        """Rank 0's ``obj`` on every rank of the world re-forming (Horovod's)."""
        return self.hvd.broadcast_object(obj, root_rank=0, name=name)

    def _plan(self, size: int) -> Plan:
        """The configured grid when it fits ``size`` ranks, else the planner's choice."""
        pipe, planner = self.engine.pipe, self.engine.planner
        gb, m = self.engine.train.global_batch, pipe.microbatches
        if size % pipe.pp == 0 and pipe.dp in (0, size // pipe.pp):
            if pipe.boundaries:
                return make_plan(pipe, size, len(self.costs), gb)
            fit = plan_grid(self.costs, size // pipe.pp, pipe.pp, m, gb, planner)
            if fit.feasible:
                return Plan(pp=fit.pp, dp=fit.dp, schedule=pipe.schedule, microbatches=m,
                            stages=fit.stages, microbatch_size=gb // (fit.dp * m))
        best = choose(self.costs, size, gb, m, planner)
        return Plan(pp=best.pp, dp=best.dp, schedule=pipe.schedule, microbatches=m,
                    stages=best.stages, microbatch_size=gb // (best.dp * m))

    def _live_gen(self) -> dict | None:
        """This rank's stage as a piece of its step, or None where it must not be gone on
        from: with ``recover_from = "commit"``, and where the stage has buffers (BatchNorm's
        running statistics: a failed step's forward may have written them, and nothing
        here takes that back, as the data-parallel engine's BufferStash does)."""
        run = self.run
        if self.runtime.cfg.recover_from != "live" or any(b.numel() for b in run.stage.module.buffers()):
            return None
        return {"step": run.step, "epoch": run.cursor.epoch, "consumed": run.cursor.consumed,
                "extent": run.plan.stages[-1][1],
                "held": {run.children: export_stage(run.stage.module, run.optimizer, copy=False)}}

    def _covering(self, items: list[dict]) -> int | None:
        """The newest step whose pieces, live or committed, make a whole model; None on a
        fresh start (then the checkpoint on disk when resuming, or the seed) and when every
        copy of some stage is gone (then the checkpoint on disk)."""
        step = covering_step(items)
        if step is None and items:   # every copy of some stage is gone: only the disk can help
            held = sorted({i["step"] for i in items})
            self.runtime.events.record("state_lost", None, steps_held=held)
            self.gens = []     # newer than the checkpoint: never to be restored now
            if ckpt.read_manifest(self.engine.train.checkpoint_path.parent) is None:
                raise RuntimeError(f"no commit is fully held by the ranks left (steps held: "
                                   f"{held}) and there is no durable checkpoint to resume from")
        return step

    def _build(self, world, plan: Plan, items: list[dict], step: int | None, held: list[dict],
               hosts: list[str], from_disk: bool) -> dict:
        """This rank's stage under ``plan``: from the pieces of ``step`` (its own, and
        point to point from the ranks holding the others), else from disk or the seed.
        Returns what moved to this rank."""
        self.leave_world()
        init = meeting_point(world, self._broadcast, "regatta.pipe.init_method")
        groups = [[r * plan.pp + s for r in range(plan.dp)] for s in range(plan.pp)]
        transport = GlooTransport(world.rank, world.size, init, groups, world.rank % plan.pp,
                                  timeout_s=120, interface=self.runtime.env.gloo_iface)
        try:
            run = build_run(self.engine.job, self.engine.train, plan, world, transport,
                            self.engine.device)
            moved = self._fill(run, items, step, held) if step is not None else {}
            loaded = resume(run) if step is None and from_disk else None
        except BaseException:
            # a peer lost while the pieces moved: no run holds this group, so close it here
            # (peers blocked on this rank fail at once, and the next world can open its own)
            close_quietly(transport)
            raise
        # only now: a stage whose loading failed is not live state to go on from
        self.run, self.buddy = run, buddies(hosts)
        if step is None and from_disk:
            self.runtime.resumed(self, loaded)
        return {"received_bytes": 0, "move_s": 0.0, **moved}

    def _fill(self, run, items: list[dict], step: int, held: list[dict]) -> dict:
        """Load ``run``'s stage with step ``step``: this rank's own pieces of it, and those
        it lacks received from the ranks holding them (while it sends theirs)."""
        started, plan, world = time.perf_counter(), run.plan, run.world
        mine = {rng: g["held"][rng] for g in held if g["step"] == step for rng in g["held"]}
        needs = [plan.stages[r % plan.pp] for r in range(world.size)]
        pieces, received = send_pieces(run.transport, transfers(items, step, needs), mine, world.rank)
        import_stage(run.stage.module, run.optimizer, pieces)
        item = next(i for i in items if i["step"] == step)
        run.step, run.cursor = step, Cursor(item["epoch"], item["consumed"])
        return {"received_bytes": received, "move_s": round(time.perf_counter() - started, 4)}

    def _record_replan(self, plan: Plan, from_memory: bool, moved: dict, started: float) -> None:
        old = self.last_plan
        new = {"pp": plan.pp, "dp": plan.dp, "stages": [list(s) for s in plan.stages]}
        if old is not None and old != new:
            self.runtime.events.record("replan", self.run.step, old=old, new=new,
                                       size=self.run.world.size, **moved,
                                       cost_s=time.perf_counter() - started,
                                       from_memory=from_memory)
        self.last_plan = new


def close_quietly(transport) -> None:
    try:
        transport.close()
    except Exception:  # noqa: BLE001 - a group whose peers died may not close cleanly
        pass


def recovery_of(source: str, items: list[dict], step: int | None) -> dict:
    """The sync's recovery, named as the data-parallel engine names it: the survivors'
    live stages at the newest step any of them reached (some one step behind took it), a
    commit, or the checkpoint."""
    if source == "live":
        behind = sorted({i["rank"] for i in items if i["live"] and i["step"] < step})
        return {"recovery": "adopted" if behind else "recovered_live", "behind": behind}
    return {"memory": {"recovery": "restored_commit"},
            "checkpoint": {"recovery": "restored_checkpoint"}}.get(source, {})
