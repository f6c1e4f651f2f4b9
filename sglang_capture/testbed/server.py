"""Start and stop a real SGLang server on loopback by PID (tests and the demo)."""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

import requests

from sglang_capture.testbed.cpu import CPU_SERVER_ARGS, has_nvidia_driver

START_TIMEOUT_S = 300


# SGLang binds ports derived from the ones it is given: under DP attention on one node, the HTTP port
# + 233 and the six after it; from a --dist-init-addr port, that port and the six after it.
DERIVED_PORT_OFFSETS = (*range(0, 8), *range(233, 241))
LOWEST_PORT = 10000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(candidates: Optional[Iterable[int]] = None) -> int:
    """A port whose whole derived window (``DERIVED_PORT_OFFSETS``) is free, below the ephemeral range.

    A port the kernel hands out (bind to 0) lies in the ephemeral range, and so do the ports SGLang
    derives from it; any outgoing connection on the machine can hold one of those for its local end,
    and then a DP-attention server waits 30 s for it and exits. Below that range only listeners take
    ports."""
    if candidates is None:
        rng = random.SystemRandom()
        top = _ephemeral_low() - 1 - max(DERIVED_PORT_OFFSETS)
        low = LOWEST_PORT if top > LOWEST_PORT + 1000 else 1024  # a host whose ephemeral range starts low
        candidates = (rng.randrange(low, max(top, low + 1000)) for _ in range(1000))
    for port in candidates:
        if all(_bindable(port + offset) for offset in DERIVED_PORT_OFFSETS):
            return port
    raise RuntimeError(f"no free port with its derived ports free below {_ephemeral_low()}")


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str
    capture_dir: str = ""

    def generate(self, payload: dict, timeout: float = 120) -> requests.Response:
        return requests.post(self.url + "/generate", json=payload, timeout=timeout)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def device_args() -> List[str]:
    """CPU flags on a machine without an NVIDIA driver, else none (SGLang picks the GPU)."""
    return [] if has_nvidia_driver() else list(CPU_SERVER_ARGS)


def capture_cmd(model: str, capture_dir: str, *extra: str) -> List[str]:
    return [sys.executable, "-m", "sglang_capture.launch", "--capture-dir", capture_dir, *extra,
            "--model-path", model, *device_args()]


def plain_cmd(model: str, *extra: str) -> List[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, *device_args(),
            "--enable-return-hidden-states", *extra]


class PortTaken(RuntimeError):
    """The server's HTTP port, or one SGLang derives from it, was taken after ``free_port`` chose it."""


PORT_ATTEMPTS = 3
# What SGLang's wait_port_available raises when a port it derives is held.
_DERIVED_TAKEN = re.compile(r"_port at \d+ is not available in \d+ seconds")


def start_server(cmd: List[str], env: Dict[str, str], log_path: str, capture_dir: str = "") -> Server:
    """Start a server in its own process group and wait until /health answers.

    ``free_port`` only finds a port that was free a moment ago: another server starting beside
    this one (SGLang opens several ports of its own) can take it first, and then this server
    exits once its HTTP port fails to bind. That server is started again on a new port."""
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _start_once(cmd, env, log_path, capture_dir)
        except PortTaken:
            pass
    return _start_once(cmd, env, log_path, capture_dir)


def _start_once(cmd: List[str], env: Dict[str, str], log_path: str, capture_dir: str) -> Server:
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path, capture_dir)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop_server(server)  # what is left of its process group
            log = server.log()
            if f"address ('127.0.0.1', {port}): address already in use" in log or _DERIVED_TAKEN.search(log):
                raise PortTaken(f"port {port} or one SGLang derives from it was taken before the server bound it:\n"
                                f"{log[-2000:]}")
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log[-4000:]}")
        try:
            if requests.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"server did not become healthy in {START_TIMEOUT_S} s:\n{server.log()[-4000:]}")


def stop_server(server: Server) -> None:
    """SIGTERM the launcher's process group, then SIGKILL whatever is left."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
