"""A writer process (``python -m sglang_capture.writer.process``, started by server/writer_child.py for the writer pool).

It turns jobs into published capture files: reads the request's rows out of the shared host pool
(mapped read-only), places them by position, then compresses, hashes, writes, flushes and
publishes the file. It has an interpreter of its own so that none of that competes with SGLang's
scheduler thread for the GIL and slows requests that capture nothing. It never imports torch.

Talks to its hand-off thread over stdin/stdout (core/handoff.py). EOF on stdin means the server is
gone or stopping: it finishes the job in hand and exits.
"""
from __future__ import annotations

import logging
import mmap
import os
import sys
import time
from typing import Any, Dict, Optional

from sglang_capture.core.capture_dir import DirFds, error_text, sweep_records
from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.handoff import Heartbeat, chunk_arrays, ids_array, recv, send
from sglang_capture.core.loss_mask import mask_from_spans
from sglang_capture.writer.assemble import assemble_rows, relabel
from sglang_capture.writer.capture_file import write_capture_file
from sglang_capture.writer.durability import durability_for

logger = logging.getLogger("sglang_capture.writer.process")


class WriterProcess:
    """One writer process's state: the capture dir's descriptors, codec, flush policy, pool map."""

    def __init__(self, config: CaptureConfig, pool_fd: Optional[int], pool_size: int) -> None:
        self.config = config
        self.codec = config.codec_spec()
        self.durability = durability_for(config.durability)
        self.pool = None
        if pool_fd is not None:
            self.pool = mmap.mmap(pool_fd, pool_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            os.close(pool_fd)
        self.dirs: Optional[DirFds] = None
        self.dirs_error: Optional[OSError] = None
        try:
            self.dirs = DirFds.open(config.capture_dir)
        except OSError as e:  # every job then fails with this reason; the server keeps serving
            self.dirs_error = e

    def _heartbeat(self, out_fd: int) -> Heartbeat:
        """``progress`` messages often enough that the stall timeout never takes a moving writer."""
        return Heartbeat(out_fd, min(1.0, self.config.writer_stall_s / 4))

    def sweep(self, max_age_s: float, out_fd: int) -> Dict[str, Any]:
        """Remove outcome records older than ``max_age_s`` (core/capture_dir.sweep_records),
        with ``progress`` messages meanwhile."""
        beat = self._heartbeat(out_fd)
        try:
            return {"op": "swept", "removed": sweep_records(self.dirs, max_age_s, beat) if self.dirs else 0}
        except OSError as e:
            return {"op": "swept", "removed": 0, "error": error_text(e)}

    def write(self, msg: Dict[str, Any], out_fd: int) -> Dict[str, Any]:
        """Publish one job; sends ``copied`` as soon as its rows are out of the pool, ``temp`` (its
        temp file's name) once that exists, ``progress`` while the file is written, and
        ``publishing`` (the whole, flushed file's identity, size and checksum) just before its name
        appears (core/handoff.py)."""
        t0 = time.monotonic()
        beat = self._heartbeat(out_fd)
        copied = False
        timings: Dict[str, float] = {}
        try:
            try:
                tensors = assemble_rows(chunk_arrays(msg["chunks"], self.pool), msg["n_rows"],
                                        {k: tuple(v) for k, v in msg["stored"].items()})
            finally:
                send(out_fd, {"op": "copied"})
                copied = True
            timings["assemble_s"] = time.monotonic() - t0
            tensors = relabel(tensors, msg.get("dtypes") or {})
            input_ids = ids_array(msg["input_ids"])
            tensors = {"input_ids": input_ids, "output_ids": ids_array(msg["output_ids"]), **tensors}
            if msg["loss_spans"] is not None:
                tensors["loss_mask"] = mask_from_spans([tuple(s) for s in msg["loss_spans"]], len(input_ids))
            if self.dirs is None:
                raise self.dirs_error or OSError("the capture dir is unusable")
            beat.restart()  # "copied" went just now

            def publishing(st: os.stat_result, nbytes: int, checksum: str) -> None:
                send(out_fd, {"op": "publishing", "dev": st.st_dev, "ino": st.st_ino, "bytes": nbytes,
                              "checksum": checksum})
                beat.restart()

            nbytes, checksum, stage = write_capture_file(self.dirs, msg["name"], msg["meta"], tensors, self.codec,
                                                         self.durability, self.config.keep_page_cache, beat,
                                                         self.config.checksum, publishing,
                                                         lambda temp: send(out_fd, {"op": "temp", "name": temp}))
            timings.update(stage)
            result = {"status": "ok", "bytes": nbytes, "checksum": checksum,
                      "raw_bytes": sum(int(t.nbytes) for t in tensors.values())}
        except Exception as e:
            if not copied:
                raise
            result = {"status": "error", "error": error_text(e)}
        return {"op": "done", "result": result, "timings": timings}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[sglang_capture writer %(process)d] %(message)s", stream=sys.stderr)
    in_fd = sys.stdin.fileno()
    out_fd = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the protocol
    hello = recv(in_fd)
    if hello is None or hello.get("op") != "hello":
        return 2
    config = CaptureConfig.from_json(hello["config"])
    os.nice(config.writer_nice)  # relative to the scheduler process that started it
    if config.writer_cpus:
        try:
            os.sched_setaffinity(0, config.writer_cpus)
        except OSError as e:  # CPUs taken away since the launcher checked them: run where the server runs
            logger.warning("cannot run on --capture-writer-cpus %s (%s); running on the server's CPUs", config.writer_cpus, e)
    writer = WriterProcess(config, hello["pool_fd"], hello["pool_size"])
    while True:
        msg = recv(in_fd)
        op = None if msg is None else msg.get("op")
        try:
            if op == "write":
                send(out_fd, writer.write(msg, out_fd))
            elif op == "sweep":
                send(out_fd, writer.sweep(msg["max_age_s"], out_fd))
            else:
                return 0
        except BrokenPipeError:
            return 0


if __name__ == "__main__":
    sys.exit(main())
