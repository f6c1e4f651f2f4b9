"""Fixtures: tiny models and real SGLang servers on loopback, started and stopped by PID."""
from __future__ import annotations

import os
import sys
from typing import Dict, Iterator, List, Optional

import pytest

from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.once import cache_dir
from sglang_capture.testbed.server import Server, plain_cmd, start_server, stop_server
from sglang_capture.testbed.tiny_models import build_all

CACHE = cache_dir()
# the benchmark scripts' analysis is tested as they run it: as top-level modules of bench/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))


@pytest.fixture(scope="session")
def tiny_models() -> Dict[str, str]:
    return build_all(os.path.join(CACHE, "models"))


@pytest.fixture(scope="session")
def env() -> Dict[str, str]:
    return server_env(CACHE)


def server_factory(tmp_path_factory, env) -> Iterator:
    """Yields ``make(cmd, capture_dir, extra_env)``, which starts a server; each one started is stopped
    when the generator is resumed or closed (a fixture's teardown, or ``close()``)."""
    started: List[Server] = []

    def make(cmd: List[str], capture_dir: str = "", extra_env: Optional[Dict[str, str]] = None) -> Server:
        log = str(tmp_path_factory.mktemp("logs") / "server.log")
        server = start_server(cmd, {**env, **(extra_env or {})}, log, capture_dir)
        started.append(server)
        return server

    try:
        yield make
    finally:
        for server in started:
            stop_server(server)


@pytest.fixture(scope="module")
def make_server(tmp_path_factory, env) -> Iterator:
    """Servers that live as long as the test module."""
    yield from server_factory(tmp_path_factory, env)


@pytest.fixture
def make_test_server(tmp_path_factory, env) -> Iterator:
    """Servers stopped as soon as the test ends (heavy servers that must not overlap the next test's)."""
    yield from server_factory(tmp_path_factory, env)


@pytest.fixture(scope="session")
def make_session_server(tmp_path_factory, env) -> Iterator:
    """Servers shared by several modules (stopped at the end of the session)."""
    yield from server_factory(tmp_path_factory, env)


@pytest.fixture(scope="session")
def plain_llama(tiny_models, make_session_server) -> Server:
    """A plain ``sglang.launch_server`` (no capture) on the tiny Llama."""
    return make_session_server(plain_cmd(tiny_models["tiny-llama"]))
