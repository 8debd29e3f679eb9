"""Data-parallel training state under Horovod's elastic contract.

Everything a replica must get back after a failure lives here: the model, the optimizer,
and any other object with ``state_dict``/``load_state_dict`` (an LR scheduler, a
GradScaler, the user's own), plus the step and the sampler cursor.

* A commit keeps, in host memory, only this rank's share of that state and its buddy's
  (snapshot.py; placement in runtime/shards.py): 2/dp of it, no communication.
* After a failure the survivors keep their live state (live.py): a failed step applied
  nothing, so at the sync they agree, in the inventory, that they stand at the same
  step and cursor and go on from there; nothing is restored and nothing moves between
  them (``recovered_live``). Ranks one step behind, and new workers, receive the live
  state, a stripe from every rank holding it (``adopted``).
* Only where no rank holds a live state (or ``train.recover_from = "commit"``) does a
  restore go back to the commit: local for the step and cursor, the bytes reassembled in
  ``sync_state`` from whichever survivors hold them (``restored_commit``). Only when some
  share has no surviving copy does the durable checkpoint step in (``state_lost``, then
  ``restored_checkpoint``); with none on disk the job stops with a message saying so.
* A sync where no one holds a commit (a fresh start) sends rank 0's live state (the seed,
  or the checkpoint rank 0 resumed from); new workers get the last commit.
* Rank 0 writes the durable checkpoint from a snapshot in shared memory, from a process at
  the lowest CPU priority for states of 64 MB or more, else from a niced thread
  (runtime/checkpoint_writer.py), so no rank waits for the disk.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from elastic.data.sampler import Cursor
from elastic.runtime import checkpoint
from elastic.runtime.checkpoint_writer import PROCESS_MIN_BYTES, CheckpointWriter
from elastic.runtime.flat import Flat, tree_digest
from elastic.runtime.shards import Part, buddies, cover, covering_step, kept_by, shares
from elastic.runtime.state import RuntimeState

from . import live, snapshot

FORMAT = "regatta-dataparallel/1"
# Opening the world's Gloo group for a sync cost 0.04-0.35 s (digits joining, 2026-12-07),
# a broadcast of 300 KB a few ms: point to point pays for itself from about this many bytes
# (2.4 against 0.37 GB/s at 100M, docs/measurements.md)
POINT_TO_POINT_MIN_BYTES = 64 * 2**20
LIVE_HANDOFF_FORMAT = "regatta-dataparallel-live/1"
HANDOFF_LOCK_S = 1.0     # a sync writing the live tensors this long: hand over the commit only


class TrainState(RuntimeState):
    def __init__(self, runtime, objects: dict, checkpoint_path: Path):
        """``objects``: name -> anything with ``state_dict``/``load_state_dict``; the
        model must be under "model" and the optimizer under "optimizer"."""
        super().__init__(runtime)
        self.objects = dict(objects)
        self.step, self.cursor = 0, Cursor()
        self._checkpoint_path = checkpoint_path
        self._commit: snapshot.Commit | None = None
        self._stale = False              # after a failure: live tensors are not at self.step
        self._live = False               # the live tensors hold the job's state at self.step
        self._receiving = threading.Lock()   # held while a sync writes the live tensors
        self.forward_buffers = live.BufferStash(self.model)   # a failed step's writes, undone
        self._placement: tuple | None = None    # (World, buddies) of the last sync
        self._writer = CheckpointWriter()
        self._checkpointed_step: int | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.objects["model"]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.objects["optimizer"]

    def live(self) -> dict:
        return {"objects": {name: obj.state_dict() for name, obj in self.objects.items()},
                "step": self.step, "epoch": self.cursor.epoch, "consumed": self.cursor.consumed}

    def _load(self, tree: dict) -> None:
        for name, obj in self.objects.items():
            obj.load_state_dict(tree["objects"][name])
        self.step, self.cursor = tree["step"], Cursor(tree["epoch"], tree["consumed"])
        self.optimizer.zero_grad(set_to_none=True)
        self._stale = False
        self._live = True

    @property
    def _current(self) -> bool:
        """The live state is bit for bit the last commit (nothing to fetch for it)."""
        return self._commit is not None and not self._stale and self._commit.step == self.step

    # -- the engine's half of RuntimeState ------------------------------------------------
    def save(self) -> dict:
        flat = Flat.of(self.live())
        if self.runtime.world.is_root and self.runtime.cfg.checkpoint_every \
                and flat.total >= PROCESS_MIN_BYTES:
            self._writer.start()    # its imports now, not inside the first checkpoint
        ranges = list(dict.fromkeys(self._my_ranges(flat.total)))
        held = self._commit is not None and snapshot.merged(self._commit.held) == snapshot.merged(ranges)
        if not (held and self._current and self._commit.total == flat.total):
            self._commit = snapshot.take(flat, self.step, ranges, self._commit)
        # else: the live state was just loaded from (or is) this very commit
        return {"epoch": self.cursor.epoch, "consumed": self.cursor.consumed,
                "held": [list(r) for r in ranges], "held_bytes": self._commit.held_bytes,
                "state_bytes": flat.total}

    def _my_ranges(self, total: int) -> list[tuple[int, int]]:
        world = self.runtime.world
        pieces = shares(total, world.size)
        if self._placement is None or self._placement[0] != world:
            return pieces      # no placement for this world (no sync yet): keep every share
        return [pieces[r] for r in kept_by(self._placement[1], world.rank)]

    def restore_committed(self) -> None:
        """The local half of a restore. A live state stays as it is (the failed step's
        buffer writes undone): ``sync_state`` agrees on it with the other survivors. Else
        the last commit's step and cursor; its bytes are spread over the ranks, so they
        come back in ``sync_state``, after the reset."""
        self.optimizer.zero_grad(set_to_none=True)
        self.forward_buffers.put_back()
        if self._live and self.runtime.cfg.recover_from == "live":
            return
        self._roll_back()

    def _roll_back(self) -> None:
        self._live = False
        if self._commit is None:
            return
        committed = self._commit.skeleton
        self.step, self.cursor = committed["step"], Cursor(committed["epoch"], committed["consumed"])
        self.optimizer.zero_grad(set_to_none=True)
        self._stale = True

    def leave_world(self) -> None:
        self.runtime.engine.leave_world()   # a torch.distributed group of this world's, if any

    def sync_state(self) -> dict:
        world = self.runtime.world
        mine = {"host": world.host, "current": self._current, "live": self._live_summary(),
                "commit": None if self._commit is None else self._commit.summary()}
        inventory = self.runtime.collectives.allgather_object(mine, "regatta.dp.inventory")
        self._placement = (world, buddies([i["host"] for i in inventory]))
        plan = live.choose([i["live"] for i in inventory])
        if plan is not None:
            detail = self._from_live(plan)
        else:
            items = [{"rank": r, **i["commit"]} for r, i in enumerate(inventory) if i["commit"]]
            step = covering_step(items)
            if step is not None:
                detail = self._from_memory(items, step, inventory)
            else:
                detail = self._from_root(items)
        self._live = True
        self.save()
        return detail

    def _live_summary(self) -> dict | None:
        if not self._live or self.runtime.cfg.recover_from != "live":
            return None
        digest = tree_digest(self.live()) if self.runtime.env.audit else None
        return live.summary(self.step, self.cursor.epoch, self.cursor.consumed,
                            Flat.of(self.live()).total, digest)

    def _from_live(self, plan: live.LivePlan) -> dict:
        """The winning live state on every rank that lacks it, striped over the ranks
        that hold it; nothing moves when every rank holds it already."""
        rank = self.runtime.world.rank
        detail = {"source": "live", "recovery": plan.kind, "from_step": plan.step,
                  "senders": list(plan.sources), "behind": list(plan.behind),
                  "disagreeing": list(plan.disagreeing), "moved_bytes": 0, "received_bytes": 0}
        if not plan.needs:
            return detail
        flat = Flat.of(self.live()) if rank in plan.sources else None
        skeleton, total, on_cuda = self.runtime.collectives.broadcast_object(
            (flat.skeleton, flat.total, flat.on_cuda) if rank == plan.sources[0] else None,
            "regatta.dp.skeleton", root=plan.sources[0])
        parts = [Part(owner=owner, start=start, end=end, held=(start, end))
                 for owner, (start, end) in zip(plan.sources, shares(total, len(plan.sources)))
                 if end > start]
        return {**detail, "moved_bytes": total,
                **self._receive(parts, skeleton, list(plan.needs), flat, on_cuda)}

    def _receive(self, parts: list[Part], skeleton, receivers: list[int], holder: Flat | None,
                 on_cuda: bool, held: snapshot.Commit | None = None) -> dict:
        """Each part from its owner, into the live state of each of ``receivers``.
        ``holder``: this rank's live state where it holds the state sent; ``held``: the
        commit whose shares the owners send instead. In place on host tensors, point to
        point over the world's torch.distributed group where Horovod runs on Gloo (a
        broadcast over MPI); through a (pinned) host buffer for a CUDA state. The sync
        event's detail: how it went, the seconds the bytes took to arrive and how many
        this rank received (with the bytes moved: its achieved bandwidth)."""
        world, hvd = self.runtime.world, self.runtime.hvd
        direct = not on_cuda and world.size > 1 and hvd is not None and hvd.gloo_enabled() \
            and point_to_point(self.runtime.cfg.state_transfer, max((p.end for p in parts), default=0))
        if direct:   # opened before the clock starts: transfer_s is the bytes' alone
            self.runtime.group.open_for(world, self.runtime.collectives)
        started = time.perf_counter()
        with self._receiving:
            target = None
            if world.rank in receivers:
                self._live = False     # a transfer cut short leaves these tensors half written
                target = self._target(skeleton)
            here = target if target is not None else holder
            provide = None if held is None else lambda part, start, end: held.piece(part.held, start, end)
            # a broadcast reaches every rank
            transport, received = "broadcast", sum(p.end - p.start for p in parts if p.owner != world.rank)
            if on_cuda:
                read = (lambda part, start, end, out: holder.read(start, end, out)) if held is None \
                    else (lambda part, start, end, _: held.piece(part.held, start, end))
                snapshot.gather(parts, world.rank, hvd, read, target)
            elif direct:
                transport = "point_to_point"
                received = snapshot.send_to(parts, here, world.rank, receivers, provide)
            else:
                snapshot.spread(parts, here, world.rank, hvd, provide)
            arrived = time.perf_counter() - started
            if target is not None:
                self._load(target.tree())
        return {"transport": transport, "transfer_s": round(arrived, 4), "received_bytes": received}

    def _from_memory(self, items: list[dict], step: int, inventory: list[dict]) -> dict:
        """Reassemble commit ``step`` on the ranks whose live state is not already it."""
        rank = self.runtime.world.rank
        parts = cover(items, step)
        detail = {"source": "memory", "from_step": step,
                  "parts": [[p.owner, p.start, p.end] for p in parts]}
        needs = [not (i["current"] and i["commit"]["step"] == step) for i in inventory]
        if not any(needs):
            return {**detail, "moved_bytes": 0, "received_bytes": 0}
        root = min(i["rank"] for i in items if i["step"] == step)
        mine = self._commit if self._commit is not None and self._commit.step == step else None
        skeleton, on_cuda = self.runtime.collectives.broadcast_object(
            (mine.skeleton, Flat.of(self.live()).on_cuda) if rank == root else None,
            "regatta.dp.skeleton", root=root)
        # a rank not receiving holds the commit live: its tensors take the bytes
        receivers = [r for r, needed in enumerate(needs) if needed]
        transfer = self._receive(parts, skeleton, receivers, None if needs[rank] else Flat.of(self.live()),
                                 on_cuda, held=mine)
        return {**detail, "recovery": "restored_commit", "moved_bytes": parts[-1].end if parts else 0,
                **transfer}

    def _from_root(self, items: list[dict]) -> dict:
        """Rank 0's live state everywhere: a fresh start, or after reloading the durable
        checkpoint when the commits held among the ranks left have a gap."""
        rank = self.runtime.world.rank
        lost = bool(items)
        if lost:
            held = sorted({i["step"] for i in items})
            self.runtime.events.record("state_lost", None, steps_held=held)
            self._commit = None      # its step is about to go back to the checkpoint's
        error = self._reload_checkpoint(held) if lost and rank == 0 else None
        flat = Flat.of(self.live()) if rank == 0 else None
        skeleton, total, on_cuda, error = self.runtime.collectives.broadcast_object(
            (flat.skeleton, flat.total, flat.on_cuda, error) if rank == 0 else None, "regatta.dp.skeleton")
        if error:
            raise checkpoint.CheckpointError(error)
        parts = [Part(owner=0, start=0, end=total, held=(0, total))]
        transfer = self._receive(parts, skeleton, list(range(1, self.runtime.world.size)), flat, on_cuda)
        return {"source": "checkpoint" if lost else "root", "from_step": self.step, "moved_bytes": total,
                **transfer,
                **({"recovery": "restored_checkpoint"} if lost else {})}

    def _target(self, skeleton) -> Flat:
        """Where a state with ``skeleton`` is received: straight into the live tensors when
        they have its layout (a survivor's do: no allocation, no copy afterwards), else
        into fresh ones (a new worker has no optimizer state yet)."""
        return Flat.of(self.live()).into(skeleton) or Flat.empty(skeleton)

    def _reload_checkpoint(self, held: list[int]) -> str | None:
        """Load the durable checkpoint into the live state; an error message, or None."""
        # A write of this rank's may be in flight: its checkpoint is newer than the one on
        # disk now, and loading before it lands would redo steps for nothing.
        self._writer.wait()
        try:
            saved = checkpoint.load(self._checkpoint_path, expect=FORMAT)
        except checkpoint.CheckpointError as err:
            return str(err)
        if saved is None:
            return (f"no commit is fully held by the ranks left (steps held: {held}) and there "
                    f"is no durable checkpoint at {self._checkpoint_path} to resume from")
        self._load(saved)
        return None

    def write_checkpoint(self):
        """Rank 0: snapshot the live state, then write it in the background; a Future of
        the checkpoint event's detail."""
        if not self.runtime.world.is_root:
            self._writer.close()      # rank 0 of an earlier world: its memory is no use now
            return None
        if self._checkpointed_step == self.step:
            return None
        self._checkpointed_step = self.step
        return self._writer.submit(self._checkpoint_payload, self._checkpoint_path)

    def _checkpoint_payload(self) -> dict:
        """The live state: the writer copies it into its shared memory at once."""
        return {"format": FORMAT, "run_id": self.runtime.run_id,
                "world_size": self.runtime.world.size, **self.live()}

    def load_checkpoint(self) -> dict | None:
        saved = checkpoint.load(self._checkpoint_path, expect=FORMAT)
        if saved is None:
            return None
        self._load(saved)
        return {"path": str(self._checkpoint_path), "saved_world_size": saved["world_size"],
                "run_id": saved["run_id"]}

    def write_handoff(self, path: Path) -> None:
        """This rank's part of the last commit (its shares, step and cursor), for the
        worker that replaces it in place (elastic/failures/restart.py)."""
        if self._commit is not None:
            snapshot.save_commit(self._commit, Path(path))

    def write_live_handoff(self, path: Path) -> bool:
        """The live state, for the worker that replaces this one in place, where it is
        whole: not while a sync writes into it (or within HANDOFF_LOCK_S of waiting for
        one stuck on a dead peer), not after a roll-back. Whether it was written."""
        if not self._receiving.acquire(timeout=HANDOFF_LOCK_S):
            return False
        try:
            if self._live_summary() is None:
                return False
            checkpoint.save_atomic({"format": LIVE_HANDOFF_FORMAT, **self.live()}, Path(path))
            return True
        finally:
            self._receiving.release()

    def load_handoff(self, path: Path, live: Path | None = None) -> None:
        """A predecessor's part of the commit: held as this rank's own, so the sync after
        the reset can take its bytes from here; and its live state where it left one, to
        go on from as the survivors do."""
        self._commit = snapshot.load_commit(Path(path))
        saved = checkpoint.load(Path(live), expect=LIVE_HANDOFF_FORMAT) if live is not None else None
        if saved is not None:
            self._load(saved)
        self.restore_committed()

    def audit_hash(self) -> dict | None:
        """Digests of the model, of the optimizer state, and of everything committed
        together (model, optimizer, scheduler, scaler, tracked objects, step and cursor);
        None while the live state waits for a restore to finish in sync."""
        if self._stale:
            return None
        return {"param_hash": checkpoint.parameter_hash(self.model),
                "optimizer_hash": tree_digest(self.optimizer.state_dict()),
                "state_hash": tree_digest(self.live())}


def point_to_point(setting: str, nbytes: int) -> bool:
    """Whether a sync moving ``nbytes`` goes point to point (``train.state_transfer``);
    every rank decides alike, from the same parts."""
    if setting == "auto":
        return nbytes >= POINT_TO_POINT_MIN_BYTES
    return setting == "point_to_point"
