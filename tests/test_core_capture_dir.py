"""The capture dir: private folders, permissions, orphan clean-up (core/capture_dir.py)."""
from __future__ import annotations

import pytest
import torch

from sglang_capture.core.config import CaptureConfig, ConfigError
from sglang_capture.server.ledger import HostMemoryLedger
from tests.jobs import make_job


def test_a_symlink_planted_at_the_file_name_is_never_written_through(tmp_path):
    import json
    import os

    from sglang_capture.core.capture_dir import index_path
    from sglang_capture.server.writer_pool import WriterPool

    capture_dir, outside = tmp_path / "caps", tmp_path / "outside.txt"
    capture_dir.mkdir()
    outside.write_text("precious")
    os.symlink(outside, capture_dir / "req-1.capture.msgpack")
    job, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2)
    writer = WriterPool(CaptureConfig(capture_dir=str(capture_dir), writers=1), ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(capture_dir), "req-1")))
    assert outcome["status"] == "error" and "already exists" in outcome["error"]
    assert outside.read_text() == "precious" and os.path.islink(capture_dir / "req-1.capture.msgpack")


def test_a_symlinked_private_folder_is_refused_at_start(tmp_path):
    import os

    from sglang_capture.server.launch import check_capture_dir

    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / ".tmp")
    with pytest.raises(ConfigError, match="must be a real directory"):
        check_capture_dir(str(tmp_path))


def test_files_are_created_owner_and_group_only(tmp_path):
    import json
    import os
    import stat

    from sglang_capture.core.capture_dir import index_path
    from sglang_capture.server.writer_pool import WriterPool

    job, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2)
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(tmp_path), "req-1")))
    assert stat.S_IMODE(os.stat(outcome["path"]).st_mode) & 0o007 == 0
    assert stat.S_IMODE(os.stat(tmp_path / ".tmp").st_mode) == 0o700


def test_temp_files_of_a_killed_server_are_removed_at_start_and_live_ones_kept(tmp_path):
    import os
    import subprocess
    import sys

    from sglang_capture.core.capture_dir import prepare_capture_dir
    from sglang_capture.core.durable import host_tag
    from sglang_capture.server.writer_pool import WriterPool

    prepare_capture_dir(str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # a process that has exited
    here = host_tag()
    orphans = [tmp_path / ".tmp" / f"req.7.{here}.{dead_pid}.{'a' * 32}.part",
               tmp_path / ".index" / f"x.json.{here}.{dead_pid}.{'b' * 32}.part"]
    live = [tmp_path / ".tmp" / f"other.{here}.{os.getpid()}.{'c' * 32}.part", tmp_path / ".tmp" / "notes.part",
            # another host sharing the directory: its pids mean nothing here, its files stay
            tmp_path / ".tmp" / f"req.8.h0badc0de.{dead_pid}.{'d' * 32}.part"]
    for path in orphans + live:
        path.write_bytes(b"half a file")
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), HostMemoryLedger(1 << 20))
    try:
        writer.start()
        assert not any(p.exists() for p in orphans) and all(p.exists() for p in live)
    finally:
        writer.close()
