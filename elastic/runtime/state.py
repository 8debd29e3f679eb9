"""The runtime's half of Horovod's elastic state contract, the same for every engine.

Horovod's ``hvd.elastic.run`` calls ``sync`` on every (re)entry, ``restore`` after a failed
collective and ``on_reset`` after re-initialising; its driver's notifications arrive
through ``on_hosts_updated``. ``RuntimeState`` does what every engine needs around those
calls (events, lifelines, the commit policy, a new World) and leaves the state itself to
the engine, which implements:

    save()                 snapshot the live state in memory (a commit); the commit
                           event's detail
    restore_committed()    put the last snapshot back (after a failure), locally; what
                           needs the other ranks waits for sync_state
    sync_state()           make every rank hold the same state (new workers included);
                           the sync event's detail
    write_checkpoint()     the durable copy: the checkpoint event's detail, or a PendingWrite
                           (checkpoint_writer) when it goes on in the background; ``load_checkpoint()``
                           resumes from it
    audit_hash()           digests of the state (REGATTA_AUDIT=1 records them): a string
                           (the model's) or a dict of named digests
    leave_world()          optional: release what belongs to this world before a reset
    write_handoff(path)    optional: this rank's commit to a file, and load_handoff(path,
                           live) to take it up; with them a rank stuck while the world
                           re-forms is replaced in place with its commit (elastic/failures/recovery.py)
    write_live_handoff(path)  optional: the live state too, where it is whole (a bool);
                           load_handoff then gets its path as ``live``

Host updates use two public seams of Horovod's ``State``: ``on_hosts_updated`` (the
listener the notification manager calls) and ``check_host_updates``, overridden to return
the pending flags instead of broadcasting: the step's own agreement carries them
(control.py), so every rank leaves at the same step without an extra collective.
"""
from __future__ import annotations

import threading
import time

from horovod.common.elastic import State


class RuntimeState(State):
    step: int = 0

    def __init__(self, runtime):
        super().__init__(bcast_object=None, get_rank=lambda: runtime.world.rank)
        self.runtime = runtime
        self._updates_lock = threading.Lock()
        self._pending_updates = 0
        self.interrupted_at: float | None = None   # when this membership change was noticed
        self.restored_from: int | None = None      # step a failure interrupted, until re-entry

    # -- Horovod's seams ---------------------------------------------------------------
    def on_hosts_updated(self, timestamp, update_res) -> None:
        with self._updates_lock:
            self._pending_updates |= int(update_res)

    def check_host_updates(self) -> int:
        """The host-update flags received since the last call (no broadcast, no raise)."""
        return self.take_host_updates()

    def take_host_updates(self) -> int:
        """What the runtime reads at every step (a state may give ``check_host_updates``
        Horovod's own meaning: regatta.horovod's raises)."""
        with self._updates_lock:
            flags, self._pending_updates = self._pending_updates, 0
        if flags and self.interrupted_at is None:
            self.interrupted_at = time.time()
        return flags

    def commit(self) -> None:   # Horovod's commit; the runtime commits through its policy
        self.runtime.commit(self, "periodic")

    def prepare_reset(self) -> None:
        """Before Horovod re-initialises: after a failure, or for a planned membership change."""
        self.leave_world()
        self.runtime.before_reset()

    def restore(self) -> None:
        """After a failed collective, before Horovod re-initialises."""
        # Noticed now: leaving the world can take a while (Horovod's shutdown)
        self.interrupted_at = self.interrupted_at or time.time()
        self.prepare_reset()
        failed_at = self.restored_from = self.step
        self.restore_committed()
        self.runtime.restored(self, failed_at)

    def reset(self) -> None:
        with self._updates_lock:
            self._pending_updates = 0
        self.runtime.was_reset(self)

    def sync(self) -> None:
        started = time.perf_counter()
        self.runtime.new_world()
        detail = self.sync_state() or {}
        self.runtime.synced(self, time.perf_counter() - started, detail)

    # -- what an engine provides ---------------------------------------------------------
    def save(self) -> None:
        raise NotImplementedError

    def restore_committed(self) -> None:
        raise NotImplementedError

    def sync_state(self) -> dict | None:
        raise NotImplementedError

    def write_checkpoint(self):
        """Write the durable copy; returns the checkpoint event's detail, a PendingWrite
        (checkpoint_writer: a write in the background), or None (not this rank)."""
        raise NotImplementedError

    def load_checkpoint(self) -> dict | None:
        """Resume from the durable copy; returns the resume event's detail, or None."""
        raise NotImplementedError

    def audit_hash(self) -> str | dict | None:
        raise NotImplementedError

    def leave_world(self) -> None:
        """Release what belongs to this world only (e.g. a torch.distributed group)."""
