"""Stream order on a CPU: every tensor the forward stream hands the copy stream is recorded on it.

SGLang's copy hook runs on its copy stream and reads the forward's hidden states there (gathers,
FP8 packs, the copy into the host pool). Unless the copy stream is recorded on that tensor, the
caching allocator hands its memory to the next forward as soon as the last reference goes, and
the queued reads see the next batch's values (bench/RESULTS.md r47: 9 of 10 trials corrupted). On
a CPU nothing is ``is_cuda``, so those calls never run and their removal broke no test (issue 34
item 5). Here the forward's tensor says it is on the GPU, and the stream API is wrapped: the real
hooks run their CUDA branches and every ``record_stream`` and event is logged.
"""
from __future__ import annotations

import pytest
import torch

from sglang_capture.testbed.copy_hook import CopyHookCall

H = 4  # hidden size: rows are [aux layers + final] x H
METADATA = {"__get__", "size", "dim", "numel", "element_size", "data_ptr", "untyped_storage", "is_contiguous",
            "stride", "storage_offset", "__getitem__", "view", "__len__", "__repr__", "__format__", "record_stream"}


class CopyStream:
    """What ``torch.cuda.current_stream()`` returns while the hook runs (it runs on SGLang's copy stream)."""


class Event:
    """``torch.cuda.Event``: recorded on the copy stream, done only when the test says so."""

    def __init__(self, log):
        self.log, self.recorded, self.done = log, False, False

    def record(self, stream=None):
        self.recorded = True
        self.log.append(("event", self))

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is on the GPU; ops that read it and streams recorded on it are logged."""

    log: list = []

    @property
    def is_cuda(self):
        return True

    def record_stream(self, stream):
        with torch._C.DisableTorchFunctionSubclass():
            OnDevice.log.append(("record", self.untyped_storage().data_ptr(), type(stream).__name__))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                flat = [*args, *kwargs.values()]
                flat += [x for a in args if isinstance(a, (list, tuple)) for x in a]
                ptrs = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, OnDevice)}
            if ptrs:
                OnDevice.log.append(("read", name, ptrs))
        return super().__torch_function__(func, types, args, kwargs)


@pytest.fixture
def streams(monkeypatch):
    """The CUDA stream API, wrapped: the current stream is the copy stream; events are logged."""
    log = []
    OnDevice.log = log
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: CopyStream())
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: Event(log))
    return log


def _forward_tensor(rows: int, width: int) -> OnDevice:
    """Rows the forward made: bf16 values, marked as living on the device."""
    return torch.randn(rows, width).to(torch.bfloat16).as_subclass(OnDevice)


def _events(log):
    return [e[1] for e in log if e[0] == "event"]


def _reads_of(log, ptr):
    return [e for e in log if e[0] == "read" and ptr in e[2]]


@pytest.mark.parametrize("readers,lens", [
    (["fp8", "plain", "fp8"], [3, 2, 4]),  # FP8 captures beside a plain request: gathered, then packed whole
    (["fp8", "fp8"], [3, 4]),  # every row an FP8 capture's: packed whole, no gather
    (["fp8", "model", "plain"], [2, 3, 2]),  # FP8 beside a model-dtype capture: a packed copy beside
    (["fp8", "json"], [3, 3]),  # FP8 beside SGLang's JSON request: the whole batch, packed beside
    (["model", "plain"], [3, 2]),  # model dtype only: gathered
], ids=["fp8-gathered", "fp8-whole", "fp8-beside-model", "fp8-beside-json", "model-gathered"])
def test_the_copy_hook_records_the_forward_tensor_on_the_copy_stream_whenever_it_reads_it(tmp_path, streams, readers,
                                                                                         lens):
    from sglang_capture.server.host_pool import HostPool

    hidden = _forward_tensor(sum(lens), 2 * H)
    with torch._C.DisableTorchFunctionSubclass():
        forward = hidden.untyped_storage().data_ptr()
    call = CopyHookCall(str(tmp_path), hidden, H, readers, lens, HostPool(1 << 20, pin=False))
    host = call()
    assert _reads_of(streams, forward), "the hook never read the forward's rows: nothing was checked"
    assert ("record", forward, "CopyStream") in streams
    assert host.device.type == "cpu" and call.sglang_copies == [{"return_logprob": False, "return_hidden_states": False}]


def test_a_pool_block_filled_from_the_device_is_not_reused_before_its_copy_is_done(streams):
    from sglang_capture.server.host_pool import HostPool

    pool = HostPool(1 << 16, pin=False)
    block = pool.take(_forward_tensor(4, 2 * H))
    [event] = [e for e in _events(streams)]
    start = block.data_ptr()
    del block  # the last reference: the block is freed, but the device may still be copying into it
    again = pool.take(torch.zeros(4, 2 * H, dtype=torch.bfloat16))
    assert again.data_ptr() != start
    event.done = True  # the copy has landed
    del again
    third = pool.take(torch.zeros(4, 2 * H, dtype=torch.bfloat16))
    assert third.data_ptr() == start  # its block is handed out again


def test_device_rows_a_request_takes_itself_are_recorded_on_its_stream_before_it_reads_them(tmp_path, streams):
    """The row seams may hand a request rows still on the device (a PD prefill server's): the
    request packs and copies them on the current stream, so it records them there first."""
    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger
    from sglang_capture.server.request_capture import RequestCapture

    pool = HostPool(1 << 20, pin=False)
    for fp8 in (H, None):
        capture = RequestCapture(rid="r", name="r", ledger=HostMemoryLedger(1 << 20), pool=pool, fp8_block=fp8,
                                 counts=CopyCounts())
        rows = _forward_tensor(40, 2 * H)  # more than a run: kept as a block of its own
        with torch._C.DisableTorchFunctionSubclass():
            ptr = rows.untyped_storage().data_ptr()
        streams.clear()
        capture.add(0, rows)
        assert streams[0] == ("record", ptr, "CopyStream")  # before anything reads them (the FP8 pack)
        assert bool(_reads_of(streams, ptr)) == (fp8 is not None)
        capture.release()
