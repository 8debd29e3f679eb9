"""A worker's registration with horovodrun's elastic driver, started before ``hvd.init``.

Horovod registers a worker (its notification service's address, which the driver then
probes with a ping) only when ``hvd.elastic.run`` starts, after ``hvd.init``. A fresh worker
(an added host, a slot refilled, a worker restarted in place) is the last to reach the
state sync, and everyone waits there for it: in chaos runs its registration took 0.03 s
at the median and up to 1.9 s on two busy cores (the driver's HTTP handler probes the
worker while its other threads poll discovery). Started on a thread as the worker
initialises, it overlaps ``hvd.init``'s rendezvous; ``hvd.elastic.run``'s own call then
finds it done (or waits for it under the manager's lock).
"""
from __future__ import annotations

import threading
import time


class EarlyRegistration:
    def __init__(self) -> None:
        self.started, self.took = time.time(), None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._register, name="regatta-registration",
                                        daemon=True)
        self._thread.start()

    def _register(self) -> None:
        from horovod.common.elastic import notification_manager
        try:
            notification_manager.init()
        except BaseException as err:   # raised where Horovod's own call would have raised it
            self._error = err
        self.took = time.time() - self.started

    def wait(self) -> float:
        """Seconds the registration took; its error, if it failed (the worker cannot train
        elastically without the driver's notices)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.took
