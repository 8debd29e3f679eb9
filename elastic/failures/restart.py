"""Restarting a worker in place when a peer dies while the survivors re-form the world.

Horovod's Gloo rendezvous (inside ``hvd.init``) cannot be left: a member of the new world
that dies during it leaves the others waiting for its key until Gloo's timeout (30 s),
and the exception that ends the wait is thrown in Horovod's background thread, where
nothing catches it: the process aborts and its host is counted failed. So nobody waits:

* whoever sees a death first (the dead worker's agent, which reaps it; or a survivor's
  lifeline) puts a *restart mark* in horovodrun's rendezvous store. Horovod clears the
  store whenever it assigns a new world, so a mark only ever concerns the world whose
  rendezvous is under way.
* a survivor inside that rendezvous (not in the driver's earlier wait for every worker to
  report, where a death is Horovod's to handle: :func:`assigned` tells the two) exits with
  :data:`RESTART_EXIT`, its last commit in a hand-off file (written as each re-forming
  starts). Its warm agent forks a fresh worker for the same slot at once: horovodrun sees
  one process that never exited. A worker that Gloo aborted (SIGABRT) while its hand-off
  was out is replaced the same way: that abort is the rendezvous failing, not the host.
* the fresh worker asks the driver for its slot's rank, as Horovod's own re-initialisation
  does, and resumes from the hand-off; the recovery starts over with whoever is left.
"""
from __future__ import annotations

import ctypes
import functools
import http.client
import json
import os
import socket
import tempfile
from pathlib import Path

from ..launch.dying import send_lifelines
from ..whole_files import replace_text

RESTART_EXIT = 76   # "replace me": the agent forks a fresh worker for the slot
CUT_OFF_EXIT = 75   # this worker's host lost the network: it leaves the job
HANDOFF_ENV = "REGATTA_HANDOFF"        # set by the agent for a worker that replaces another
AGENT_CHILD_ENV = "REGATTA_AGENT_CHILD"   # set by the agent in every worker it forks
AGENT_CHANNEL_ENV = "REGATTA_AGENT_CHANNEL"   # the fd a forked worker hands its lifelines over
MARK = ("regatta", "restart")          # scope and key of the restart mark
ASSIGNMENT = "rank_and_size"            # Horovod's scope for a slot's place in the world


def rendezvous_server(env: dict | None = None) -> tuple[str, int] | None:
    """horovodrun's rendezvous server, from a worker's environment (this one's default)."""
    env = os.environ if env is None else env
    address, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    return (address, int(port)) if address and port else None


def _request(server: tuple[str, int], method: str, path: str, body: bytes | None = None,
             timeout: float = 2.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*server, timeout=timeout)
    try:
        conn.request(method, path, body=body,
                     headers={"Content-Length": str(len(body or b""))})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def driver_reachable(timeout: float = 0.3) -> bool:
    """Whether horovodrun's rendezvous server answers (always, outside elastic mode)."""
    server = rendezvous_server()
    if server is None:
        return True
    try:
        socket.create_connection(server, timeout=timeout).close()
        return True
    except OSError:
        return False


def put_mark(server: tuple[str, int] | None, who: str) -> None:
    """Mark the rendezvous under way as doomed; never raises. Returns once the store holds
    the mark: a mark that landed after the driver assigned the next world would doom that
    one too (the agent tells horovodrun of the death only after this)."""
    if server is None:
        return
    try:
        _request(server, "PUT", f"/{MARK[0]}/{MARK[1]}", who.encode(), timeout=3.0)
    except OSError:
        pass


def marked(server: tuple[str, int] | None) -> bool:
    if server is None:
        return False
    try:
        return _request(server, "GET", f"/{MARK[0]}/{MARK[1]}", timeout=0.5)[0] == 200
    except OSError:
        return False


@functools.cache
def _libc_getenv():
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    return getenv


def _c_getenv(name: str) -> str | None:
    """The environment as C code sees it (Horovod sets its ranks there, not in os.environ)."""
    value = _libc_getenv()(name.encode())
    return value.decode() if value is not None else None


UNASSIGNED = "-1"


def await_assignment() -> None:
    """Before a re-initialisation: Horovod overwrites HOROVOD_SIZE once the driver has
    placed this slot in the new world, so a placeholder tells the two phases apart."""
    os.environ["HOROVOD_SIZE"] = UNASSIGNED


def assigned_size() -> int:
    """The size of the world this slot was placed in (after :func:`assigned`)."""
    return int(_c_getenv("HOROVOD_SIZE") or 0)


def assigned() -> bool:
    """Whether the driver has placed this slot (after :func:`await_assignment`): from then
    on a death concerns the rendezvous this rank is in."""
    return _c_getenv("HOROVOD_SIZE") != UNASSIGNED


def settle_environment() -> None:
    """Give os.environ the ranks Horovod set in C (children and later reads see them)."""
    for name in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                 "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"):
        value = _c_getenv(name)
        if value is not None:
            os.environ[name] = value


def current_slot() -> int:
    """This slot's local rank as Horovod last set it (in C, after each re-initialisation)."""
    return int(_c_getenv("HOROVOD_LOCAL_RANK") or 0)


def handoff_path(host: str, pid: int) -> Path:
    """Where worker ``pid`` of ``host`` leaves its last commit for the one that replaces it
    (its agent knows both; memory-backed where the machine has it). The host, because
    simulated hosts share /dev/shm while their pids come from separate namespaces."""
    folder = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return folder / f"regatta-handoff-{os.getuid()}-{host}-{pid}.pt"


def own_handoff_path() -> Path:
    return handoff_path(os.environ.get("HOROVOD_HOSTNAME", ""), os.getpid())


def take_assignment(host: str) -> bool:
    """In a worker that replaces another: ask the driver for this slot's place in the
    world now forming, as Horovod's re-initialisation does, and put it where ``hvd.init``
    reads it. False when the slot has no place any more (it should then just end)."""
    server = rendezvous_server()
    slot = handed_slot(Path(os.environ[HANDOFF_ENV]))
    slot = int(os.environ.get("HOROVOD_LOCAL_RANK", 0)) if slot is None else slot
    status, body = _request(server, "GET", f"/{ASSIGNMENT}/{host}:{slot}", timeout=600)
    if status != 200:
        raise RuntimeError(f"the driver did not give {host}[{slot}] a place: HTTP {status}")
    rank, size, local_rank, local_size, cross_rank, cross_size = \
        (int(v) for v in body.decode().split(",")[:6])
    if rank < 0:
        return False
    os.environ.update({"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
                       "HOROVOD_LOCAL_RANK": str(local_rank),
                       "HOROVOD_LOCAL_SIZE": str(local_size),
                       "HOROVOD_CROSS_RANK": str(cross_rank),
                       "HOROVOD_CROSS_SIZE": str(cross_size)})
    return True


def describe_handoff(path: Path, slot: int, placed: bool = False, step: int | None = None) -> None:
    """Beside the hand-off: the slot it belongs to now (local ranks move on resets),
    whether the driver has placed it in the world forming, and the step it carries (None:
    a fresh worker's). Written whole or not at all: the agent reads its presence and
    ``placed``, the replacement its slot and step."""
    replace_text(f"{path}.json", json.dumps({"slot": slot, "placed": placed, "step": step}))


def live_handoff_path(path: Path) -> Path:
    """Beside hand-off ``path``: the live state of a worker that left between steps."""
    return Path(path).with_name(Path(path).stem + "-live.pt")


def handoff_files(path: Path) -> list[Path]:
    """The commit, the live state and the description (what a replacement or a clean-up
    removes)."""
    return [Path(path), live_handoff_path(path), Path(f"{path}.json")]


def handoff_out(path: Path) -> bool:
    """Whether the worker whose hand-off is ``path`` was re-forming the world when it ended."""
    return Path(f"{path}.json").exists()


def handoff_placed(path: Path) -> bool:
    """Whether the worker whose hand-off is ``path`` had its place in the world forming.
    One that ended re-forming without a place was left out by the driver: Horovod aborts
    a worker whose host was removed ("has been removed from elastic job") as soon as the
    driver answers it, before any connection is made."""
    try:
        return bool(json.loads(Path(f"{path}.json").read_text()).get("placed"))
    except (FileNotFoundError, ValueError, AttributeError):
        return False


def _described(path: Path, key: str):
    try:
        return json.loads(Path(f"{path}.json").read_text())[key]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def handed_slot(path: Path) -> int | None:
    return _described(path, "slot")


def handed_step(path: Path) -> int | None:
    """The step the worker whose hand-off is ``path`` carried into the re-forming."""
    return _described(path, "step")


def hand_lifelines_to_agent(sockets: list) -> None:
    """Give this worker's agent duplicates of its new lifelines, which it shuts down the
    moment this process is SIGKILLed, before the kernel has torn its memory down
    (elastic/launch/dying.py). Nothing without an agent."""
    channel = os.environ.get(AGENT_CHANNEL_ENV)
    if channel:
        send_lifelines(int(channel), sockets)
