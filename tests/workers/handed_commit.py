"""What the stuck-survivor test workers share: the state they hand over, and the
replacement's side, which prints the commit it was handed and exits 0.

    import handed_commit   (first, from a test worker in this folder)
"""
import os
import sys
from pathlib import Path

from elastic import restart


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
        print("replacement given", handed, flush=True)
        sys.exit(0)
