"""Writers on slow storage: a real slow block device (an ext4 loop device whose writes the kernel
throttles, blkio ``throttle.write_bps_device``), so that a capture file takes longer to reach the
disk than ``--capture-writer-stall-timeout``, as a 64K-token capture does on a busy Lustre or NFS
over 1 GbE (issue 34 item 2). A healthy slow writer must finish its file; a stopped one must
still be killed, and its temp file removed as it is replaced (item 3)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from sglang_capture.core.config import CaptureConfig
from tests.jobs import make_job, write_and_wait

THROTTLE = "/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device"
RATE = 8 << 20  # bytes/s the device writes
STALL_S = 3.0
FILE_BYTES = 48 << 20  # 6 s of the device's time: twice the stall timeout


def _missing() -> str:
    if os.geteuid() != 0:
        return "needs root (a loop device and the blkio throttle)"
    if not os.path.exists(THROTTLE):
        return f"no cgroup-v1 blkio throttle ({THROTTLE})"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"no {tool}"
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices"
    return ""


@pytest.fixture(scope="module")
def slow_dir(tmp_path_factory):
    """A folder on an ext4 filesystem whose device writes RATE bytes a second."""
    why = _missing()
    if why:  # CI runs on a machine that has all of it: there a missing piece is a failure, not a skip
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"slow block device unavailable: {why}")
    base = tmp_path_factory.mktemp("slow-disk")
    image, mnt = base / "disk.img", base / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(512 << 20)
    dev = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True, text=True).stdout.strip()
    rule = ""
    try:
        # no lazy initialisation: its background writes would share the throttle with the test's
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev], check=True,
                       capture_output=True)
        subprocess.run(["mount", dev, str(mnt)], check=True, capture_output=True)
        st = os.stat(dev)
        rule = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        with open(THROTTLE, "w") as f:
            f.write(f"{rule} {RATE}")
        yield mnt
    finally:
        if rule:
            with open(THROTTLE, "w") as f:
                f.write(f"{rule} 0")
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        subprocess.run(["losetup", "-d", dev], capture_output=True)


def _big_job(capture_dir, name):
    """A job whose file is FILE_BYTES of incompressible rows (16-byte rows, 4 float32 columns)."""
    rows = torch.randn(FILE_BYTES // 16, 4)
    return make_job(capture_dir, [(0, rows)], rows.shape[0], name=name)


def _writer(capture_dir, ledger):
    from sglang_capture.server.writer_pool import WriterPool

    cfg = CaptureConfig(capture_dir=str(capture_dir), writers=1, codec="none", writer_stall_s=STALL_S)
    writer = WriterPool(cfg, ledger)
    writer.start()
    deadline = time.monotonic() + 30
    while not writer.writer_pids():
        assert time.monotonic() < deadline, "no writer process started"
        time.sleep(0.01)
    return writer


def test_a_healthy_writer_on_slow_storage_finishes_its_file_and_a_stopped_one_is_killed(slow_dir):
    from sglang_capture import load
    from sglang_capture.core.names import FILE_SUFFIX

    capture_dir = slow_dir / "healthy"
    capture_dir.mkdir()
    job, ledger = _big_job(capture_dir, "slow-but-moving")
    writer = _writer(capture_dir, ledger)
    try:
        t0 = time.monotonic()
        outcome = write_and_wait(writer, job, timeout=120)
        took = time.monotonic() - t0
        assert outcome["status"] == "ok", outcome
        # the disk took longer than the stall timeout for this one file: one flush at the end
        # would have sent nothing for that long (the writer killed, the file failed)
        assert took >= 1.5 * STALL_S, f"the device was not slow ({took:.1f} s)"
        assert writer.counters()["stalled"] == 0 and writer.counters()["restarts"] == 0
        assert outcome["bytes"] >= FILE_BYTES and load(outcome["path"])["aux_hidden_states"].shape[0] == FILE_BYTES // 16

        stopped, _ = _big_job(capture_dir, "stopped")
        [pid] = writer.writer_pids()
        writer.submit(stopped)
        deadline = time.monotonic() + 60
        while not os.listdir(capture_dir / ".tmp"):  # its temp file exists: it is writing
            assert time.monotonic() < deadline, "the writer never started the file"
            time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)
        assert stopped.done.wait(60)
        assert stopped.outcome["status"] == "error" and "made no progress for 3 s" in stopped.outcome["error"]
        assert writer.counters()["stalled"] == 1
        # replaced at once, and its multi-GB-in-production temp file with it, not at the next start
        assert os.listdir(capture_dir / ".tmp") == [] and writer.counters()["temp_files_removed"] == 1
        assert not os.path.exists(capture_dir / f"stopped{FILE_SUFFIX}")
    finally:
        writer.close()
