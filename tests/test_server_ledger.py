"""Host-memory back-pressure (server/ledger.py)."""
from __future__ import annotations

import threading
import time

import torch

from sglang_capture.server.ledger import HostMemoryLedger


def test_ledger_counts_a_shared_batch_buffer_once():
    ledger = HostMemoryLedger(cap_bytes=1 << 30)
    batch = torch.zeros(10, 4)
    ledger.hold(batch[:3])
    ledger.hold(batch[3:])
    assert ledger.held_bytes == batch.untyped_storage().nbytes()
    ledger.release(batch[:3])
    assert ledger.held_bytes == batch.untyped_storage().nbytes()
    ledger.release(batch[3:])
    assert ledger.held_bytes == 0


def test_ledger_never_exceeds_the_cap_while_writes_are_pending():
    pending = threading.Event()
    pending.set()
    ledger = HostMemoryLedger(cap_bytes=500, draining=pending.is_set)
    first, second = torch.zeros(100), torch.zeros(100)  # 400 bytes each: both together exceed the cap

    def writer_finishes_first():
        time.sleep(0.2)
        ledger.release(first)
        pending.clear()

    told = []
    ledger.on_wait = lambda: told.append(ledger.waiting)  # the writer link's idle pump, woken to read what frees it
    ledger.hold(first)
    threading.Thread(target=writer_finishes_first).start()
    start = time.monotonic()
    ledger.hold(second)  # the scheduler waits here until the pending write frees memory
    assert time.monotonic() - start >= 0.15 and ledger.waits == 1
    assert ledger.peak_bytes == 400 <= ledger.cap_bytes
    assert told == [True] and not ledger.waiting  # told once, as the wait began


def test_ledger_goes_over_the_cap_rather_than_deadlock_when_nothing_is_pending():
    ledger = HostMemoryLedger(cap_bytes=100)  # draining() is False: no write will free anything
    big = torch.zeros(100)
    ledger.hold(big)  # one buffer larger than the cap
    ledger.hold(torch.zeros(10))
    assert ledger.held_bytes == 440 and ledger.waits == 0


def test_the_ledger_counts_each_pool_block_once_by_what_the_pool_holds_for_it():
    """Blocks are page-rounded (2,048 bytes of rows hold a 4,096-byte block): the cap bounds what
    the pool holds, not the rows' own bytes (issue 34 item 9)."""
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.request_capture import RequestCapture

    pool = HostPool(1 << 20, pin=False)
    ledger = HostMemoryLedger(1 << 30, block_bytes=pool.block_bytes)
    batch = pool.take(torch.zeros(64, 8))
    a, b = (RequestCapture(rid=r, name=r, ledger=ledger) for r in "ab")
    a.add(0, batch[:32])
    b.add(0, batch[32:])
    assert ledger.held_bytes == pool.used_bytes == 4096
    a.release()
    assert ledger.held_bytes == 4096
    b.release()
    assert ledger.held_bytes == 0
    outside = torch.zeros(10, 4)  # SGLang's own buffer (the pool was full): its storage's size
    ledger.hold(outside)
    assert ledger.held_bytes == 160
