"""Writer-side test helpers: a job with known rows, waiting for its outcome, its tensors as torch."""
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


def make_wire_job(tmp_path, chunks, n_rows, name="req-1", pool=None):
    """``make_job``'s job as the writer supervisor takes it (in-process tests of writer/supervisor.py):
    its rows described where they lie (in ``pool``, or inline); releasing it frees them."""
    from sglang_capture.server.writer_pool import job_message
    from sglang_capture.writer.supervisor import JOB_FIELDS, WireJob

    job, ledger = make_job(tmp_path, chunks, n_rows, name)
    message = job_message(job, pool)
    return WireJob(**{k: message[k] for k in JOB_FIELDS}, release=job.capture.release), ledger


def write_and_wait(pool, job, timeout=60.0):
    """Submit ``job`` to a writer pool (or an in-process supervisor) and wait for its outcome."""
    pool.submit(job)
    if not job.done.wait(timeout):
        raise TimeoutError(f"the writer did not finish {job.meta.get('rid')} in {timeout:.0f} s")
    return job.outcome


def as_torch(host):
    """A writer-side HostTensor's bytes as a torch tensor of its stored dtype (a copy)."""
    import numpy
    import torch

    from sglang_capture.core.format import _BYTE_DTYPES

    t = torch.from_numpy(numpy.ascontiguousarray(host.array).copy())
    if host.dtype == "bfloat16":
        return t.view(torch.int16).view(torch.bfloat16)
    return t.view(getattr(torch, host.dtype)) if host.dtype in _BYTE_DTYPES else t
