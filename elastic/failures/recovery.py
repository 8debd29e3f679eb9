"""Fast failure detection for a Horovod worker: survivors leave a blocked collective
within a second of a peer's death instead of waiting out Gloo's receive timeout, and a
death during the recovery itself starts it over instead of hanging it.

The lifelines (lifeline.py) say who died. While training, this module then shuts down
this rank's Gloo peer connections (a shutdown on a dup of each fd), which makes Horovod
raise ``HorovodInternalError`` in the blocked collective; ``hvd.elastic.run`` restores
the last commit and resets. Only connections made since the last ``hvd.init`` began are
touched (see :class:`ConnectionBaseline`): Horovod's Gloo's, and those of a
torch.distributed group opened for the world before the loop is entered (the pipeline's
transport, the data-parallel buckets' sums); never the driver's, the metrics sink's or a
lifeline.

The lifelines of a generation stay up until the next one is built, so deaths during a
recovery are seen too. Until ``hvd.init`` returns nothing can be severed (Gloo's
rendezvous aborts the process instead of raising), so a survivor stuck there is restarted
in place (restart.py); after it, the new world's connections are severed as above.
Gloo can abort a survivor before anyone has marked the rendezvous (a peer's socket closes
the instant it dies, mid mesh connection): so each re-forming starts by leaving this
rank's commit where a replacement finds it, and the agent replaces a worker that aborted
while its hand-off was out (restart.py, handoff.py). The hand-off stays out until the loop
is entered: a death just after ``hvd.init`` can leave a survivor's Horovod background loop
waiting in Gloo for the dead peer until Gloo's timeout (30 s), with no connection left to
sever (Gloo had closed it; the receive was posted after). Such a rank is restarted in
place: one still in the sync :data:`GLOO_STUCK_S` after the sever, or in the training
step's collective :data:`STEP_STUCK_S` after it, or one whose ``hvd.shutdown`` (which
joins that loop) has not returned GLOO_STUCK_S after the re-forming began.

A rank restarted in place says goodbye on its lifelines (its replacement takes the slot:
no death to its peers), and one already placed in a rendezvous marks it (the rest of that
rendezvous is replaced too, rather than waiting out Gloo's 30 s for it).

The runtime calls ``before_init`` before every (re)initialisation, ``adopt`` once its
training state exists, ``enter`` on (re)entering its training loop, ``close`` at the end.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from . import restart
from .addresses import host_address
from .faults import FaultPlan
from .gloo_sockets import ConnectionBaseline, sever
from .handoff import Handoff
from .lifeline import BuildFailed, Lifeline
from .liveness import Heartbeat


RENDEZVOUS_GRACE_S = 1.0   # a rendezvous of live workers takes a fraction of this
GLOO_STUCK_S = 2.0         # a severed collective raises, and a shutdown returns, in ms
STEP_STUCK_S = 0.5  # 1,248 of 1,252 severed step collectives (13 chaos runs) raised in 0.087 s
STEP_STUCK_STEPS = 2.0   # and at least this many step times: the step may still be computing
LAST_ROWS_S = 1.0          # how long a worker that leaves at once waits for its store rows


def leave_now(events, code: int) -> None:
    """End this process at once, without the cleanup a normal exit runs (the recovery must
    not wait on it), but with its store rows sent first: its sink's queue would go with it."""
    events.flush(LAST_ROWS_S)
    os._exit(code)


class FastRecovery:
    """Glue for the training loop: which sockets are Gloo's, the current lifelines, and
    what a death means in each phase (training, or re-forming the world)."""

    def __init__(self, events, heartbeat: Heartbeat, stall_after: float = 5.0,
                 dies_recovering=lambda step: "", committed_step=lambda: None,
                 step_time=lambda: 0.0) -> None:
        self.events, self.heartbeat, self.stall_after = events, heartbeat, stall_after
        self.step_time = step_time               # the recent step time, seconds (0: unknown)
        self.committed_step = committed_step     # the step of the commit a restore goes back to
        self.dies_recovering = dies_recovering   # a planned fault (faults.py): step -> when
        self.baseline = ConnectionBaseline()
        self.lifeline: Lifeline | None = None
        self.gloo: list = []
        self.state = None               # the training state a replacement gets (adopt)
        self.entered = False            # this process holds the job's state (it synced)
        self._armed = False             # training: the next death severs Gloo
        self._broken = threading.Event()   # a peer of the world entered died (world_broken)
        self._forming = False           # from before_init until enter's lifelines: the world re-forms
        self._building = False          # enter is building the lifelines (self.gloo is this world's)
        self._episode = 0               # which re-forming (each has its own watch)
        self._death_seen_at = 0.0       # the last death a lifeline reported while re-forming
        self._doomed = ""               # when a planned fault kills this rank in this re-forming
        self._handed_step: int | None = None    # a replacement's: its predecessor's step
        self._handoff: Handoff | None = None   # out from before_init until the loop is entered
        self._last_size = 1             # the size of the world last entered
        self._horovod_sockets = 0       # Horovod's Gloo connections in that world
        self._leaving = threading.Lock()   # held by the one thread that restarts this rank

    # -- the runtime's calls ----------------------------------------------------------------
    def before_init(self) -> None:
        """Call before anything (re)initialises Horovod: a restore, a planned reset."""
        self._armed = self._building = False
        self._episode += 1   # the watch of the world being left ends here
        self.baseline.mark()
        self._death_seen_at = 0.0
        # This process's first initialisation, not "never entered": a fresh worker whose
        # first rendezvous failed is re-forming like any survivor (its place to be assigned,
        # older restart marks meaning nothing); taken for a first one, it asked to be
        # replaced on the old mark while its own re-initialisation registered its slot,
        # and its replacement then waited for the next world, 30 s.
        first = self._episode == 1
        replacing = first and bool(os.environ.get(restart.HANDOFF_ENV))
        # A replacement carries its predecessor's step, and its fate: a host planned to die
        # in this re-forming dies in it even when its worker was replaced meanwhile.
        if replacing:
            self._handed_step = restart.handed_step(Path(os.environ[restart.HANDOFF_ENV]))
        carried = self._carried_step()
        self._doomed = "" if carried is None else self.dies_recovering(carried)
        if replacing:
            self._take_place()
            # Out under this worker's name at once: replaced again before it loads the
            # commit (the world it joined was doomed too), its successor still finds it.
            self._handoff = Handoff(restart.own_handoff_path(), None, placed=True,
                                    step=self._handed_step,
                                    predecessor=Path(os.environ[restart.HANDOFF_ENV]))
        elif first:
            # A fresh worker (the first world's, or an added host's) starts placed: a death
            # in its first rendezvous replaces it too, stateless, instead of leaving it in
            # Gloo for 30 s and its host excluded (seen in a chaos run: rank 0 killed while
            # an added host joined).
            self._put_handoff(placed=True)
        if not first:
            restart.await_assignment()
            self._put_handoff()
        self._forming = True
        threading.Thread(target=self._watch_forming, args=(self._episode,), name="regatta-forming",
                         daemon=True).start()

    def adopt(self, state) -> None:
        """The training state: a replacement resumes from the commit its predecessor left
        (``state.load_handoff``); this process leaves one the same way (``write_handoff``)."""
        self.state = state
        path = self._handoff.path if self._handoff is not None else None
        if path and path.exists() and hasattr(state, "load_handoff"):
            live = restart.live_handoff_path(path)
            state.load_handoff(path, live if live.exists() else None)
            self.entered = True          # it holds the job's state, as its predecessor did
            self.events.record("handoff_loaded", state.step, path=str(path), live=live.exists())

    def initialised(self) -> None:
        """Call once ``hvd.init`` has returned, before the sync changes the commit: the
        hand-off's file is complete first (the sync rewrites the buffers it is read from);
        it stays out until the loop is entered."""
        if self._doomed == "syncing":
            FaultPlan.kill_now(self.events, self._carried_step(), syncing=True)
        if self._doomed == "connecting":
            # The watch missed the instant: not scheduled while Gloo made the last
            # connections (half a second without a poll seen on a loaded machine; the world
            # formed with the doomed worker alive in 9 runs of 12 beside two busy loops).
            # The planned death comes now, just late, rather than never.
            FaultPlan.kill_now(self.events, self._carried_step(), connecting=True, after_init=True)
        # Horovod's own, before a torch.distributed group of this world adds its own.
        self._horovod_sockets = len(self.baseline.gloo_connections(exclude_fds=set()))
        if self._handoff is not None:
            self._handoff.written()

    def _withdraw(self) -> None:
        if self._handoff is not None:
            self._handoff.withdraw()
            self._handoff = None

    def enter(self, world, allgather) -> None:
        """Call on (re)entering the training loop, after ``hvd.init`` and sync.
        ``allgather(obj, name)`` returns every rank's ``obj`` in rank order (under
        Horovod: ``hvd.allgather_object(obj, name=name)``). The re-forming's watch and
        hand-off stay until the new lifelines are up: a death while they are built (their
        address exchange is a Horovod collective) is marked by its agent, and Gloo can
        leave a survivor waiting out its 30 s timeout there (1 kill in 20 in a chaos run)."""
        restart.settle_environment()
        self.entered = True
        if self.lifeline is not None:   # peers still forming must not take this for a death
            self.lifeline.close(goodbye=True)
            # Forgotten now: a death while the next one is built (its allgather raises) would
            # leave the closed one here, and closing it again writes to another socket's fds.
            self.lifeline = None
        self.gloo = self.baseline.gloo_connections(exclude_fds=set())
        self._building = True   # from here the watch severs self.gloo, not the lifelines' own
        self._last_size = world.size
        server = restart.rendezvous_server()
        if self._doomed == "entering":
            FaultPlan.kill_now(self.events, self._carried_step(), entering=True)
        try:
            self.lifeline = Lifeline(world.rank, world.size, world.host, host_address(world.host),
                                     allgather, self.heartbeat, self._on_death, self._on_stall,
                                     self.stall_after, given_up=lambda: restart.marked(server))
        except BuildFailed as err:
            # A death in this world (its agent marked it) or a peer that never dialled:
            # recover as from a failed collective, not end this healthy worker (its host
            # would be counted failed).
            from horovod.common.exceptions import HorovodInternalError
            self.events.record("lifeline_failed", self.heartbeat.step, error=str(err))
            raise HorovodInternalError(str(err)) from None
        self._forming = self._building = False
        self._withdraw()
        restart.hand_lifelines_to_agent(list(self.lifeline.peers))
        self._broken.clear()
        self._armed = True
        self.events.record("lifeline", None, peers=len(self.lifeline.peers),
                           gloo_sockets=len(self.gloo))

    def close(self) -> None:
        self._forming = False
        self._withdraw()
        if self.lifeline is not None:
            self.lifeline.close(goodbye=True)
            self.lifeline = None

    def world_broken(self) -> bool:
        """A peer of the world this rank trains in has died: the step in progress can no
        longer be summed, so computing the rest of it only delays the recovery (at 100M
        parameters x Adam a backward takes seconds here)."""
        return self._broken.is_set()

    # -- deaths and stalls ------------------------------------------------------------------
    def _on_death(self, rank: int, host: str, how: str, when: float) -> None:
        if how == "timeout" and not restart.driver_reachable():
            # Every peer falls silent at once for a rank whose own link is down: it is
            # the one cut off. Leaving lets the driver count it failed now, not when its
            # re-initialisation gives up on the driver many seconds later.
            self.events.record("cut_off", self.heartbeat.step, peer_rank=rank, target=host)
            leave_now(self.events, restart.CUT_OFF_EXIT)
        if self._armed:
            self._armed = False   # one reset per generation: the rest is the recovery's
            self._broken.set()
            severed = sever(self.gloo)
            self.events.record("peer_lost", self.heartbeat.step, peer_rank=rank, target=host,
                               severed=severed, how=how)
            threading.Thread(target=self._watch_sever, args=(self._episode,),
                             name="regatta-sever", daemon=True).start()
            return
        # Already recovering: this rank may have left the collective (its peers' severed
        # connections) before its own lifeline told it of the death that started it. A
        # process's death is marked by its agent; a vanished host's agent cannot say so,
        # so say it for it.
        self.events.record("peer_lost", self.heartbeat.step, peer_rank=rank, target=host,
                           how=how, while_recovering=True)
        self._death_seen_at = time.time()
        if how == "timeout":
            threading.Thread(target=restart.put_mark, daemon=True,
                             args=(restart.rendezvous_server(), f"{host} timed out")).start()

    def _watch_sever(self, episode: int) -> None:
        """A severed collective raises in milliseconds. One still waiting STEP_STUCK_S later
        is Horovod's background loop in a Gloo receive posted after Gloo had closed that
        connection, as in the sync: it would wait out Gloo's 30 s. Restart in place. The
        heartbeat says "in the step", not "in its collective": a big model's rank may still
        be computing its backward when the news comes (at 100M parameters here, for
        seconds), and raises when it reaches the wait; so the wait is also at least
        STEP_STUCK_STEPS step times (a restart in place costs it its live state)."""
        stuck = lambda: self._episode == episode and self.heartbeat.waiting  # noqa: E731
        deadline = time.time() + max(STEP_STUCK_S, STEP_STUCK_STEPS * self.step_time())
        while time.time() < deadline:
            time.sleep(0.05)
            if not stuck():     # it raised (a restore may take a while yet), or it re-formed
                return
        restart.await_assignment()    # its replacement waits for the world forming next
        self._put_handoff()
        if stuck():   # its step is abandoned as a failed one is: it restores the last commit
            self._restart_in_place("the step's collective still waited on Gloo after the sever",
                                   abandoned_step=self.heartbeat.step)

    def _on_stall(self, kind: str, rank: int, host: str, **detail) -> None:
        self.events.record(kind, self.heartbeat.step, stalled_rank=rank, target=host, **detail)

    # -- while the world re-forms -----------------------------------------------------------
    def _watch_forming(self, episode: int) -> None:
        """Until the loop is entered again, by phase: Horovod's shutdown of the world left
        (which cannot end while Gloo holds its background loop in a wait for a dead peer:
        then this rank is restarted in place); the driver placing the workers (a death is
        the driver's to handle, and older marks mean nothing); Gloo's rendezvous (a death
        restarts this rank in place); the sync (a death severs the new world's connections,
        which fails it at once, else restarts this rank in place)."""
        import horovod.torch as hvd
        server, began = restart.rendezvous_server(), time.time()
        went_down, came_up, severed_at, assigned_at = not hvd.is_initialized(), False, 0.0, None
        doomed, placed = self._doomed == "connecting", False
        while self._forming and self._episode == episode:
            # Quick until placed: the agent must not take a placed rank for a removed one.
            time.sleep(0.0002 if doomed else 0.02 if placed else 0.002)
            initialised = hvd.is_initialized()
            if doomed and went_down and restart.assigned() and self._last_connection_due():
                FaultPlan.kill_now(self.events, self._carried_step(), connecting=True)
            went_down = went_down or not initialised
            if not went_down:
                if time.time() - began > GLOO_STUCK_S:
                    self._restart_in_place("Horovod's shutdown waited on Gloo for a dead peer")
                continue
            if not placed and restart.assigned():
                placed, handoff = True, self._handoff
                if handoff is not None:   # withdrawn meanwhile: describe() does nothing
                    handoff.describe(restart.current_slot(), placed=True)   # local ranks move
            if initialised:
                came_up = True
                if not severed_at and restart.marked(server):
                    count = sever(self.gloo if self._building else
                                  self.baseline.gloo_connections(exclude_fds=set()))
                    self.events.record("severed_while_recovering", self.heartbeat.step, severed=count)
                    severed_at = time.time()
                elif severed_at and time.time() - severed_at > GLOO_STUCK_S:
                    self._restart_in_place("Gloo still waited for a dead peer after the sever")
            elif not came_up and restart.assigned():   # (came up, then down: its sync raises)
                assigned_at = assigned_at or time.time()
                if restart.marked(server):
                    self._restart_in_place("a peer died during the rendezvous")
                # The agent's mark can be swept away by the very assignment that still
                # counted the dead worker in; then this rank's own lifeline is the witness.
                since = max(self._death_seen_at, assigned_at)
                if self._death_seen_at and time.time() - since > RENDEZVOUS_GRACE_S:
                    self._restart_in_place("the rendezvous stalled after a peer died")

    def init_failed(self) -> None:
        """``hvd.init`` failed while the world re-formed: Gloo's connections to a member
        that died in the meantime broke (``Read error``). Like a rank that saw the restart
        mark, be replaced with the hand-off, rather than end and have this healthy host
        counted failed; returns only when there is no agent or no hand-off to do it with."""
        if self._forming:
            self._restart_in_place("Horovod's initialisation failed while the world re-formed")

    def _can_be_replaced(self) -> bool:
        """Whether a fresh worker could take this one's place with nothing lost: there is
        an agent to start it, and whatever state this one holds can be handed over."""
        return bool(os.environ.get(restart.AGENT_CHILD_ENV)) and \
            (not self.entered or hasattr(self.state, "write_handoff"))

    def _carried_step(self) -> int | None:
        """The step of the state this process carries into a re-forming (None: a fresh
        worker's). A replacement that loaded its predecessor's commit holds that step before
        its heartbeat has counted one; one that has not loaded it yet, the step handed over."""
        if not self.entered:
            return self._handed_step
        return max(self.heartbeat.step, getattr(self.state, "step", 0) or 0)

    def _put_handoff(self, placed: bool = False) -> None:
        self._withdraw()   # one hand-off out at a time (a reset can follow a restore)
        if self._can_be_replaced():
            self._handoff = Handoff(restart.own_handoff_path(),
                                    self.state if self.entered else None, placed=placed,
                                    step=self._carried_step())

    def _last_connection_due(self) -> bool:
        """Whether Gloo has made all but the last of this rank's connections to the world
        re-forming (as many per peer as in the last world): the survivors have connected
        and are in Horovod's first collectives, which abort the process on a death."""
        size = int(restart.assigned_size())
        per_peer = self._horovod_sockets // max(1, self._last_size - 1)
        made = len(self.baseline.gloo_connections(exclude_fds=set()))
        return made >= max(1, per_peer * (size - 1) - 1)

    def _restart_in_place(self, reason: str, abandoned_step: int | None = None) -> None:
        if self._handoff is None:
            return   # no agent, or state that cannot be handed over: Horovod's timeout it is
        # The watch and the main thread (init_failed) can both see a reason at once: the
        # second waits here for the first one's exit, so the replacement is asked for once.
        self._leaving.acquire()   # released by nobody: this process is ending
        if abandoned_step is not None:   # the restore a failed step records (Runtime.restored)
            step = self.committed_step()
            self.events.record("restore", step, from_step=abandoned_step, in_place=True,
                               steps_redone=None if step is None else abandoned_step - step)
        placed = restart.assigned()
        self._handoff.describe(restart.current_slot(), placed=placed)
        written = self._handoff.written()
        live = self._hand_over_live()
        if placed:
            # The rest of the rendezvous under way would wait out Gloo's 30 s for this rank
            # (seen: 150 s of such waits in a row); marked, they are replaced at once too.
            who = f"{os.environ.get('HOROVOD_HOSTNAME')} pid {os.getpid()}"
            restart.put_mark(restart.rendezvous_server(), f"{who} restarts in place")
        lifeline = self.lifeline
        if lifeline is not None:
            # Its replacement takes the slot: to the peers this is no death, which would start
            # their watch of a rendezvous this rank's replacement is not slow to join.
            lifeline.close(goodbye=True)
        self.events.record("restart_in_place", self.heartbeat.step, reason=reason, handoff=written,
                           live=live, marked=placed)
        leave_now(self.events, restart.RESTART_EXIT)

    def _hand_over_live(self) -> bool:
        """While the world re-forms, no step is under way and the live state is whole
        (a failed step applied nothing): handed over, the replacement goes on from it as
        the other survivors do, instead of rolling back to the commit (whose shares may
        have died with the failure). A step stuck in Gloo hands over its commit only."""
        if not (self._forming and self.entered and hasattr(self.state, "write_live_handoff")):
            return False
        return self.state.write_live_handoff(restart.live_handoff_path(self._handoff.path))

    def _take_place(self) -> None:
        """A replacement: this slot's place in the world now forming, or leave."""
        if not restart.take_assignment(os.environ.get("HOROVOD_HOSTNAME", socket.gethostname())):
            self.events.record("no_place", None)
            leave_now(self.events, 0)
