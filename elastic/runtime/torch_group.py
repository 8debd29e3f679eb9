"""A torch.distributed Gloo group that lives for one world of a run, and its failures as
the error Horovod's elastic loop restores from.

Its users: the pipeline's transport under ``horovodrun`` (pipeline/gloo_transport.py),
which opens its own; and :class:`WorldGroup`, the runtime's one group per world, shared by
the data-parallel gradient buckets with ``train.gradient_sums = "gloo"``
(dataparallel/gloo_sums.py) and the sync's point-to-point transfer of the state to the
ranks that need it (dataparallel/snapshot.py ``send_to``). Each group is opened after
``hvd.init`` and before the runtime's recovery takes stock of the world's connections
(recovery.py ``enter``), so a peer's death shuts the group's sockets as it shuts
Horovod's, and a blocked operation raises at once; each is destroyed before the next reset.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
from contextlib import contextmanager

import torch.distributed as dist

from elastic.failures.addresses import host_address


def open_default_group(init_method: str, rank: int, size: int, timeout_s: float,
                       interface: str = "") -> None:
    """torch.distributed's default Gloo group over ``size`` ranks meeting at ``init_method``,
    its connections on ``interface`` (horovodrun's ``--network-interface``) unless
    ``GLOO_SOCKET_IFNAME`` names one: torch's Gloo would otherwise take the address the
    machine's host name resolves to, a loopback one on many Linux installs. After a failed
    attempt torch is left as a fresh process finds it (:func:`forget_group`)."""
    if interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        with contextlib.suppress(Exception):   # the first error is the one to report
            forget_group()
        raise


def forget_group() -> None:
    """Leave torch.distributed as a fresh process finds it, whatever state a group that
    failed to form (a peer died meanwhile) left it in. torch names the default group by
    how many it has made (its store keys start with that name), and only destroying one
    resets the count: after a failed attempt this rank's next group would take a name a
    fresh process (a replacement, an added host) does not, and the two would wait for each
    other's keys until the timeout. Hence a group of one, made only to be destroyed."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()


class WorldGroup:
    """torch.distributed's default Gloo group over the runtime's current world, opened by
    the first in a world that needs it (the sync's transfer to new workers, then the
    gradient sums reuse it; or the sums alone) and closed before the next reset.
    Horovod's Gloo interface and timeout apply (``env``: horovodrun's
    ``--network-interface`` and ``--gloo-timeout-seconds``)."""

    def __init__(self, env):
        self._env = env
        self._world = None     # the world the open group spans; None: none open

    def open_for(self, world, collectives) -> None:
        """Every rank of ``world`` calls it together; rank 0 picks the address and sends
        it over ``collectives`` (Horovod's). Nothing happens where it is open already."""
        if self._world == world:
            return
        self.close()
        init = meeting_point(world, collectives.broadcast_object, "regatta.world_group")
        with translated("the world's torch.distributed group"):
            open_default_group(init, world.rank, world.size, self._env.gloo_timeout_s,
                               self._env.gloo_iface)
        self._world = world

    def is_open_for(self, world) -> bool:
        return self._world == world

    def close(self) -> None:
        """Destroy the group; one whose peers died may not close cleanly, and is then
        forgotten all the same. Only an open one is destroyed: another call would destroy
        whatever default group exists by then (the pipeline's)."""
        if self._world is not None:
            self._world = None
            with contextlib.suppress(Exception):
                forget_group()


def comm_error(err: RuntimeError) -> bool:
    """Whether ``err`` is a failure to communicate (a peer gone, a connection shut)."""
    text = str(err).lower()
    return isinstance(err, getattr(dist, "DistError", ())) or any(
        word in text for word in ("connection", "gloo", "timed out", "broken pipe", "socket", "peer"))


@contextmanager
def translated(what: str):
    """torch.distributed's failures as the error ``hvd.elastic.run`` restores from."""
    try:
        yield
    except RuntimeError as err:
        # Imported here: a pipeline under mpirun uses this module and never loads Horovod.
        from horovod.common.exceptions import HorovodInternalError
        if isinstance(err, HorovodInternalError) or not comm_error(err):
            raise
        raise HorovodInternalError(f"{what}: {err}") from err


def meeting_point(world, broadcast, name: str) -> str:
    """Where a world's group meets: an address and free port of rank 0's host, sent to
    every rank by ``broadcast(obj, name)`` (the runtime's collectives)."""
    mine = f"tcp://{host_address(world.host)}:{free_port()}" if world.is_root else None
    return broadcast(mine, name)


def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
