"""A torch.distributed Gloo group that lives for one world of a run, and its failures as
the error Horovod's elastic loop restores from.

Two users: the pipeline's transport under ``horovodrun`` (pipeline/gloo_transport.py) and
the data-parallel gradient buckets with ``train.gradient_sums = "gloo"``
(dataparallel/gloo_sums.py). Each opens its group after ``hvd.init`` and before the
runtime's recovery takes stock of the world's connections (recovery.py ``enter``), so a
peer's death shuts the group's sockets as it shuts Horovod's, and the blocked sum raises
at once; each destroys its group before the next reset.
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
