"""One writer process, seen from the supervisor: starting it, the pipes to it, stopping it, and its errors.

The supervisor (supervisor.py) keeps one ``WriterChild`` per hand-off thread and replaces it
when it dies or stalls; what the process itself runs is process.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.handoff import Stalled, recv_reply, send


class WriterProcessDied(RuntimeError):
    """The writer process exited before answering (killed, out of memory)."""


class NotTaken(WriterProcessDied):
    """The writer process was gone before it could take the job: another one may write it."""


class WriterStalled(WriterProcessDied):
    """The writer process sent nothing for ``--capture-writer-stall-timeout`` (a hung mount)."""


class WriterChild:
    """One writer process and the pipes to it."""

    def __init__(self, config: CaptureConfig, pool_fd: Optional[int], pool_size: int) -> None:
        self.stall_s = config.writer_stall_s
        self.temp: Optional[str] = None  # the temp file (under .tmp/) of the job in hand, once created
        # a file published by the job in hand, to remove once the process is gone: it died or stalled
        # while stuck in the kernel, and its outcome, recorded meanwhile, says error
        self.unlink_on_exit: Optional[Tuple[str, int, int]] = None
        self.exit_lock = threading.Lock()
        pass_fds = (pool_fd,) if pool_fd is not None else ()  # the host pool's memfd, mapped read-only there
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang_capture.writer.process"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, pass_fds=pass_fds)
        try:
            self.send({"op": "hello", "config": config.to_env(), "pool_fd": pool_fd, "pool_size": pool_size,
                       "parent": os.getpid()})
        except WriterProcessDied:
            self.stop(1.0)
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, message: Dict[str, Any]) -> None:
        try:
            send(self.proc.stdin.fileno(), message)
        except OSError:
            raise NotTaken(str(self._died())) from None

    def recv(self) -> Dict[str, Any]:
        try:
            reply = recv_reply(self.proc.stdout.fileno(), self.stall_s)
        except Stalled:
            raise WriterStalled(f"writer process {self.pid} made no progress for {self.stall_s:g} s (a hung disk "
                                "or network mount?); it was killed and replaced") from None
        if reply is None:
            raise self._died()
        return reply

    def _died(self) -> WriterProcessDied:
        try:
            code = self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            code = None
        return WriterProcessDied(f"writer process {self.pid} exited (code {code}) before finishing the file")

    def stop(self, timeout: float, exited: Callable[[WriterChild], None] = lambda child: None) -> None:
        """EOF tells the process to finish and exit; kill it if it does not in time. Closes the
        pipes either way (a server replacing writers for days must not leak descriptors), and
        calls ``exited(self)`` once the process is gone (from a reaper thread if it is stuck in the
        kernel)."""
        try:
            self.proc.stdin.close()
        except OSError:  # a dead reader: the close flushes nothing
            pass
        try:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
            exited(self)
        except subprocess.TimeoutExpired:  # stuck in the kernel (a hung mount): reaped when it returns
            def reap() -> None:
                self.proc.wait()
                exited(self)

            threading.Thread(target=reap, name=f"sglang-capture-reap-{self.pid}", daemon=True).start()
        finally:
            self.proc.stdout.close()
