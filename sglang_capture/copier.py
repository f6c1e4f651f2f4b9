"""Copying captured rows out of SGLang's batch buffers, as soon as they arrive.

SGLang copies each batch's hidden states into a fresh pinned host buffer (``_async_d2h``, on the
scheduler thread). Captured rows used to stay views of that buffer until a writer thread reached
the request, seconds later under load, so torch's pinned allocator kept pinning new memory for
the next batches: on the H200 the scheduler thread spent 7 s of a 14 s window in ``cudaHostAlloc``
(bench/RESULTS.md, third round), and requests that do not capture slowed down with it. One
thread here copies every multi-row chunk into pageable memory of its own within milliseconds and
drops the view, so SGLang's buffer goes back to its cache the way it does without capture.
Single decode rows stay views: copying them one by one would cost more than it frees.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Optional, Tuple, Union

if TYPE_CHECKING:
    from sglang_capture.assembler import RequestCapture, RowChunk

logger = logging.getLogger(__name__)

COPY_MIN_ROWS = 16  # prefill/extend chunks; decode steps hand over one row per request


class RowCopier:
    """A thread that replaces views of shared batch buffers by private copies (``own_rows``)."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Union[Tuple[RequestCapture, RowChunk], threading.Event]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.copied = 0

    def submit(self, capture: "RequestCapture", chunk: "RowChunk") -> None:
        """Hot path (scheduler thread): queue the chunk; never blocks."""
        self._start()
        self._queue.put((capture, chunk))

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every chunk queued so far has been handled (tests, shutdown)."""
        done = threading.Event()
        self._start()
        self._queue.put(done)
        return done.wait(timeout)

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="sglang-capture-copier", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            capture, chunk = item
            try:
                if capture.own_rows(chunk):
                    self.copied += 1
            except Exception:  # the view stays: the rows are still right, only held longer
                logger.exception("sglang_capture: could not copy rows of %s", capture.rid)
