"""Fixtures: tiny models and real SGLang servers on loopback, started and stopped by PID."""
from __future__ import annotations

import os
from typing import Dict, Iterator, List

import pytest

from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.server import Server, start_server, stop_server
from sglang_capture.testbed.tiny_models import build_all

CACHE = os.environ.get("SGLANG_CAPTURE_TEST_CACHE", os.path.expanduser("~/.cache/sglang-capture-tests"))


@pytest.fixture(scope="session")
def tiny_models() -> Dict[str, str]:
    return build_all(os.path.join(CACHE, "models"))


@pytest.fixture(scope="session")
def env() -> Dict[str, str]:
    return server_env(CACHE)


@pytest.fixture(scope="module")
def make_server(tmp_path_factory, env) -> Iterator:
    started: List[Server] = []

    def make(cmd: List[str], capture_dir: str = "") -> Server:
        log = str(tmp_path_factory.mktemp("logs") / "server.log")
        server = start_server(cmd, env, log, capture_dir)
        started.append(server)
        return server

    yield make
    for server in started:
        stop_server(server)
