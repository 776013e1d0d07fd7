"""One background thread per rank that runs the expert caches' fills in submission order (`PrefetchWorker`)."""
from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger("moeray.experts")


def _run_fills(q: queue.Queue, stream) -> None:
    """`PrefetchWorker`'s thread: run queued fills in order until a None arrives."""
    while True:
        fn = q.get()
        try:
            if fn is None:
                return
            if stream is not None:
                with torch.cuda.stream(stream):
                    fn()
            else:
                fn()
        except Exception:
            log.exception("expert prefetch failed")
        finally:
            q.task_done()


class PrefetchWorker:
    """One background thread that runs cache fills in submission order (or inline when `sync`).

    On CUDA each fill runs on the worker's own stream and is complete (stream synchronised) before the
    entry is published, so the forward's stream can use it without an event wait. The thread holds only the
    queue and the stream, and ends when the worker is closed or garbage-collected (an engine dropped without
    `close()` does not leave its thread behind).
    """

    def __init__(self, sync: bool = False, device: torch.device | None = None):
        self.sync = sync
        self.device = device
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stream = None
        if not sync:
            if device is not None and device.type == "cuda":
                self._stream = torch.cuda.Stream(device)
            self._thread = threading.Thread(target=_run_fills, args=(self._q, self._stream), name="expert-prefetch",
                                            daemon=True)
            self._thread.start()
            weakref.finalize(self, self._q.put, None)

    def submit(self, fn: Callable[[], None]) -> None:
        if self.sync:
            fn()
        else:
            self._q.put(fn)

    def wait_idle(self) -> None:
        """Block until every submitted fill has run (tests, benchmarks)."""
        if not self.sync:
            self._q.join()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=5)
