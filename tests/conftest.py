"""Fixtures: tiny models and real SGLang servers on loopback, started and stopped by PID."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List

import pytest
import requests

from sglang_capture.testbed.cpu import CPU_SERVER_ARGS, cpu_server_env
from sglang_capture.testbed.tiny_models import build_all

CACHE = os.environ.get("SGLANG_CAPTURE_TEST_CACHE", os.path.expanduser("~/.cache/sglang-capture-tests"))
START_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def tiny_models() -> Dict[str, str]:
    return build_all(os.path.join(CACHE, "models"))


@pytest.fixture(scope="session")
def server_env() -> Dict[str, str]:
    return cpu_server_env(CACHE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str
    capture_dir: str

    def generate(self, payload: dict, timeout: float = 120) -> requests.Response:
        return requests.post(self.url + "/generate", json=payload, timeout=timeout)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def start_server(cmd: List[str], env: Dict[str, str], log_path: str, capture_dir: str = "") -> Server:
    """Start a server in its own process group and wait until /health answers."""
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path, capture_dir)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
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
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait(timeout=10)


def capture_cmd(model: str, capture_dir: str, *extra: str) -> List[str]:
    return [sys.executable, "-m", "sglang_capture.launch", "--capture-dir", capture_dir, *extra,
            "--model-path", model, *CPU_SERVER_ARGS]


def plain_cmd(model: str, *extra: str) -> List[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, *CPU_SERVER_ARGS,
            "--enable-return-hidden-states", *extra]


@pytest.fixture(scope="module")
def make_server(tmp_path_factory, server_env) -> Iterator:
    started: List[Server] = []

    def make(cmd: List[str], capture_dir: str = "") -> Server:
        log = str(tmp_path_factory.mktemp("logs") / "server.log")
        server = start_server(cmd, server_env, log, capture_dir)
        started.append(server)
        return server

    yield make
    for server in started:
        stop_server(server)
