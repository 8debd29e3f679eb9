"""What the stuck-survivor test workers share: the state they hand over, the
replacement's side, which prints the commit it was handed and exits 0, and an address
exchange through a folder for a lifeline peer in another process (the test's).

    import handed_commit   (first, from a test worker in this folder)
"""
import json
import os
import sys
import time
from pathlib import Path

from elastic.failures import restart
from elastic.whole_files import replace_text


class Committed:
    """The training state's part of the contract the hand-off uses."""
    step = 7

    def write_handoff(self, path: Path) -> None:
        Path(path).write_bytes(b"commit of step 7")


def exit_if_replacement() -> None:
    """In the worker the agent started in a stuck one's place: say what it was given."""
    inherited = os.environ.get(restart.HANDOFF_ENV)
    if inherited:
        handed = [p.read_bytes() for p in restart.handoff_files(Path(inherited))
                  if p.suffix != ".json" and p.exists()]
        print("replacement given", handed, "of step", restart.handed_step(Path(inherited)), flush=True)
        sys.exit(0)


def allgather_through(folder: Path, rank: int, size: int, timeout: float = 60.0):
    """An ``allgather(obj, name)`` for lifelines whose ranks share no Horovod world: each
    leaves its entry in ``folder`` and reads everyone's once all are there."""
    def allgather(obj, name):
        replace_text(Path(folder) / f"{rank}.json", json.dumps(obj))
        deadline = time.monotonic() + timeout
        paths = [Path(folder) / f"{r}.json" for r in range(size)]
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: not every rank left its entry in {folder}")
            time.sleep(0.01)
        return [json.loads(p.read_text()) for p in paths]
    return allgather
