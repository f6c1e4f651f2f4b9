"""The host pool (server/host_pool.py)."""
from __future__ import annotations

import threading
import time
import types

import pytest
import torch


def test_the_pool_copies_rows_into_a_block_and_takes_it_back_only_when_nothing_uses_it():
    from sglang_capture.server.host_pool import ALIGN, HostPool

    pool = HostPool(1 << 20, pin=False)
    src = torch.randn(100, 64).to(torch.bfloat16)
    block = pool.take(src)
    assert torch.equal(block, src) and block.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    rows = block[10:20]
    as_numpy = rows.view(torch.int16).numpy()  # how the writer reads bf16 rows
    del block, rows
    assert pool.free_segments() == [(0, (1 << 20) - ALIGN * 4)]  # 12,800 bytes round up to 4 pages, at the top
    assert pool.stats()["used_bytes"] == ALIGN * 4
    del as_numpy
    assert pool.free_segments() == [(0, 1 << 20)] and pool.stats()["used_bytes"] == 0


def test_pool_blocks_freed_out_of_order_coalesce_and_a_full_pool_says_so():
    from sglang_capture.server.host_pool import ALIGN, HostPool

    pool = HostPool(8 * ALIGN, pin=False, small_block=ALIGN)
    page = torch.zeros(ALIGN // 4)  # one page of float32: a small block, taken from the top
    a, b, c = pool.take(page), pool.take(page), pool.take(page)
    big = pool.take(torch.zeros(5 * ALIGN // 4))  # a large one, from the bottom
    assert big is not None and pool.take(page) is None and pool.stats()["fallbacks"] == 1
    del b
    assert pool.free_segments() == [(6 * ALIGN, 7 * ALIGN)]
    del a, c
    assert pool.free_segments() == [(5 * ALIGN, 8 * ALIGN)]
    assert (pool.stats()["free_segments"], pool.stats()["largest_free_bytes"]) == (1, 3 * ALIGN)  # in the stats file
    assert pool.take(torch.zeros(3 * ALIGN // 4)) is not None  # the three freed pages join into one
    assert pool.take(torch.zeros(0)) is None  # nothing to copy: left to SGLang


def test_small_blocks_that_stay_long_do_not_cut_up_the_room_for_large_ones():
    from sglang_capture.server.host_pool import ALIGN, HostPool

    pool = HostPool(64 * ALIGN, pin=False, small_block=ALIGN)
    prefill, decode = torch.zeros(16 * ALIGN // 4), torch.zeros(ALIGN // 4)
    a, s1, b, s2 = pool.take(prefill), pool.take(decode), pool.take(prefill), pool.take(decode)
    del a, b  # the prefill blocks are written; the decode steps' blocks stay with their requests
    assert pool.take(torch.zeros(32 * ALIGN // 4)) is not None  # first fit alone leaves 16-page holes
    assert s1 is not None and s2 is not None


def test_pool_blocks_freed_on_other_threads_while_the_scheduler_takes_more():

    from sglang_capture.server.host_pool import HostPool

    pool = HostPool(64 << 10, pin=False)
    src = torch.arange(1024, dtype=torch.float32)  # 4 KiB
    held, overwritten = [], []
    stop = threading.Event()

    def writer():
        while not stop.is_set() or held:
            if not held:
                time.sleep(0.0005)
                continue
            t = held.pop(0)
            overwritten.append(not torch.equal(t, src))  # a block still in use was handed out again
            del t

    thread = threading.Thread(target=writer)
    thread.start()
    taken, deadline = 0, time.monotonic() + 30
    while taken < 200:  # 16 blocks fit at once: only blocks the other thread gave back make 200
        assert time.monotonic() < deadline, f"only {taken} blocks in 30 s"
        block = pool.take(src)
        if block is None:
            time.sleep(0.001)  # full: let the writer thread run
            continue
        taken += 1
        held.append(block)
        del block
    stop.set()
    thread.join()
    assert len(overwritten) == 200 and not any(overwritten)
    assert pool.free_segments() == [(0, 64 << 10)]


def test_short_host_rows_move_to_runs_of_their_own_request_so_the_steps_shared_block_is_freed_at_once():
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger
    from sglang_capture.server.request_capture import RUN_ROWS, RequestCapture

    pool = HostPool(4 << 20, pin=False)
    ledger = HostMemoryLedger(4 << 20)
    caps = [RequestCapture(rid=f"r{i}", name=f"r{i}", ledger=ledger, pool=pool) for i in range(3)]
    want = {i: [] for i in range(3)}
    for step in range(RUN_ROWS + 5):
        block = pool.take(torch.randn(3, 16).to(torch.bfloat16))  # one decode step: a row per request
        for i, cap in enumerate(caps):
            cap.add(100 + step, block[i:i + 1])
            want[i].append(block[i].clone())
        del block
    assert pool.stats()["blocks"] == (RUN_ROWS + 5) + 3 * 2  # the steps' blocks, two runs per request
    runs_bytes = 3 * 2 * 4096  # each run (32 rows, then 64, x 32 bytes) rounds up to one page
    pool.free_segments()  # folds in the returned blocks: every step's block is back
    assert pool.stats()["used_bytes"] == runs_bytes and ledger.held_bytes == 3 * 3 * RUN_ROWS * 32
    for i, cap in enumerate(caps):
        assert cap.run.capacity == 2 * RUN_ROWS  # the first run filled: the next one is twice as long
        cap.seal()  # a run's rows are final when it closes
        assert [c.start for c in cap.chunks] == [100, 100 + RUN_ROWS]
        assert torch.equal(torch.cat([c.rows for c in cap.chunks]), torch.stack(want[i]))
    caps[0].add(500, torch.ones(1, 16, dtype=torch.bfloat16))  # not the next position (a retraction): a new run
    caps[0].seal()
    assert [c.start for c in caps[0].chunks][-1] == 500 and caps[0].chunks[-1].rows.shape[0] == 1
    assert caps[0].chunks[-1].rows.untyped_storage().nbytes() == RUN_ROWS * 32  # not a continuation: first size
    for cap in caps:
        cap.release()
    pool.free_segments()
    assert ledger.held_bytes == 0 and pool.stats()["used_bytes"] == 0
    full = HostPool(4096, pin=False)
    step = full.take(torch.zeros(4, 16, dtype=torch.bfloat16))  # the step's block takes the whole pool
    lone = RequestCapture(rid="x", name="x", ledger=ledger, pool=full)
    lone.add(7, step[0:1])  # no room for a run: the view of the step's block is kept, counted
    assert lone.chunks[0].rows.data_ptr() == step.data_ptr() and full.stats()["fallbacks"] == 1


@pytest.mark.parametrize("cap_mb,width,want", [(1, 16, [32, 64, 128, 128]), (1024, 8192, [32, 64, 128, 128]),
                                                 (4, 1024, [32, 32, 32])])
def test_a_request_that_fills_its_runs_gets_longer_ones_up_to_a_bound_set_by_the_run_limit_and_the_cap(cap_mb, width, want):
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger
    from sglang_capture.server.request_capture import RequestCapture

    pool = HostPool(64 << 20, pin=False)
    cap = RequestCapture(rid="r", name="r", ledger=HostMemoryLedger(cap_mb << 20), pool=pool)
    row = torch.ones(1, width, dtype=torch.bfloat16)  # 1 MiB cap, 32-byte rows: 4 KiB a run at most; 16 KiB rows: 2 MiB
    position = 0
    for _ in range(sum(want)):
        cap.add(position, row)
        position += 1
    cap.add(position + 5, row)  # a retraction's jump: back to the first size
    cap.seal()
    assert [c.rows.untyped_storage().nbytes() // (2 * width) for c in cap.chunks] == [*want, 32]
    assert all(c.rows.shape[0] == n for c, n in zip(cap.chunks, want, strict=False))


def test_a_longer_run_that_does_not_fit_falls_back_to_the_first_size_before_the_steps_view():
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger
    from sglang_capture.server.request_capture import RUN_ROWS, RequestCapture

    pool = HostPool(3 * 4096, pin=False)  # three pages: a 32-row run of 128-byte rows each
    cap = RequestCapture(rid="r", name="r", ledger=HostMemoryLedger(1 << 30), pool=pool)
    held = pool.alloc((4096,), torch.uint8)  # noqa: F841  (one page stays taken)
    row = torch.ones(1, 64, dtype=torch.bfloat16)
    for position in range(RUN_ROWS + 1):  # the first run fills; the doubled one (two pages) does not fit
        cap.add(position, row)
    cap.seal()
    assert [c.rows.shape[0] for c in cap.chunks] == [RUN_ROWS, 1]
    assert cap.chunks[1].rows.untyped_storage().nbytes() == RUN_ROWS * 128  # the first size, in the pool
    assert pool.stats()["fallbacks"] == 0  # the longer run's miss is not a fallback: nothing fell back


@pytest.mark.parametrize("on", ["copier", "scheduler"])
def test_a_steps_decode_rows_go_into_their_requests_runs_in_one_scatter_exactly_as_one_by_one(on):
    from sglang_capture.server.batch_rows import ResultRows
    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.decode_rows import CopyTicket, DecodeRows, RowCopier
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger
    from sglang_capture.server.request_capture import RUN_ROWS, RequestCapture

    pool, ledger, counts = HostPool(8 << 20, pin=False), HostMemoryLedger(8 << 20), CopyCounts()
    copier = RowCopier(pool, counts) if on == "copier" else None
    batched = DecodeRows(pool, counts, copier)
    one_by_one = [RequestCapture(rid=f"a{i}", name=f"a{i}", ledger=ledger, pool=pool) for i in range(3)]
    together = [RequestCapture(rid=f"b{i}", name=f"b{i}", ledger=ledger, pool=pool) for i in range(3)]
    torch.manual_seed(0)
    position = [10, 20, 30]
    for step in range(RUN_ROWS + 7):
        stride = 1 + step % 3  # an EAGLE-3 verify pass: a block of draft rows per request, some accepted
        block = pool.take(torch.randn(3 * stride, 16).to(torch.bfloat16))
        for i in range(3):
            accept = 1 + (step + i) % stride
            if step == RUN_ROWS + 3 and i == 1:
                position[i] += 100  # retracted and decoded again elsewhere: a new run
            one_by_one[i].add(position[i], block[i * stride:i * stride + accept])
            batched.note(together[i], position[i], block, i * stride, accept, ResultRows(None, None))
            position[i] += accept
        batched.flush()  # placed here, together
        del block  # the reservations keep the step's rows until the copy
    for a, b in zip(one_by_one, together, strict=True):
        a.seal()
        b.seal()
        assert [c.start for c in a.chunks] == [c.start for c in b.chunks] and len(b.chunks) >= 2
        for ca, cb in zip(a.chunks, b.chunks, strict=True):
            assert isinstance(cb.ready, CopyTicket) and bool(cb.ready.seqs) == (copier is not None)
            cb.ready.synchronize()  # what the hand-off thread does before a writer reads the run
            assert torch.equal(ca.rows, cb.rows) and pool.offset_of(cb.rows) is not None
    if copier is not None:
        copier.close()
    assert counts.decode_scatters == RUN_ROWS + 7 and counts.decode_rows_scattered == sum(
        c.rows.shape[0] for b in together for c in b.chunks)


def test_decode_rows_that_cannot_be_scattered_are_added_by_their_capture_or_kept_as_views():
    from sglang_capture.server.batch_rows import ResultRows
    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.decode_rows import CopyTicket, DecodeRows
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger
    from sglang_capture.server.request_capture import RequestCapture

    pool, ledger, counts = HostPool(1 << 20, pin=False), HostMemoryLedger(1 << 20), CopyCounts()
    rows = DecodeRows(pool, counts)
    step = torch.randn(48, 16).to(torch.bfloat16)
    strided = step.t().contiguous().t()
    refused = {"strided": (strided, 1), "fp8": (step, 1), "long": (step, 40)}  # not contiguous; not packed yet; > a run
    caps = {k: RequestCapture(rid=k, name=k, ledger=ledger, pool=pool, fp8_block=8 if k == "fp8" else None) for k in refused}
    for k, (source, n) in refused.items():
        rows.note(caps[k], 5, source, 0, n, ResultRows(None, None))
    rows.flush()
    assert counts.decode_scatters == 0  # none was scattered: each capture added its own rows
    for k, (source, n) in refused.items():
        caps[k].seal()
        chunk = caps[k].chunks[0]
        assert chunk.start == 5 and chunk.rows.shape[0] == n and not isinstance(chunk.ready, CopyTicket)
    assert torch.equal(caps["strided"].chunks[0].rows, strided[:1]) and caps["fp8"].chunks[0].rows.element_size() == 1
    assert caps["long"].chunks[0].rows.data_ptr() == step.data_ptr()  # more rows than a run: a view, no copy
    full = HostPool(4096, pin=False)
    held = full.alloc((4096,), torch.uint8)  # noqa: F841  (the pool is full while it lives)
    lone = RequestCapture(rid="x", name="x", ledger=ledger, pool=full)
    lonely = DecodeRows(full, CopyCounts())
    lonely.note(lone, 0, step, 0, 1, ResultRows(None, None))
    lonely.flush()  # no room for a run: the step's view is kept
    assert lone.chunks[0].rows.data_ptr() == step.data_ptr() and full.stats()["fallbacks"] == 1  # one try, counted once
    with pytest.raises(ValueError, match="lie outside the pool"):
        pool.scatter_rows(step, [0], [pool.size_bytes - 8])


def test_noted_rows_that_are_not_in_the_batch_or_cannot_be_placed_fail_their_capture_and_the_others_are_still_copied():
    from sglang_capture.server.batch_rows import BatchRows, ResultRows
    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.decode_rows import DecodeRows
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger
    from sglang_capture.server.request_capture import RequestCapture

    pool, ledger, counts = HostPool(1 << 20, pin=False), HostMemoryLedger(1 << 20), CopyCounts()
    rows = DecodeRows(pool, counts)
    step = pool.take(torch.randn(4, 16).to(torch.bfloat16))
    good, past, unkept, broken, after = (RequestCapture(rid=k, name=k, ledger=ledger, pool=pool) for k in "gpuba")
    kept = BatchRows(None, captures=True)
    kept.keep(([(0, 4)], {0: 0, 2: 2}), batch_rows=6, in_forward=False)  # rows at batch offsets 0 and 2 were kept

    def place_fails(*args):
        raise OSError("injected")

    broken.place = place_fails
    rows.note(good, 9, step, 1, 1, ResultRows(None, None))
    rows.note(past, 9, step, 3, 2, ResultRows(None, None))  # rows 3-4 of 4
    rows.note(unkept, 9, step, 1, 1, ResultRows(None, kept))  # batch offset 1 was not kept: each note keeps its batch
    rows.note(broken, 9, step, 0, 1, ResultRows(None, None))
    rows.note(after, 9, step, 2, 1, ResultRows(None, None))  # after the failures: still placed and copied
    rows.flush()
    assert past.failure == "rows 3-4 asked of 4" and not past.chunks
    assert unkept.failure.startswith("kept rows do not match: offset 1")
    assert broken.failure == "decode rows at position 9 could not be placed: OSError: injected"
    assert counts.decode_scatters == 1 and counts.decode_rows_scattered == 2
    for cap, want in ((good, step[1:2]), (after, step[2:3])):
        cap.seal()
        assert cap.failure is None and torch.equal(cap.chunks[0].rows, want)


def test_a_decode_row_arriving_outside_a_batch_result_fails_its_capture_with_or_without_the_pool():
    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.decode_rows import DecodeRows
    from sglang_capture.server.hooks.results import take_decode_rows
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger
    from sglang_capture.server.request_capture import CAPTURE_ATTR, RequestCapture

    pool, ledger = HostPool(1 << 20, pin=False), HostMemoryLedger(1 << 20)
    for decode_rows in (DecodeRows(pool, CopyCounts()), None):
        state = types.SimpleNamespace(decode_rows=decode_rows, processing=None)
        req = types.SimpleNamespace(origin_input_ids=[1, 2, 3], output_ids=[4, 5])
        capture = RequestCapture(rid="r", name="r", ledger=ledger, pool=pool)
        setattr(req, CAPTURE_ATTR, capture)
        take_decode_rows(state, None, None, (), {"req": req, "hidden_states": torch.zeros(2, 16), "start": 0, "accept_len": 1})
        assert capture.failure == "rows of batch offset 0 arrived outside a batch's result processing"
        assert decode_rows is None or not decode_rows._notes  # nothing left for the next batch's flush


def _decode_step(pool, rows, caps, position):
    """One decode step's rows (a row per capture) reserved in ``rows``, then flushed."""
    from sglang_capture.server.batch_rows import ResultRows

    block = pool.take(torch.randn(len(caps), 16).to(torch.bfloat16))
    for i, cap in enumerate(caps):
        rows.note(cap, position, block, i, 1, ResultRows(None, None))
    rows.flush()
    return block.clone()


def test_a_failed_row_copy_fails_only_the_runs_that_had_rows_in_it():
    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.decode_rows import DecodeRows, RowCopier
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger
    from sglang_capture.server.request_capture import RequestCapture

    pool, ledger, counts = HostPool(4 << 20, pin=False), HostMemoryLedger(4 << 20), CopyCounts()
    calls = []
    scatter = pool.scatter_rows

    def second_fails(*args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("injected")
        scatter(*args)

    pool.scatter_rows = second_fails
    copier = RowCopier(pool, counts)
    rows = DecodeRows(pool, counts, copier)
    early = RequestCapture(rid="e", name="e", ledger=ledger, pool=pool)
    late = RequestCapture(rid="l", name="l", ledger=ledger, pool=pool)
    want = _decode_step(pool, rows, [early], 0)  # flush 1: copied
    _decode_step(pool, rows, [late], 0)  # flush 2: fails
    for cap in (early, late):
        cap.seal()
    early.chunks[0].ready.synchronize()
    assert torch.equal(early.chunks[0].rows, want)
    with pytest.raises(RuntimeError, match="could not be copied into their run: OSError: injected"):
        late.chunks[0].ready.synchronize()
    copier.close()


def _gated_copier(**kwargs):
    """A pool whose scatters wait for ``go``, with its copier and decode rows: copies stay in flight."""
    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.decode_rows import DecodeRows, RowCopier
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger

    pool, ledger, counts = HostPool(4 << 20, pin=False), HostMemoryLedger(4 << 20), CopyCounts()
    go = threading.Event()
    scatter = pool.scatter_rows

    def gated(*args):
        go.wait(10)
        scatter(*args)

    pool.scatter_rows = gated
    copier = RowCopier(pool, counts, **kwargs)
    return pool, ledger, counts, copier, DecodeRows(pool, counts, copier), go


def test_the_scheduler_waits_for_a_copier_that_falls_behind_and_a_closed_copier_leaves_the_copy_to_the_flush():
    from sglang_capture.server.request_capture import RequestCapture

    pool, ledger, counts, copier, rows, go = _gated_copier(max_behind=2)
    cap = RequestCapture(rid="c", name="c", ledger=ledger, pool=pool)
    want = []
    steps = threading.Thread(target=lambda: want.extend(_decode_step(pool, rows, [cap], p) for p in range(3)))
    steps.start()
    time.sleep(0.5)
    assert steps.is_alive() and counts.decode_copy_waits == 1  # the third flush waits: one copying, one queued
    go.set()
    steps.join(10)
    assert not steps.is_alive()
    copier.close()
    assert counts.decode_scatters == 3 and not copier._thread.is_alive()
    want.append(_decode_step(pool, rows, [cap], 3))  # after close: copied in the flush itself
    assert counts.decode_scatters == 4
    cap.seal()
    cap.chunks[0].ready.synchronize()
    assert torch.equal(cap.chunks[0].rows, torch.cat(want))


def test_a_runs_ticket_holds_the_hand_off_until_its_rows_are_copied_and_an_in_place_copy_that_fails_fails_its_runs():
    from sglang_capture.server.request_capture import RequestCapture

    pool, ledger, counts, copier, rows, go = _gated_copier()
    cap = RequestCapture(rid="c", name="c", ledger=ledger, pool=pool)
    want = _decode_step(pool, rows, [cap], 0)
    cap.seal()
    handed = threading.Event()
    hand_off = threading.Thread(target=lambda: (cap.chunks[0].ready.synchronize(), handed.set()))
    hand_off.start()
    time.sleep(0.3)
    assert not handed.is_set()  # what describe_chunks does: the writer may not read the run yet
    go.set()
    hand_off.join(10)
    assert handed.is_set() and torch.equal(cap.chunks[0].rows, want)
    copier.close()

    def broken(*args):
        raise OSError("injected")

    pool.scatter_rows = broken  # a closed copier: the flush copies in place, on the scheduler thread
    late = RequestCapture(rid="l", name="l", ledger=ledger, pool=pool)
    _decode_step(pool, rows, [late], 0)  # does not raise
    late.seal()
    with pytest.raises(RuntimeError, match="could not be copied into their run: OSError: injected"):
        late.chunks[0].ready.synchronize()


def test_a_runs_ticket_says_without_waiting_whether_its_rows_are_copied_and_rows_so_far_wait_for_no_later_flush():
    """The writer link sends a job only once its rows are copied (``query``, never waiting); a job
    storing a request's rows ahead of its file holds the run as it is (``rows_so_far``): the flushes
    into the run after that are not its own and do not hold it back."""
    from sglang_capture.server.request_capture import RequestCapture

    pool, ledger, counts, copier, rows, go = _gated_copier()
    cap = RequestCapture(rid="c", name="c", ledger=ledger, pool=pool)
    first = _decode_step(pool, rows, [cap], 0)  # flush 1, gated
    ticket = cap.chunks[0].ready
    assert not ticket.query()
    ahead = cap.rows_so_far()
    assert [c.rows.shape[0] for c in ahead] == [1] and not ahead[0].ready.query()
    go.set()
    deadline = time.monotonic() + 10
    while not ahead[0].ready.query():
        assert time.monotonic() < deadline, "flush 1 never copied"
        time.sleep(0.01)
    go.clear()
    _decode_step(pool, rows, [cap], 1)  # flush 2 into the same run, gated
    assert not ticket.query() and ahead[0].ready.query()  # the run waits for it; the rows so far do not
    ahead[0].ready.synchronize()
    assert torch.equal(ahead[0].rows, first)
    go.set()
    copier.close()
    assert ticket.query()
