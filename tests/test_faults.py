"""Faults on a real CPU capture server: a kill -9 in the middle of heavy capture, full disks,
writer processes killed."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

import sglang_capture
from sglang_capture.core.capture_dir import writer_stats
from sglang_capture.testbed.server import capture_cmd


def test_kill_9_during_capture_leaves_only_complete_files(tiny_models, make_server, tmp_path):
    capture_dir = str(tmp_path / "caps")
    os.makedirs(capture_dir)
    server = make_server(capture_cmd(tiny_models["tiny-dsv3"], capture_dir), capture_dir)
    text = "Kimi K2.5 uses the DeepSeek V3 architecture with MLA and MoE layers. " * 6

    def send(i):
        body = {"text": text + str(i), "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True,
                                                           "custom_params": {"capture": True, "capture_name": f"k{i}"}}}
        try:
            requests.post(server.url + "/generate", json=body, timeout=120)
        except requests.RequestException:
            pass  # the server dies under us

    pool = ThreadPoolExecutor(24)
    for i in range(48):
        pool.submit(send, i)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(f.endswith(".capture.msgpack") for f in os.listdir(capture_dir)):
        time.sleep(0.05)
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    pool.shutdown(wait=True)
    files = [f for f in os.listdir(capture_dir) if f.endswith(".capture.msgpack")]
    assert 1 <= len(files) < 48, "the kill must land in the middle of the run"
    r = subprocess.run([sys.executable, "-m", "sglang_capture", "verify", capture_dir, "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(files)} decoded and consistent, 0 problems" in r.stdout


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs as the capture dir (needs root, as on this project's CI machines)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_fails_captures_clearly_keeps_serving_and_recovers(tiny_models, make_server, small_disk):
    server = make_server(capture_cmd(tiny_models["tiny-dsv3"], str(small_disk)), str(small_disk))
    text = "Hidden states are captured from every decoder layer of the model. " * 20  # ~0.5 MB of rows

    def capture(name, prompt=text):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0,
                                                    "custom_params": {"capture": True, "capture_name": name}}}
        r = server.generate(body)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["capture"]

    before = capture("before")
    assert before["status"] == "ok"
    filler = small_disk / "filler"
    with open(filler, "wb") as f:  # leave about 64 KiB free
        f.write(b"\0" * (os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize - (64 << 10)))
    other = "Rows that never reached the disk. " * 30  # shares no prefix with the first: all its rows are new
    ref = capture("while-full", other)
    assert ref["status"] == "error" and "No space left on device" in ref["error"]
    assert not (small_disk / "while-full.capture.msgpack").exists()
    assert os.listdir(small_disk / ".tmp") == []
    plain = server.generate({"text": text, "sampling_params": {"max_new_tokens": 2}})
    assert plain.status_code == 200 and "capture" not in plain.json()["meta_info"]
    os.unlink(filler)
    # the failed capture's rows are in the radix cache but were never stored: a capture of the same
    # prefix computes them again, while one continuing the first capture reuses its stored rows
    again = capture("after", other + " More.")
    assert again["status"] == "ok" and again["rows_shared"] == 0 and again["rows_stored"] == again["rows"]
    longer = capture("longer", text + " More.")
    assert longer["status"] == "ok" and longer["rows_shared"] > 0
    for ref in (before, again, longer):
        assert sglang_capture.load(ref["path"])["aux_hidden_states"].shape[0] == ref["rows"]


def test_a_disk_too_full_for_the_outcome_record_ends_the_wait_with_an_error(tiny_models, make_server, small_disk):
    server = make_server(capture_cmd(tiny_models["tiny-dsv3"], str(small_disk), "--capture-wait-timeout", "300"),
                         str(small_disk))
    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # fill every byte: not even the small outcome record fits
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    body = {"text": "The quick brown fox", "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"capture": True, "capture_name": "no-room"}}}
    r = server.generate(body)
    assert r.status_code == 200, r.text
    ref = r.json()["meta_info"]["capture"]
    # without the empty marker the response would wait the whole --capture-wait-timeout and say "pending"
    assert ref["status"] == "error" and "could not record this capture's outcome" in ref["error"]
    assert not (small_disk / "no-room.capture.msgpack").exists()
    os.unlink(small_disk / "filler")
    assert server.generate({"text": "hello", "sampling_params": {"max_new_tokens": 2, "custom_params": {
        "capture": True, "capture_name": "room-again"}}}).json()["meta_info"]["capture"]["status"] == "ok"


def test_killed_writer_processes_are_replaced_and_capture_goes_on(tiny_models, make_server, tmp_path):
    capture_dir = str(tmp_path / "caps")
    os.makedirs(capture_dir)
    server = make_server(capture_cmd(tiny_models["tiny-dsv3"], capture_dir), capture_dir)

    def capture(name):
        body = {"text": "Writer processes compress and publish the files. " * 4, "sampling_params": {
            "max_new_tokens": 3, "temperature": 0, "custom_params": {"capture": True, "capture_name": name}}}
        r = server.generate(body)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["capture"]

    def one_writer_stats():
        [stats] = writer_stats(capture_dir).values()
        return stats

    assert capture("before")["status"] == "ok"
    killed = one_writer_stats()["writer_pids"]
    assert killed and server.proc.pid not in killed
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    after = capture("after")
    assert after["status"] == "ok", after
    assert sglang_capture.load(after["path"])["aux_hidden_states"].shape[0] == after["rows"]
    deadline = time.monotonic() + 10
    while not (stats := one_writer_stats())["restarts"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert stats["writer_pids"] and not set(stats["writer_pids"]) & set(killed) and stats["failed"] == 0
