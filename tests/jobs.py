"""A writer job with known rows, for tests of the writer pool and the capture dir."""
from __future__ import annotations

from sglang_capture.server.ledger import HostMemoryLedger


def make_job(tmp_path, chunks, n_rows, name="req-1"):
    from sglang_capture.server.request_capture import RequestCapture
    from sglang_capture.server.writer_pool import CaptureJob

    ledger = HostMemoryLedger(1 << 30)
    cap = RequestCapture(rid=name, name=name, ledger=ledger)
    for start, rows in chunks:
        cap.add(start, rows)
    meta = {"rid": name, "layers": [1], "layer_convention": "c", "hidden_size": 2, "model": "m",
            "sglang_version": "0.5.17", "schema": "sglang_capture/v1"}
    return CaptureJob(cap, n_rows, {"aux_hidden_states": (0, 2), "last_hidden_states": (2, 4)}, [1, 2], [3], meta), ledger
