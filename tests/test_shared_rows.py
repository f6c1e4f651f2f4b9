"""Shared rows without a server: block keys (core/blocks.py), the scheduler's index
(server/block_index.py), the writer storing blocks and files of references (writer/blocks.py),
reading them back (core/reader.py), ``gc`` and ``extract``'s move (tools/)."""
from __future__ import annotations

import json
import os

import numpy
import pytest
import torch

from sglang_capture.core.blocks import (
    BLOCK_TOKENS,
    BLOCKS_DIR,
    BlockRef,
    block_relpath,
    layout_root,
    plan_blocks,
)
from sglang_capture.core.capture_dir import index_path, read_stats
from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.format import SCHEMA_REFS, CaptureFileError
from sglang_capture.core.reader import load, load_records
from sglang_capture.server.block_index import BlockEvent, BlockIndex, Coverage, IndexedBlock, blocks_of
from sglang_capture.server.ledger import HostMemoryLedger

B = BLOCK_TOKENS
ROOT = layout_root({"model": "m", "layers": [1]})


def _ids(n, seed=0):
    return numpy.random.default_rng(seed).integers(0, 1000, n).astype(numpy.int64)


# --- keys -------------------------------------------------------------------------------------------

def test_blocks_cut_rows_at_slot_boundaries_and_their_keys_name_everything_the_rows_depend_on():
    ids = _ids(3 * B)
    plan = plan_blocks(ids, 100, 2 * B + 10, ROOT)
    assert [(b.start, b.end) for b in plan] == [(100, B), (B, 2 * B), (2 * B, 2 * B + 10)]
    assert plan == plan_blocks(ids, 100, 2 * B + 10, ROOT)  # content-addressed: the same rows, the same names
    assert plan[1].key == plan_blocks(ids, B, 2 * B, ROOT)[0].key  # a whole slot has one name however it came
    other = ids.copy()
    other[5] += 1  # a token before the block
    assert plan_blocks(other, B, 2 * B, ROOT)[0].key != plan[1].key
    assert plan_blocks(ids, 100, B, layout_root({"model": "m", "layers": [2]}))[0].key != plan[0].key
    assert plan_blocks(ids, 101, B, ROOT)[0].key != plan[0].key  # other rows of the slot
    assert plan_blocks(ids, 0, 0, ROOT) == []
    with pytest.raises(ValueError, match="do not lie within"):
        plan_blocks(ids, 0, 3 * B + 1, ROOT)


def test_a_block_reference_is_checked_when_read():
    ref = BlockRef("ab" * 16, 256, 300, 400)
    assert BlockRef.from_list(ref.as_list()) == ref
    for bad in (["zz" * 16, 0, 0, 1], ["ab" * 16, 0, 5, 5], ["ab" * 16, 0, 0, B + 1], ["ab" * 16, 0, 0], "x"):
        with pytest.raises(ValueError):
            BlockRef.from_list(bad)


# --- the scheduler's index ----------------------------------------------------------------------------

def _indexed(ids, start, end):
    return blocks_of([[b.name, b.slot_hash.hex(), b.start, b.end, 100] for b in plan_blocks(ids, start, end, ROOT)], ids)


def test_the_index_covers_a_conversation_turn_by_turn_and_stops_where_tokens_differ():
    index = BlockIndex()
    turn1 = _ids(300)
    index.apply(BlockEvent(added=_indexed(turn1, 0, 299)))
    turn2 = numpy.concatenate([turn1, _ids(50, seed=1)])
    cov = index.cover(turn2, len(turn2) - 1, [ROOT])
    assert cov.reach == 299 and [(r.first, r.last) for r in cov.refs] == [(0, B), (B, 299)]
    index.apply(BlockEvent(added=_indexed(turn2, 299, 349)))  # turn 2's head block continues turn 1's tail
    turn3 = numpy.concatenate([turn2, _ids(20, seed=2)])
    assert index.cover(turn3, len(turn3) - 1, [ROOT]).reach == 349
    fork = turn2.copy()
    fork[280] += 1  # another conversation diverging inside turn 1's tail block: its first 280 rows are reusable
    cov = index.cover(fork, len(fork) - 1, [ROOT])
    assert cov.reach == 280 and cov.refs[-1].last == 280
    assert cov.upto(200)[-1].last == 200 and len(cov.upto(200)) == 1
    assert index.cover(turn2, 120, [ROOT]).reach == 120  # SGLang's own limit
    assert index.cover(turn2, 400, [layout_root({"model": "other"})]).reach == 0  # another layout's rows
    version = index.version
    index.apply(BlockEvent(dropped=[cov.refs[0].name]))  # a block a writer found gone
    assert index.version != version and index.cover(turn2, 349, [ROOT]).reach == 0


def test_the_slot_hashes_a_match_passes_through_are_the_requests_own_and_are_made_once_per_block(monkeypatch):
    from sglang_capture.core.blocks import slot_hashes
    from sglang_capture.server import block_index

    index = BlockIndex()
    chat = _ids(4 * B + 30)
    index.apply(BlockEvent(added=_indexed(chat, 0, 3 * B + 10)))
    made = []
    real = block_index.slot_hash
    monkeypatch.setattr(block_index, "slot_hash", lambda prev, tokens: made.append(1) or real(prev, tokens))
    for turn in range(3):  # each turn a new request (fresh hashes) re-sending the history, plus its own tokens
        ids = numpy.concatenate([chat, _ids(10 + turn, seed=turn + 1)])
        hashes = [ROOT]
        cov = index.cover(ids, len(ids) - 1, hashes)
        assert cov.reach == 3 * B + 10
        assert hashes == slot_hashes(ids, ROOT, 4)  # h_0..h_3 of its own tokens
        assert plan_blocks(ids, cov.reach, len(ids), ROOT, hashes) == plan_blocks(ids, cov.reach, len(ids), ROOT)
    assert len(made) == 3  # the three whole slots' blocks, hashed through once for all three requests
    again = hashes[:2]  # a request whose first slot is hashed already (its earlier match): the rest as before
    assert index.cover(ids, len(ids) - 1, again).reach == cov.reach and again == slot_hashes(ids, ROOT, 4)
    later = numpy.concatenate([ids, _ids(3 * B, seed=9)])  # a block in flight, then stored: its hash through is kept
    index.apply(BlockEvent(in_flight=_in_flight(later, cov.reach, 5 * B), in_flight_job=1))
    assert index.cover(later, 5 * B, [ROOT]).reach == 5 * B
    index.apply(BlockEvent(added=_indexed(later, cov.reach, 5 * B), settled=[1]))
    fresh = [ROOT]
    assert index.cover(later, 5 * B, fresh).reach == 5 * B and fresh == slot_hashes(later, ROOT, 6)
    index.apply(BlockEvent(dropped=[cov.refs[0].name]))  # a block forgotten: its hash through goes with it
    assert cov.refs[0].name not in index._through


def test_a_requests_prompt_ids_are_its_own_int64_copy_and_sglang_may_still_grow_its_arrays():
    from array import array
    from types import SimpleNamespace

    from sglang_capture.server.block_index import prompt_ids

    prompt = [int(x) for x in _ids(300)]
    fill = array("q", prompt + [7, 8])  # SGLang's fill ids: the prompt, then the answer so far
    req = SimpleNamespace(origin_input_ids=prompt, full_untruncated_fill_ids=fill)
    ids = prompt_ids(req)
    assert ids.dtype == numpy.int64 and ids.tolist() == prompt
    fill.extend([9] * 1000)  # no buffer of SGLang's array is still exported: it may grow
    fill[0] = -1
    assert ids[0] == prompt[0]  # a copy, not a view
    # no fill ids as an array('q') holding the whole prompt (another release, a request not yet refreshed): the list
    aborted = SimpleNamespace(origin_input_ids=[0], full_untruncated_fill_ids=fill)  # an abort replaced the prompt
    assert prompt_ids(aborted).tolist() == [0]
    for other in (None, array("q", prompt[:10]), list(prompt)):
        assert prompt_ids(SimpleNamespace(origin_input_ids=prompt, full_untruncated_fill_ids=other)).tolist() == prompt


def _in_flight(ids, start, end):
    from sglang_capture.server.block_index import IN_FLIGHT

    return blocks_of([[b.name, b.slot_hash.hex(), b.start, b.end, IN_FLIGHT] for b in plan_blocks(ids, start, end, ROOT)],
                     ids)


def test_blocks_in_flight_cover_like_stored_ones_until_their_job_is_done_without_them():
    """A queued job's blocks are reused as if stored (a chat's next turn, sent as soon as the answer
    came): the index names the jobs a match waits for; stored, a block keeps its place with its size;
    once every job that would store a block is done without it, it is gone and matches stop before it."""
    from sglang_capture.server.block_index import IN_FLIGHT

    index = BlockIndex()
    turn1 = _ids(300)
    index.apply(BlockEvent(added=_indexed(turn1, 0, B)))  # its prompt's slot, stored ahead
    index.apply(BlockEvent(in_flight=_in_flight(turn1, B, 299), in_flight_job=4))  # the rest: its file's job
    turn2 = numpy.concatenate([turn1, _ids(50, seed=1)])
    cov = index.cover(turn2, len(turn2) - 1, [ROOT])
    assert cov.reach == 299 and cov.sizes == (100, IN_FLIGHT) and cov.after == (4,)
    assert index.in_flight_jobs(r.name for r in cov.refs) == [4]
    index.apply(BlockEvent(dropped=[cov.refs[1].name]))  # reported gone before its job is done: it stays
    assert index.cover(turn2, len(turn2) - 1, [ROOT]).reach == 299
    index.apply(BlockEvent(in_flight=_in_flight(turn1, B, 299), in_flight_job=5))  # the same rows, another job
    index.apply(BlockEvent(in_flight=_in_flight(turn1, 0, B), in_flight_job=5))  # stored already: not in flight
    assert index.in_flight_jobs(r.name for r in cov.refs) == [4, 5]
    index.apply(BlockEvent(settled=[4]))  # done without it: job 5 still stores it
    assert index.cover(turn2, len(turn2) - 1, [ROOT]).reach == 299
    index.apply(BlockEvent(added=_indexed(turn1, B, 299), settled=[5]))  # stored, then settled: it stays
    cov = index.cover(turn2, len(turn2) - 1, [ROOT])
    assert cov.reach == 299 and cov.sizes == (100, 100) and index.in_flight_jobs(r.name for r in cov.refs) == []
    # a job done without storing its blocks: they are gone, on every rank applying the same events
    turn3 = numpy.concatenate([turn2, _ids(30, seed=2)])
    index.apply(BlockEvent(in_flight=_in_flight(turn2, 299, 349), in_flight_job=6))
    assert index.cover(turn3, len(turn3) - 1, [ROOT]).reach == 349
    version = index.version
    index.apply(BlockEvent(settled=[6]))
    assert index.version != version and index.cover(turn3, len(turn3) - 1, [ROOT]).reach == 299
    index.apply(BlockEvent(settled=[6]))  # twice: harmless
    assert len(index) == 2


def test_a_finished_capture_posts_the_blocks_its_job_will_store_under_the_names_its_writer_gives_them():
    """``SharedRows.in_flight`` plans a job's blocks from the request's slot hashes so far (no slot
    hashed twice): the names, rows and tokens the writer's own plan gives them. A file that reuses
    them names that job (``after``) and carries no size for them (their files' sizes are not known)."""
    from types import SimpleNamespace

    from sglang_capture.server.shared_rows import SHARE_ATTR, RequestShare, SharedRows

    writer = SharedRows()
    writer.layout = {"model": "m"}
    ids = _ids(3 * B + 40)
    share = RequestShare(ROOT)
    share.through(0, ids)  # its match hashed slot 0 (h_1) already
    job = SimpleNamespace(id=3, share={"root": ROOT.hex(), "start": 100, "computed": 100, "refs": [], "sizes": {}},
                          n_rows=3 * B + 39, input_ids=list(ids[:3 * B]), output_ids=list(ids[3 * B:]),
                          hashes=share.hashes, ahead_rows=None)
    writer.in_flight(job)
    [event] = writer.take_events()
    planned = plan_blocks(ids, 100, 3 * B + 39, ROOT)
    assert [(b.name, b.slot_hash, b.start, b.end) for b in event.in_flight] == \
        [(b.name, b.slot_hash, b.start, b.end) for b in planned] and event.in_flight_job == 3
    assert all(numpy.array_equal(b.tokens, ids[b.start - b.start % B:b.end]) for b in event.in_flight)
    writer.apply([event, BlockEvent(added=_indexed(ids, 0, 100))])
    nxt = SimpleNamespace(**{SHARE_ATTR: RequestShare(ROOT)}, full_untruncated_fill_ids=list(ids) + [1, 2],
                          origin_input_ids=list(ids) + [1, 2], output_ids=[], sampling_params=SimpleNamespace(
                              max_new_tokens=4), rid="next", lora_id=None, input_embeds=None,
                          positional_embed_overrides=None, multimodal_inputs=None, session=None)
    assert writer.limit(nxt, len(ids) + 1) == 3 * B + 39
    out, why = writer.share_of(nxt, 3 * B + 39, 3 * B + 45)
    assert why is None and out["after"] == [3] and set(out["sizes"]) == {_indexed(ids, 0, 100)[0].name}
    writer.index._remove(event.in_flight[-1].name)  # evicted (capacity) while its job is queued: still waited for
    assert writer.share_of(nxt, 3 * B + 39, 3 * B + 45)[0]["after"] == [3]
    writer.admitted(nxt)
    assert writer.in_flight_counts == {"jobs": 1, "reused": 1}  # its job queued; a capture admitted reusing them
    writer.settled(job)  # done without its blocks' event (its supervisor died): forgotten on every rank
    writer.apply(writer.take_events())
    assert writer.limit(nxt, len(ids) + 1) == 100
    writer.settled(job)
    assert writer.take_events() == []  # once


def test_the_index_forgets_its_least_recently_used_blocks_beyond_its_capacity():
    index = BlockIndex(capacity_tokens=2 * B)
    a, b = _ids(B + 1, 1), _ids(B + 1, 2)
    index.add(_indexed(a, 0, B))
    index.add(_indexed(b, 0, B))
    assert index.cover(a, B, [ROOT]).reach == B  # a is now the most recently used
    index.add(_indexed(_ids(B + 1, 3), 0, B))
    assert len(index) == 2 and index.cover(a, B, [ROOT]).reach == B and index.cover(b, B, [ROOT]).reach == 0


def _cover_by_scan(blocks, tokens, limit):
    """What the index's cover must find, by comparing every block of a slot (as it did before)."""
    from sglang_capture.core.blocks import slot_hash

    by_slot = {}
    for b in blocks:
        by_slot.setdefault(b.slot_hash, []).append(b)
    at, h, slot, limit = 0, ROOT, 0, min(limit, len(tokens))
    while at < limit:
        best, reach = None, at
        for b in by_slot.get(h, ()):
            if b.start <= at < b.end:
                n = min(b.end, limit) - slot
                eq = b.tokens[:n] == tokens[slot:slot + n]
                agree = slot + (n if eq.all() else int(eq.argmin()))
                if agree > reach:
                    best, reach = b, agree
        if best is None:
            break
        at = reach
        if at == slot + B:
            h, slot = slot_hash(h, tokens[slot:at]), at
    return at


def test_the_index_finds_what_comparing_every_block_finds():
    """Conversations forking from each other at random points, stored in random pieces: for every
    sequence and limit, the sorted slots find the same coverage as a scan of every block."""
    rng = numpy.random.default_rng(7)
    seqs = [_ids(3 * B, seed=100)]
    for k in range(40):
        parent = seqs[rng.integers(len(seqs))]
        cut = int(rng.integers(0, len(parent)))
        seqs.append(numpy.concatenate([parent[:cut], rng.integers(0, 4, 3 * B - cut)]))  # few token values: long agreements
    index, stored = BlockIndex(), []
    for ids in seqs[1:]:
        start = int(rng.integers(0, 2 * B))
        blocks = _indexed(ids, start, int(rng.integers(start + 1, 3 * B)))
        index.add(blocks)
        stored += blocks
    for ids in seqs:
        for limit in (len(ids), int(rng.integers(1, len(ids)))):
            assert index.cover(ids, limit, [ROOT]).reach == _cover_by_scan(stored, ids, limit)


def test_a_prefix_match_compares_only_the_blocks_beside_its_tokens(monkeypatch):
    """Every distinct prompt stores a block of its first slot under the same (root) hash; behind a
    shared system prompt each of those begins where the prompt ends, and agrees with every request
    past the slot's first position. A match must compare a request with a few of them, not each
    (a fifth of the scheduler thread after a few thousand prompts, on the CPU test bed)."""
    from sglang_capture.server import block_index

    system = _ids(120, seed=7)
    index = BlockIndex()
    index.add(_indexed(numpy.concatenate([system, _ids(B, seed=8)]), 0, 120))  # the system prompt's rows, once
    prompts = [_ids(B + 10, seed=s) for s in range(2000)]
    for ids in prompts[:1000]:
        index.add(_indexed(ids, 0, B + 10))  # prompts of their own, from their first row
    for ids in prompts[1000:]:
        ids[:120] = system
        index.add(_indexed(ids, 120, B + 10))  # behind the system prompt: from its end
    compared = []
    real = block_index._common
    monkeypatch.setattr(block_index, "_common", lambda a, b: compared.append(1) or real(a, b))
    assert index.cover(prompts[123], B + 10, [ROOT]).reach == B + 10
    assert index.cover(prompts[1234], B + 10, [ROOT]).reach == B + 10
    fresh = numpy.concatenate([system, _ids(B, seed=99999) + 1000])  # the system prompt, then tokens no prompt has
    assert index.cover(fresh, B + 10, [ROOT]).reach == 120
    assert index.cover(_ids(B + 10, seed=99999) + 1000, B + 10, [ROOT]).reach == 0
    assert len(compared) <= 16


@pytest.mark.parametrize("kept", [256, 2])
def test_a_requests_cached_match_is_what_a_scan_of_the_stored_blocks_finds(monkeypatch, kept):
    """SGLang asks a waiting request's prefix limit at every scheduling pass, and blocks are added all
    the time under load: a request's last match is reused unless a block agreeing with it past its reach
    landed where it stopped, or one it references went (or came back with another size). Against a
    scan of every stored block after each change (adds where matches stop and elsewhere, drops, the
    capacity's evictions, with few token values: long agreements, many equal keys), and with a short
    memory of a slot's additions (``kept``)."""
    from sglang_capture.server import block_index
    from sglang_capture.server.shared_rows import RequestShare

    monkeypatch.setattr(block_index, "ADDED_KEPT", kept)
    rng = numpy.random.default_rng(3)
    seqs = [_ids(3 * B, seed=200) % 4]
    for k in range(24):
        parent = seqs[rng.integers(len(seqs))]
        cut = int(rng.integers(0, len(parent)))
        seqs.append(numpy.concatenate([parent[:cut], rng.integers(0, 4, 3 * B - cut)]))
    index = BlockIndex(capacity_tokens=12 * B)
    shares = [RequestShare(ROOT) for _ in seqs]
    matched = []
    real = index.cover
    monkeypatch.setattr(index, "cover", lambda *a: matched.append(1) or real(*a))
    asked = 0
    for step in range(80):
        ids = seqs[rng.integers(len(seqs))]
        start = int(rng.integers(0, 3 * B - 1))
        blocks = _indexed(ids, start, int(rng.integers(start + 1, 3 * B)))
        if step % 4 == 3:  # a writer found a stored block gone; now and then it comes back with another size
            gone = list(index._blocks.values())[int(rng.integers(len(index)))]
            index.drop([gone.name])
            if step % 8 == 7:
                index.add([IndexedBlock(gone.name, gone.slot_hash, gone.start, gone.end, gone.tokens, gone.size + 1)])
        index.add(blocks)
        stored = list(index._blocks.values())
        for ids, share in zip(seqs, shares):
            limit = len(ids) - int(rng.integers(0, 2)) * int(rng.integers(1, B))
            reach = share.cap(index, ids, limit)
            asked += 1
            assert reach == _cover_by_scan(stored, ids, limit)
            sizes = {b.name: b.size for b in stored}
            assert all(sizes[r.name] == size for r, size in zip(share.coverage.refs, share.coverage.sizes))
    assert 0 < len(matched) < asked  # some asks reused the last match

    index, share = BlockIndex(), RequestShare(ROOT)
    mine = _ids(2 * B, seed=1)
    index.add(_indexed(mine, 0, B + 5))
    assert share.cap(index, mine, len(mine)) == B + 5
    matched.clear()
    monkeypatch.setattr(index, "cover", lambda *a: matched.append(1) or BlockIndex.cover(index, *a))
    index.add(_indexed(_ids(2 * B, seed=2) + 1000, 0, 2 * B - 1))  # another conversation: other slots
    fork = mine.copy()
    fork[B + 5] += 1
    index.add(_indexed(fork, B, 2 * B - 1))  # where my match stopped, agreeing with me only up to my reach
    assert share.cap(index, mine, len(mine)) == B + 5 and matched == []
    index.add(_indexed(mine, B + 5, 2 * B - 1))  # where my match stopped, agreeing past it
    assert share.cap(index, mine, len(mine)) == 2 * B - 1 and len(matched) == 1


def test_a_cached_match_changes_exactly_when_what_it_found_changes(monkeypatch):
    """Each way a request's reused match can go stale, one at a time: a block agreeing one token past its
    reach where it stopped, a block there whose rows begin one past its reach (unusable: a row between is
    missing), a block it references dropped, or back with another size, and an agreeing block that the
    slot's memory of its additions lost."""
    from sglang_capture.server import block_index
    from sglang_capture.server.shared_rows import RequestShare

    mine = _ids(2 * B, seed=1)
    index, share = BlockIndex(), RequestShare(ROOT)
    index.add(_indexed(mine, 0, B + 5))
    assert share.cap(index, mine, len(mine)) == B + 5

    index.add(_indexed(mine, B + 6, 2 * B - 1))  # begins one row past my reach: row B+5 is stored nowhere
    assert share.cap(index, mine, len(mine)) == B + 5
    one_more = mine.copy()
    one_more[B + 6] += 1  # agrees with me through row B+5, not B+6: its rows reach the block above
    index.add(_indexed(one_more, B, B + 10))
    assert share.cap(index, mine, len(mine)) == 2 * B - 1

    for reach in (B + 6, B + 5, B):  # the block the match ends with dropped, one after another
        index.drop([share.coverage.refs[-1].name])
        assert share.cap(index, mine, len(mine)) == reach
    resized = [IndexedBlock(b.name, b.slot_hash, b.start, b.end, b.tokens, 101) for b in _indexed(mine, B, B + 5)]
    index.add(resized)
    assert share.cap(index, mine, len(mine)) == B + 5 and share.coverage.sizes[-1] == 101
    index.drop([resized[0].name])
    index.add(_indexed(mine, B, B + 5))  # back under its name with its first size, before the next ask
    assert share.cap(index, mine, len(mine)) == B + 5 and share.coverage.sizes[-1] == 100

    monkeypatch.setattr(block_index, "ADDED_KEPT", 2)
    index, share = BlockIndex(), RequestShare(ROOT)
    index.add(_indexed(mine, 0, B + 5))
    assert share.cap(index, mine, len(mine)) == B + 5
    index.add(_indexed(mine, B + 5, B + 9))  # agrees past my reach where I stopped...
    slot_1 = _indexed(mine, B, B + 1)[0].slot_hash
    other = _ids(2 * B, seed=5) + 1000
    for k in range(2):  # ...then the slot's memory of its additions (two) holds only others' blocks
        index.add([IndexedBlock(f"{k:032x}", slot_1, B, B + 1, other[B + k:B + k + 1], 1)])
    assert share.cap(index, mine, len(mine)) == B + 9


def test_an_indexed_block_holds_the_tokens_of_its_slot_up_to_its_end():
    with pytest.raises(ValueError, match="slot tokens"):
        IndexedBlock("ab" * 16, ROOT, 10, 20, numpy.zeros(5, numpy.int64), 1)


# --- writer, reader -----------------------------------------------------------------------------------

H = 2  # hidden size of the jobs below: aux [N, 2], last [N, 2]


def _job(tmp_path, ids_in, ids_out, rows, start, refs=(), name="req", sizes=None, computed=None, tail=False):
    """A job whose rows from ``computed`` on (``start``: the first not in ``refs``) are ``rows``'
    (``tail``: its answer's last token's row too, for its blocks only: server/answer_tail.py)."""
    from sglang_capture.server.request_capture import RequestCapture
    from sglang_capture.server.writer_pool import CaptureJob

    ledger = HostMemoryLedger(1 << 30)
    cap = RequestCapture(rid=name, name=name, ledger=ledger)
    n_rows = len(ids_in) + len(ids_out) - 1
    computed = start if computed is None else computed
    cap.add(computed, rows[computed:n_rows + tail])
    meta = {"rid": name, "layers": [1], "layer_convention": "c", "hidden_size": H, "model": "m", "final": "post-norm",
            "sglang_version": "0.5.17", "schema": "sglang_capture/v1", "dtype": "float32",
            "num_prompt_tokens": len(ids_in), "num_output_tokens": len(ids_out)}
    share = {"root": ROOT.hex(), "start": start, "computed": computed, "refs": [r.as_list() for r in refs],
             "sizes": sizes or {}}
    if tail:
        share["blocks_end"] = n_rows + 1
    return CaptureJob(cap, n_rows, {"aux_hidden_states": (0, H), "last_hidden_states": (H, 2 * H)},
                      list(map(int, ids_in)), list(map(int, ids_out)), meta, share=share)


class _Server:
    """A writer pool as a scheduler runs it, its index fed by what the writers store."""

    def __init__(self, capture_dir):
        from sglang_capture.server.shared_rows import SharedRows
        from sglang_capture.server.writer_pool import WriterPool

        self.shared = SharedRows()
        self.shared.configure({"model": "m"})
        self.shared.apply(self.shared.take_events())
        self.pool = WriterPool(CaptureConfig(capture_dir=str(capture_dir), writers=1), HostMemoryLedger(1 << 30))
        self.pool.blocks_outcome = self.shared.stored

    def write(self, job):
        from tests.jobs import write_and_wait

        outcome = write_and_wait(self.pool, job)
        self.shared.apply(self.shared.take_events())
        return outcome


def _rows(n):
    return torch.arange(n * 2 * H, dtype=torch.float32).view(n, 2 * H)


def test_an_answers_last_row_goes_into_its_blocks_for_the_next_turn_and_not_into_its_file(tmp_path):
    """The row SGLang's overlap step computed after the answer ended (server/answer_tail.py): the
    job stores it in its blocks, its file keeps one row fewer than its tokens (references cut there),
    the index covers every token, so the next turn's hit reaches it, and that turn reads it exact."""
    server = _Server(tmp_path)
    turn1_in, out1 = _ids(300), [7, 8, 9]
    rows = _rows(600)
    o1 = server.write(_job(tmp_path, turn1_in, out1, rows, 0, name="t1", tail=True))
    assert o1["status"] == "ok" and o1["rows_stored"] == 302 and o1["rows_shared"] == 0 and o1["rows_for_next_turn"] == 1
    meta, _ = load_records(os.path.join(tmp_path, "t1.capture.msgpack"))
    assert meta["blocks"][-1][3] == 302  # its references end at its own last row
    turn2_in = numpy.concatenate([turn1_in, out1, _ids(40, 5)])
    cov = server.shared.index.cover(turn2_in, len(turn2_in) - 1, [ROOT])
    assert cov.reach == 303  # every token of turn 1, its answer's last too
    o2 = server.write(_job(tmp_path, turn2_in, [1, 2], rows, 303, cov.refs, "t2",
                           dict(zip([r.name for r in cov.refs], cov.sizes)), tail=True))
    assert o2["status"] == "ok" and o2["rows_shared"] == 303 and o2["rows_stored"] == 41 and o2["rows_for_next_turn"] == 1
    server.pool.close()
    for name, n in (("t1", 302), ("t2", 344)):
        d = load(os.path.join(tmp_path, f"{name}.capture.msgpack"))
        assert torch.equal(d["aux_hidden_states"], rows[:n, :H]) and torch.equal(d["last_hidden_states"], rows[:n, H:])
    stats = read_stats(str(tmp_path), settled=True)
    assert stats["rows_stored"] == 343 and stats["rows_for_next_turn"] == 2


def test_a_conversation_stores_each_row_once_and_every_turn_reads_whole(tmp_path):
    server = _Server(tmp_path)
    turn1_in, out1 = _ids(300), [7, 8, 9]
    rows = _rows(600)
    o1 = server.write(_job(tmp_path, turn1_in, out1, rows, 0, name="t1"))
    assert o1["status"] == "ok" and o1["rows_stored"] == 302 and o1["rows_shared"] == 0 and o1["block_bytes"] > 0
    turn2_in = numpy.concatenate([turn1_in, out1, _ids(40, 5)])
    cov = server.shared.index.cover(turn2_in, len(turn2_in) - 1, [ROOT])
    assert cov.reach == 302
    o2 = server.write(_job(tmp_path, turn2_in, [1, 2], rows, 302, cov.refs, "t2",
                           dict(zip([r.name for r in cov.refs], cov.sizes))))
    assert o2["status"] == "ok" and o2["rows_stored"] == 42 and o2["rows_shared"] == 302
    server.pool.close()
    for name, n in (("t1", 302), ("t2", 344)):
        d = load(os.path.join(tmp_path, f"{name}.capture.msgpack"))
        assert d["schema"] == SCHEMA_REFS and d["final"] == "post-norm"
        assert torch.equal(d["aux_hidden_states"], rows[:n, :H]) and torch.equal(d["last_hidden_states"], rows[:n, H:])
    # a second server on the same directory (or a restart) computing turn 1 again stores nothing new
    again = _Server(tmp_path)
    o3 = again.write(_job(tmp_path, turn1_in, out1, rows, 0, name="t1-again"))
    assert o3["status"] == "ok" and o3["block_bytes"] == 0 and o3["rows_stored"] == 0
    again.pool.close()
    assert torch.equal(load(os.path.join(tmp_path, "t1-again.capture.msgpack"))["aux_hidden_states"], rows[:302, :H])


def test_a_finished_request_references_the_stored_rows_it_computed_again_unless_they_are_a_header(tmp_path):
    from types import SimpleNamespace

    from sglang_capture.server.shared_rows import MIN_REUSE_ROWS, SHARE_ATTR, RequestShare

    server = _Server(tmp_path)
    turn1_in, out1 = _ids(300), [7, 8, 9]
    server.write(_job(tmp_path, turn1_in, out1, _rows(600), 0, name="t1"))
    server.pool.close()
    tokens = numpy.concatenate([turn1_in, out1, _ids(40, 5)])
    share = RequestShare(ROOT)
    req = SimpleNamespace(**{SHARE_ATTR: share})
    assert share.cap(server.shared.index, tokens, len(tokens) - 1) == 302
    covered = lambda out: [tuple(r[1:]) for r in out["refs"]]
    evicted, why = server.shared.share_of(req, 0, 344)  # the radix cache had let the history go: computed again
    assert why is None and (evicted["computed"], evicted["start"]) == (0, 302)
    assert covered(evicted) == [(0, 0, B), (B, B, 302)] and set(evicted["sizes"]) == {r[0] for r in evicted["refs"]}
    hit, _ = server.shared.share_of(req, 302, 344)  # the radix cache held it: nothing computed again
    assert (hit["computed"], hit["start"]) == (302, 302) and hit["refs"] == evicted["refs"]
    near = 302 - MIN_REUSE_ROWS + 1  # fewer rows than a radix hit would be taken for: computed and stored again
    header, _ = server.shared.share_of(req, near, 344)
    assert (header["computed"], header["start"]) == (near, near) and covered(header) == [(0, 0, B), (B, B, near)]
    short, _ = server.shared.share_of(req, 0, 100)  # never past the request's own rows
    assert short["start"] == 100 and covered(short) == [(0, 0, 100)]


def test_a_prompt_is_stored_ahead_once_when_a_whole_slot_of_it_is_new_and_its_answer_may_run_long():
    """What ``store_ahead`` asks for when a capture's prefill is done, and how its file then references those blocks."""
    from types import SimpleNamespace

    from sglang_capture.server.shared_rows import AHEAD_MIN_TOKENS, SHARE_ATTR, RequestShare, SharedRows

    shared = SharedRows()

    def req(most, answered=0):
        return SimpleNamespace(**{SHARE_ATTR: RequestShare(ROOT)}, sampling_params=SimpleNamespace(max_new_tokens=most),
                               output_ids=[0] * answered)

    chat = req(64)
    ahead = shared.ahead_share(chat, 0, 600)
    assert (ahead["start"], ahead["computed"], ahead["refs"]) == (0, 0, []) and "ahead" not in ahead
    assert shared.ahead_share(chat, 0, 600) is None  # once a request
    assert shared.ahead_share(req(AHEAD_MIN_TOKENS), 0, 600) is None  # done before it could help (extract asks 1)
    assert shared.ahead_share(req(64, answered=64 - AHEAD_MIN_TOKENS), 0, 600) is None  # a retracted one's rest
    assert shared.ahead_share(req(None), 0, 600) is not None
    assert shared.ahead_share(req(64), 0, B + 100)["start"] == 0
    hit = req(64)  # its radix hit took its first 100 rows, stored: less than a whole slot of its prompt is new
    getattr(hit, SHARE_ATTR).coverage = Coverage(100, (BlockRef("c" * 32, 0, 0, 100),), (5,))
    assert shared.ahead_share(hit, 100, B + 100) is None
    longer = req(64)
    getattr(longer, SHARE_ATTR).coverage = Coverage(100, (BlockRef("c" * 32, 0, 0, 100),), (5,))
    ahead = shared.ahead_share(longer, 100, 3 * B + 100)
    assert (ahead["start"], ahead["computed"], ahead["refs"]) == (100, 100, [["c" * 32, 0, 0, 100]])
    # the blocks stored ahead, as the writer link's pump records them: the file references them
    getattr(chat, SHARE_ATTR).ahead = ([["a" * 32, "00", 0, B, 10], ["b" * 32, "00", B, 2 * B, 11]], [2 * B, 21])
    out, why = shared.share_of(chat, 0, 700)
    assert why is None and (out["computed"], out["start"], out["ahead"]) == (0, 2 * B, [2 * B, 21])
    assert out["refs"] == [["a" * 32, 0, 0, B], ["b" * 32, B, B, 2 * B]] and out["sizes"] == {"a" * 32: 10, "b" * 32: 11}
    other = req(64)  # blocks that do not begin where its file's own rows do are not taken (its writer finds them)
    getattr(other, SHARE_ATTR).ahead = ([["a" * 32, "00", B, 2 * B, 10]], [B, 10])
    out, _ = shared.share_of(other, 0, 700)
    assert out["start"] == 0 and out["refs"] == [] and "ahead" not in out
    out, _ = shared.share_of(chat, 0, 2 * B - 1)  # nor blocks past the file's rows
    assert out["start"] == 0 and out["refs"] == [] and "ahead" not in out


def _hold_req(rid, ids, most=64):
    """A stand-in for SGLang's Req as the admission seams read it (each rank has its own)."""
    from types import SimpleNamespace

    from sglang_capture.server.shared_rows import SHARE_ATTR, RequestShare

    return SimpleNamespace(**{SHARE_ATTR: RequestShare(ROOT)}, rid=rid, sampling_params=SimpleNamespace(
        max_new_tokens=most), output_ids=[], origin_input_ids=list(ids), full_untruncated_fill_ids=list(ids),
        finished=lambda: False, is_retracted=False)


def test_a_capture_admitted_with_prompt_slots_to_store_ahead_holds_those_sharing_them_until_the_writer_rank_releases_it():
    """Who waits at admission (server/prompt_holds.py): a capture whose next slot an owner admitted
    before it computes; not the owner itself, not a capture whose tokens differ within that slot,
    not once the owner is released. Owners are taken at admission on every rank, and released on
    every rank only by the writer rank's event, posted once, when its job ahead is queued: after the
    event that puts the blocks that job will store in flight, which the held captures then reuse."""
    import threading
    from types import SimpleNamespace

    from sglang_capture.server.shared_rows import SHARE_ATTR, SharedRows

    writer, other = SharedRows(), SharedRows()  # the writer rank and another rank of its group
    system = list(_ids(2 * B + 50))

    def requests():  # each rank has its own Req objects for the same requests
        return (_hold_req("first", system + [1]), _hold_req("same", system + [2]), _hold_req("twin", system + [2]),
                _hold_req("near", system[:B + 10] + [7] * (B + 40)),  # shares slot 0 only
                _hold_req("differs", [5] + system[1:]),  # another token in slot 0
                _hold_req("short", system + [3], most=16))  # answers too soon to store ahead: owns nothing

    on_writer = requests()
    for rank, (first, same, twin, near, differs, short) in ((writer, on_writer), (other, requests())):
        assert not rank.held(first)
        rank.admitted(short)
        assert not rank.holds
        rank.admitted(first)
        rank.admitted(first)  # once a request
        assert rank.holds.counts["owners"] == 1
        assert rank.held(same) and rank.held(twin) and rank.held(near)
        assert not rank.held(first) and not rank.held(differs)
        assert rank.holds.counts["held"] == 3
    first, same, twin, near, differs, short = on_writer
    share = getattr(first, SHARE_ATTR)
    assert writer.take_events() == []  # its prefill runs
    # its job ahead is queued (SchedulerCapture.store_ahead): numbered, its blocks posted in flight
    job = SimpleNamespace(id=7, share={"root": ROOT.hex(), "start": 0, "computed": 0, "refs": [], "sizes": {}},
                          n_rows=2 * B, input_ids=system[:2 * B], output_ids=[], hashes=share.hashes, ahead_rows=[],
                          written=[2 * B, 9], ahead_of=share)
    share.ahead_asked, share.ahead_done = True, threading.Event()
    writer.in_flight(job)
    events = writer.take_events()
    assert [(len(e.in_flight), e.released) for e in events] == [(2, []), (0, ["first"])]  # in flight first
    assert writer.take_events() == []  # posted once, though not applied yet
    for rank in (writer, other):
        rank.apply(events)
        assert not rank.holds and not rank.holds.owners()
    assert not writer.held(same)
    cover = getattr(same, SHARE_ATTR)
    assert cover.cap(writer.index, same.full_untruncated_fill_ids, 2 * B + 50) == 2 * B  # in flight, reused
    assert writer.index.in_flight_jobs(r.name for r in cover.coverage.refs) == [7]
    # the writer link's pump: the blocks stored (with their sizes), the job settled in the same event
    writer.stored(job, [[b.name, b.slot_hash.hex(), b.start, b.end, 5] for b in events[0].in_flight], [])
    share.ahead_done.set()
    [stored] = writer.take_events()
    assert len(stored.added) == 2 and stored.settled == [7]
    writer.apply([stored])
    assert writer.index.in_flight_jobs(r.name for r in cover.coverage.refs) == []
    assert cover.cap(writer.index, same.full_untruncated_fill_ids, 2 * B + 50) == 2 * B
    assert writer.holds.counts["timed_out"] == 0


def test_an_owner_released_without_its_blocks_gives_its_slots_up_and_those_it_held_go_in_together():
    """Released without its blocks (none asked for, its capture ended first or was retracted, or it
    held others too long) an owner's slots are given up: the request admitted next does not own them
    again (which would let the held ones in one a second), and they hold nobody even where another
    owner computes them too. Its slots here begin past a stored one: the hashes there agree with the
    index's own (``BlockIndex.cover``)."""
    import time

    from sglang_capture.server.prompt_holds import HOLD_PREFILL_S, PENDING, REPOST_S
    from sglang_capture.server.shared_rows import SHARE_ATTR, SharedRows

    system = list(_ids(3 * B + 50, seed=3))
    writer = SharedRows()
    stored = [IndexedBlock("s" * 32, ROOT, 0, B, numpy.asarray(system[:B]), 5)]
    writer.apply([BlockEvent(added=stored)])  # slot 0 stored: the owner computes slots 1 and 2
    a, b, c = (_hold_req(r, system + [i]) for i, r in enumerate("abc"))
    for r in (a, b, c):
        getattr(r, SHARE_ATTR).cap(writer.index, r.full_untruncated_fill_ids, len(system))
    writer.admitted(a)
    assert writer.held(b) and writer.held(c)
    getattr(a, SHARE_ATTR).ahead_asked = True  # declined at the end of its prefill: no job ahead
    events = writer.take_events()
    assert [(e.released, e.given_up) for e in events] == [([], ["a"])]
    writer.apply(events)
    writer.admitted(b)  # the next admitted owns nothing of what was given up
    assert not writer.holds.owners() and not writer.held(c)
    # timed out: not while its prefill runs (HOLD_PREFILL_S)
    d, e, f = (_hold_req(r, [9] + system) for r in "def")
    writer.admitted(d)
    writer.admitted(e)  # its slots are d's already (admitted without a hold check): it owns them too
    writer.holds.release(["d"])  # released with its blocks stored: e still computes them, f waits for it
    assert writer.held(f)
    now = time.monotonic()
    assert writer.holds.due(lambda r: PENDING, now + HOLD_PREFILL_S - 1) == ([], [])
    assert writer.holds.due(lambda r: PENDING, now + HOLD_PREFILL_S + 1) == ([], ["e"])
    assert writer.holds.counts["timed_out"] == 1
    writer.holds.release(["e"], given_up=True)
    assert not writer.holds.owners() and not writer.held(f)
    # given up by one owner, a slot holds nobody, though another owner computes it too
    h, i, j = (_hold_req(r, [7] + system) for r in "hij")
    writer.admitted(h)
    writer.admitted(i)
    writer.holds.release(["h"], given_up=True)
    assert writer.holds.owners() and not writer.held(j)
    # an owner that ended, or was retracted, before its prefill was done holds nobody
    g = _hold_req("g", [8] + system)
    writer.admitted(g)
    g.is_retracted = True
    events = writer.take_events()
    assert events[0].given_up == ["g"]
    writer.apply(events)
    # a release lost on its way is posted again; applying one twice is harmless
    k = _hold_req("k", [6] + system)
    writer.admitted(k)
    getattr(k, SHARE_ATTR).ahead_asked = True
    state = lambda r: "none" if r is k else "pending"  # noqa: E731 - i still prefills
    assert writer.holds.due(state, now) == ([], ["k"])
    assert writer.holds.due(state, now + 1) == ([], [])
    assert writer.holds.due(state, now + REPOST_S + 1) == ([], ["k"])
    writer.holds.release(["k"], given_up=True)
    writer.holds.release(["k"], given_up=True)
    # a slot given up is owned again once its blocks are stored (and later gone)
    slot1 = getattr(a, SHARE_ATTR).through(1, a.full_untruncated_fill_ids)
    assert slot1 in writer.holds._given_up
    writer.apply([BlockEvent(added=[IndexedBlock("t" * 32, getattr(a, SHARE_ATTR).hashes[1], B, 2 * B,
                                                 numpy.asarray(system[B:2 * B]), 5)])])
    assert slot1 not in writer.holds._given_up
    off = SharedRows(may_hold=False)
    off.admitted(_hold_req("x", system))
    assert not off.holds.owners()
    from types import SimpleNamespace

    from sglang_capture.server.shared_rows import holds_off

    assert holds_off(SimpleNamespace(enable_lora=False)) is None
    for option in ("enable_hierarchical_cache", "enable_lmcache", "enable_flexkv", "radix_cache_backend",
                   "enable_priority_scheduling", "enable_lora"):
        assert holds_off(SimpleNamespace(**{option: "x"}))


@pytest.mark.parametrize("gone", [False, True])
def test_a_file_counts_the_rows_its_job_ahead_stored_as_its_own_and_never_twice(tmp_path, gone):
    """A job ahead of a file stores its prompt's whole slots (no file, no outcome record); the file's job
    then references them, and its outcome counts their rows as stored by it (its reference's
    ``rows_stored``), the stats once; where a block of them is gone by then it stores those rows again
    itself, counted once (the rows before the gone block then count as shared)."""
    from sglang_capture.server.shared_rows import RequestShare

    server = _Server(tmp_path)
    ids, out, rows = _ids(600), [7, 8], _rows(700)
    ahead = _job(tmp_path, ids[:2 * B + 1], [], rows, 0, name="prompt")  # rows [0, 2B): two whole slots
    ahead.ahead_rows, ahead.ahead_of = list(ahead.capture.chunks), RequestShare(ROOT)
    for chunk in ahead.ahead_rows:  # as store_ahead holds them
        ahead.capture.ledger.hold(chunk.rows)
    o1 = server.write(ahead)
    stored, written = ahead.ahead_of.ahead
    assert o1["status"] == "ok" and [(b[2], b[3]) for b in stored] == [(0, B), (B, 2 * B)] and written[0] == 2 * B
    assert not os.path.exists(index_path(str(tmp_path), "prompt")) and not os.listdir(os.path.join(tmp_path, ".tmp"))
    ahead.capture.release()  # the request's own hold: with the job's given back, nothing is held
    assert ahead.capture.ledger.held_bytes == 0
    if gone:
        os.unlink(os.path.join(tmp_path, BLOCKS_DIR, block_relpath(stored[1][0])))
    refs = [BlockRef(b[0], b[2], b[2], b[3]) for b in stored]
    final = _job(tmp_path, ids, out, rows, 2 * B, refs, "prompt", {b[0]: b[4] for b in stored}, computed=0)
    final.share["ahead"] = written
    o2 = server.write(final)
    n = 601
    stats = server.pool.counters()
    assert o2["status"] == "ok" and stats["ahead_jobs"] == 1
    if gone:  # its second slot stored again by the file's job; the first, stored ahead, counts as shared
        assert (o2["rows_stored"], o2["rows_shared"]) == (n - B, B)
        assert (stats["rows_stored"], stats["rows_shared"]) == (n + B, B)  # the deleted slot's rows written twice
    else:
        assert (o2["rows_stored"], o2["rows_shared"]) == (n, 0) and o2["block_bytes"] > written[1]
        assert (stats["rows_stored"], stats["rows_shared"]) == (n, 0)
    d = load(os.path.join(tmp_path, "prompt.capture.msgpack"))
    assert torch.equal(d["aux_hidden_states"], rows[:n, :H]) and torch.equal(d["last_hidden_states"], rows[:n, H:])
    server.pool.close()


@pytest.mark.parametrize("block", ["kept", "deleted"])
def test_rows_computed_again_are_read_from_their_stored_blocks_or_stored_again_where_a_block_is_gone(tmp_path, block):
    """A turn whose history left the radix cache computes it again; its file references the rows already
    stored (never a second copy of them), and stores those whose block went missing meanwhile."""
    server = _Server(tmp_path)
    turn1_in, out1 = _ids(300), [7, 8, 9]
    rows = _rows(600)
    assert server.write(_job(tmp_path, turn1_in, out1, rows, 0, name="t1"))["status"] == "ok"
    turn2_in = numpy.concatenate([turn1_in, out1, _ids(40, 5)])
    cov = server.shared.index.cover(turn2_in, len(turn2_in) - 1, [ROOT])
    assert cov.reach == 302 and [(r.first, r.last) for r in cov.refs] == [(0, B), (B, 302)]
    if block == "deleted":
        os.unlink(os.path.join(tmp_path, BLOCKS_DIR, block_relpath(cov.refs[1].name)))
    again = rows + 1000  # what computing the history again gave (here told apart from what was stored)
    o2 = server.write(_job(tmp_path, turn2_in, [1, 2], again, 302, cov.refs, "t2",
                           dict(zip([r.name for r in cov.refs], cov.sizes)), computed=0))
    assert o2["status"] == "ok"
    d = load(os.path.join(tmp_path, "t2.capture.msgpack"))
    reused = 302 if block == "kept" else B
    assert o2["rows_stored"] == 344 - reused and o2["rows_shared"] == reused
    assert "missing_blocks" not in o2 and "blocks_cut" not in o2  # the index is told; the outcome record is not
    expected = torch.cat([rows[:reused], again[reused:344]])
    assert torch.equal(d["aux_hidden_states"], expected[:, :H]) and torch.equal(d["last_hidden_states"], expected[:, H:])
    seq = numpy.concatenate([turn2_in, [1, 2]])
    now = server.shared.index.cover(seq, 344, [ROOT])
    assert now.reach == 344  # the index knows every row of the file, and has forgotten the block gone
    assert (cov.refs[1].name in {r.name for r in now.refs}) == (block == "kept")
    server.pool.close()


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_capture_whose_reused_rows_are_gone_fails_naming_them_and_the_index_forgets_them(tmp_path, damage):
    server = _Server(tmp_path)
    first, rows = _ids(100), _rows(200)
    server.write(_job(tmp_path, first, [1], rows, 0, name="a"))
    second = numpy.concatenate([first, [1], _ids(10, 3)])
    cov = server.shared.index.cover(second, len(second) - 1, [ROOT])
    path = os.path.join(tmp_path, BLOCKS_DIR, block_relpath(cov.refs[0].name))
    if damage == "deleted":
        os.unlink(path)
    else:
        os.truncate(path, os.path.getsize(path) - 10)
    outcome = server.write(_job(tmp_path, second, [2], rows, cov.reach, cov.refs, "b",
                                dict(zip([r.name for r in cov.refs], cov.sizes))))
    assert outcome["status"] == "error" and cov.refs[0].name in outcome["error"] and "retry" in outcome["error"]
    assert "gone or changed" in outcome["error"] and not os.path.exists(os.path.join(tmp_path, "b.capture.msgpack"))
    assert server.shared.index.cover(second, len(second) - 1, [ROOT]).reach == 0  # the retry computes them
    server.pool.close()


def _file_with_blocks(tmp_path):
    server = _Server(tmp_path)
    rows = _rows(600)
    assert server.write(_job(tmp_path, _ids(300), [5, 6], rows, 0, name="f"))["status"] == "ok"
    server.pool.close()
    path = os.path.join(tmp_path, "f.capture.msgpack")
    from sglang_capture.core.reader import load_records

    refs = load_records(path)[0]["blocks"]
    return path, [os.path.join(tmp_path, BLOCKS_DIR, block_relpath(r[0])) for r in refs]


def test_load_and_verify_name_a_missing_or_corrupt_block(tmp_path):
    from sglang_capture.tools.verify import verify_dir

    path, blocks = _file_with_blocks(tmp_path)
    assert verify_dir(str(tmp_path), progress=False).ok
    with open(blocks[1], "r+b") as f:  # a flipped byte inside the tensors, size unchanged
        f.seek(os.path.getsize(blocks[1]) - 20)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CaptureFileError, match="block .* is corrupt"):
        load(path)
    assert load(path, tensors=("input_ids",))["input_ids"].numel() == 300  # the ids need no block
    os.unlink(blocks[0])
    report = verify_dir(str(tmp_path), progress=False)
    assert not report.ok and len(report.problems) == 2
    assert any("is missing" in p and os.path.basename(blocks[0]).split(".")[0] in p for p in report.problems)
    assert any("is corrupt" in p for p in report.problems)


def test_a_block_holding_other_tokens_is_refused(tmp_path):
    path, blocks = _file_with_blocks(tmp_path)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    server = _Server(other_dir)  # the same rows for other tokens, under the same block names
    server.write(_job(other_dir, _ids(300, seed=9), [5, 6], _rows(600), 0, name="g"))
    server.pool.close()
    from sglang_capture.core.reader import load_records

    for mine, theirs in zip(blocks, load_records(str(other_dir / "g.capture.msgpack"))[0]["blocks"]):
        os.replace(os.path.join(other_dir, BLOCKS_DIR, block_relpath(theirs[0])), mine)
    with pytest.raises(CaptureFileError, match="not the block the file references"):
        load(path)


# --- gc and moving files ------------------------------------------------------------------------------

def test_gc_removes_only_blocks_no_file_references_once_they_are_old_enough(tmp_path):
    from sglang_capture.tools.gc import collect

    server = _Server(tmp_path)
    rows, base = _rows(600), _ids(300)
    server.write(_job(tmp_path, base, [1], rows, 0, name="a"))
    turn = numpy.concatenate([base, [1], _ids(30, 4)])
    cov = server.shared.index.cover(turn, len(turn) - 1, [ROOT])
    server.write(_job(tmp_path, turn, [2], rows, cov.reach, cov.refs, "b"))
    server.pool.close()
    before = collect(str(tmp_path), dry_run=True)
    assert before.files == 2 and before.blocks == 3 and before.referenced == 3 and before.removed == 0
    os.unlink(os.path.join(tmp_path, "b.capture.msgpack"))  # b's own block is referenced by no file now
    assert load(os.path.join(tmp_path, "a.capture.msgpack"))["aux_hidden_states"].shape[0] == 300
    kept = collect(str(tmp_path))  # within --min-age: kept, a server may hand it to its next capture
    assert kept.removed == 0 and kept.young == 1
    done = collect(str(tmp_path), min_age_s=0)
    assert done.removed == 1 and done.blocks == 3 and collect(str(tmp_path), dry_run=True).blocks == 2
    assert torch.equal(load(os.path.join(tmp_path, "a.capture.msgpack"))["aux_hidden_states"], rows[:300, :H])


def test_gc_keeps_a_block_touched_after_it_started_and_stops_on_an_unreadable_file(tmp_path, monkeypatch):
    from sglang_capture.tools import gc

    _file_with_blocks(tmp_path)
    os.unlink(os.path.join(tmp_path, "f.capture.msgpack"))
    real = gc._referenced

    def a_writer_touches_the_blocks_meanwhile(directory, report):
        found = real(directory, report)
        for sub in os.listdir(os.path.join(directory, BLOCKS_DIR)):
            for name in os.listdir(os.path.join(directory, BLOCKS_DIR, sub)) if len(sub) == 2 else ():
                os.utime(os.path.join(directory, BLOCKS_DIR, sub, name))
        return found

    monkeypatch.setattr(gc, "_referenced", a_writer_touches_the_blocks_meanwhile)
    assert gc.collect(str(tmp_path), min_age_s=0).removed == 0
    monkeypatch.setattr(gc, "_referenced", real)
    (tmp_path / "broken.capture.msgpack").write_bytes(b"\x00not msgpack")
    with pytest.raises(gc.GcError, match="broken.capture.msgpack.*removed nothing"):
        gc.collect(str(tmp_path), min_age_s=0)


def test_moving_a_file_brings_its_blocks_into_the_new_directory(tmp_path):
    from sglang_capture.tools.extract import move_to_sample

    path, _ = _file_with_blocks(tmp_path)
    out = tmp_path / "samples"
    out.mkdir()
    move_to_sample(path, str(out / "s.capture.msgpack"))
    assert not os.path.exists(path)
    d = load(str(out / "s.capture.msgpack"))
    assert d["aux_hidden_states"].shape == (301, H)
    from sglang_capture.tools.gc import collect

    assert collect(str(tmp_path), min_age_s=0).removed == 2  # the server's dir lets them go ...
    assert load(str(out / "s.capture.msgpack"))["last_hidden_states"].shape == (301, H)  # ... the samples keep them


def test_an_outcome_record_carries_what_sharing_saved(tmp_path):
    server = _Server(tmp_path)
    server.write(_job(tmp_path, _ids(10), [1], _rows(20), 0, name="o"))
    server.pool.close()
    outcome = json.load(open(index_path(str(tmp_path), "o")))
    assert outcome["rows_stored"] == 10 and outcome["rows_shared"] == 0 and "blocks" not in outcome


def test_a_damaged_block_is_replaced_by_the_next_capture_that_computes_its_rows(tmp_path):
    path, blocks = _file_with_blocks(tmp_path)
    os.truncate(blocks[0], os.path.getsize(blocks[0]) // 2)
    with pytest.raises(CaptureFileError, match="is corrupt"):
        load(path)
    server = _Server(tmp_path)  # the same rows computed again (a retry, another server): stored whole again
    outcome = server.write(_job(tmp_path, _ids(300), [5, 6], _rows(600), 0, name="again"))
    server.pool.close()
    assert outcome["status"] == "ok" and outcome["rows_stored"] == B and outcome["blocks_written"] == 1
    assert torch.equal(load(path)["aux_hidden_states"], _rows(600)[:301, :H])  # the first file reads again


def test_requests_whose_rows_depend_on_more_than_their_tokens_are_captured_privately_said_once(caplog):
    from types import SimpleNamespace

    from sglang_capture.server.shared_rows import SHARE_ATTR, SharedRows

    shared = SharedRows()
    assert not shared.mark(SimpleNamespace(), "model")  # before the writer rank's layout: nothing shared
    shared.configure({"model": "m"})
    shared.apply(shared.take_events())
    plain = SimpleNamespace()
    assert shared.mark(plain, "model") and getattr(plain, SHARE_ATTR).root == shared.root("model")
    assert shared.root("fp8") != shared.root("model")
    for field in ("lora_id", "input_embeds", "positional_embed_overrides", "multimodal_inputs", "session"):
        with caplog.at_level("WARNING"):
            assert not shared.mark(SimpleNamespace(**{field: object()}), "model")
            assert not shared.mark(SimpleNamespace(**{field: object()}), "model")
    said = [r.getMessage() for r in caplog.records if "prefix sharing does not cover" in r.getMessage()]
    assert len(said) == 5  # one line per reason, however many requests


def test_a_chat_is_one_session_whatever_its_turn_and_the_fraction_only_adds_sessions():
    from sglang_capture.core.selection import chat_session, session_selects

    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    later = opening + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    assert chat_session(opening) == chat_session(later) != chat_session([{"role": "user", "content": "other"}])
    sessions = [f"s{i}" for i in range(200)]
    small = {s for s in sessions if session_selects(s, 0.2)}
    large = {s for s in sessions if session_selects(s, 0.6)}
    assert small < large and 20 < len(small) < 60


def test_a_block_of_another_prefix_is_refused_even_when_its_own_tokens_agree(tmp_path):
    """Two sequences that differ before a slot and agree inside it: a file of one pointed at the other's
    block of that slot (resealed, as a forger would) is refused, not read as its rows."""
    import io

    from sglang_capture.core.format import Codec, write_capture
    from sglang_capture.core.reader import load_records

    same = _ids(60, seed=7)
    x, y = numpy.concatenate([_ids(B, seed=1), same]), numpy.concatenate([_ids(B, seed=2), same])
    server = _Server(tmp_path)
    for name, seq in (("x", x), ("y", y)):
        assert server.write(_job(tmp_path, seq, [1], _rows(400), 0, name=name))["status"] == "ok"
    server.pool.close()
    (mx, _), (my, _) = (load_records(tmp_path / f"{n}.capture.msgpack") for n in ("x", "y"))
    assert mx["blocks"][1][0] != my["blocks"][1][0]  # the slot's tokens agree, its prefix does not: another block
    meta = {k: v for k, v in my.items() if k != "seal"}
    meta["blocks"] = [my["blocks"][0], mx["blocks"][1]]
    ids = load(tmp_path / "y.capture.msgpack", tensors=("input_ids", "output_ids"))
    buf = io.BytesIO()
    write_capture(buf, meta, {k: ids[k] for k in ("input_ids", "output_ids")}, Codec(), schema=SCHEMA_REFS,
                  seal_payload=True)
    forged = tmp_path / "forged.capture.msgpack"
    forged.write_bytes(buf.getvalue())
    with pytest.raises(CaptureFileError, match="is not this file's"):
        load(forged)


def test_the_writer_rank_forgets_blocks_no_capture_used_for_a_lease_on_every_rank(tmp_path, monkeypatch):
    import time
    from types import SimpleNamespace

    from sglang_capture.core.blocks import BLOCK_LEASE_S
    from sglang_capture.server import shared_rows

    server = _Server(tmp_path)
    seq = _ids(100)
    server.write(_job(tmp_path, seq, [1], _rows(200), 0, name="a"))
    server.pool.close()
    longer = numpy.concatenate([seq, [1, 2, 3]])
    assert server.shared.index.cover(longer, len(longer) - 1, [ROOT]).reach == 100
    assert server.shared.take_events() == []  # within the lease: nothing to forget
    later = time.monotonic() + BLOCK_LEASE_S + shared_rows.LEASE_CHECK_S + 1
    monkeypatch.setattr(shared_rows, "time", SimpleNamespace(monotonic=lambda: later))
    events = server.shared.take_events()
    assert len(events) == 1 and len(events[0].dropped) == 1  # what it tells every rank of its group
    server.shared.apply(events)
    assert server.shared.index.cover(longer, len(longer) - 1, [ROOT]).reach == 0


def test_gc_refuses_a_file_whose_list_of_blocks_was_damaged(tmp_path):
    from sglang_capture.tools.gc import GcError, collect

    path, blocks = _file_with_blocks(tmp_path)
    data = bytearray(open(path, "rb").read())
    at = data.find(os.path.basename(blocks[0]).split(".")[0].encode())
    data[at] = ord("0") if data[at] != ord("0") else ord("1")  # a block name in its metadata, one hex digit off
    open(path, "wb").write(bytes(data))
    with pytest.raises(GcError, match="differs from the checksum sealed into it.*removed nothing"):
        collect(str(tmp_path), min_age_s=0)
    assert all(os.path.exists(b) for b in blocks)


def test_a_file_moved_within_its_directory_keeps_its_blocks_through_a_gc_that_missed_both_names(tmp_path, monkeypatch):
    """extract's move into the server's own directory (link, then unlink) touches the file's blocks under the gc
    lock, as a writer does: a gc that started before and listed the directory between the two names (seeing
    neither) keeps them, even at --min-age 0."""
    import time

    from sglang_capture.tools import gc
    from sglang_capture.tools.extract import move_to_sample

    path, blocks = _file_with_blocks(tmp_path)
    for b in blocks:
        os.utime(b, (1, 1))  # long unused
    start = gc._start(os.path.join(tmp_path, BLOCKS_DIR))
    time.sleep(0.02)
    move_to_sample(path, str(tmp_path / "s.capture.msgpack"))
    monkeypatch.setattr(gc, "_start", lambda blocks: start)
    monkeypatch.setattr(gc, "_referenced", lambda directory, report: set())  # neither name seen
    report = gc.collect(str(tmp_path), min_age_s=0)
    assert report.removed == 0 and report.young == len(blocks)
    assert load(str(tmp_path / "s.capture.msgpack"))["aux_hidden_states"].shape == (301, H)


def test_a_file_of_references_whose_header_passes_for_self_contained_stops_gc(tmp_path):
    """gc reads only a file's head: a v3 file whose header names another schema is corrupted, never a
    self-contained file whose blocks may go."""
    from sglang_capture.core.reader import read_meta
    from sglang_capture.tools.gc import GcError, collect

    path, blocks = _file_with_blocks(tmp_path)
    data = bytearray(open(path, "rb").read())
    at = data.find(SCHEMA_REFS.encode())  # the header's, written before the metadata's
    data[at:at + len(SCHEMA_REFS)] = b"sglang_capture/v1"
    open(path, "wb").write(bytes(data))
    with pytest.raises(CaptureFileError, match="header says sglang_capture/v1 and its metadata 'sglang_capture/v3'"):
        read_meta(path)
    with pytest.raises(GcError, match="removed nothing"):
        collect(str(tmp_path), min_age_s=0)
    assert all(os.path.exists(b) for b in blocks)


def test_a_failed_capture_does_not_renew_the_lease_of_the_blocks_it_would_have_reused(tmp_path):
    """Only a published file touched its prefix's blocks on the disk, which is what gc goes by: a failed capture
    leaves the scheduler's lease of them as it was."""
    from types import SimpleNamespace

    from sglang_capture.server.shared_rows import SharedRows

    shared = SharedRows()
    job = SimpleNamespace(id=1, share={"refs": [["prefix-block", 0, 0, 256]]}, input_ids=[1, 2], output_ids=[3])
    shared.stored(job, [], [], ok=False)
    assert "prefix-block" not in shared._used
    shared.stored(job, [], [], ok=True)
    assert "prefix-block" in shared._used


def test_gc_from_the_command_line_warns_below_the_lease_and_reports_the_disk_use(tmp_path):
    from click.testing import CliRunner

    from sglang_capture.core.blocks import BLOCK_LEASE_S
    from sglang_capture.tools.cli import cli

    _file_with_blocks(tmp_path)
    r = CliRunner().invoke(cli, ["gc", str(tmp_path), "--min-age", "0"])
    assert r.exit_code == 0, r.output
    assert f"warning: a running server may still reuse blocks unused for {BLOCK_LEASE_S:g} s" in r.output
    assert "1 capture files" in r.output and "removed 0 unreferenced blocks" in r.output
    quiet = CliRunner().invoke(cli, ["gc", str(tmp_path), "--dry-run"])
    assert quiet.exit_code == 0 and "warning" not in quiet.output
    assert "[default: 3600.0]" in CliRunner().invoke(cli, ["gc", "--help"]).output


def test_a_block_whose_tensor_header_was_damaged_is_refused_by_its_seal(tmp_path):
    """The seal covers each tensor's header too: a block whose byte-shuffle flag flipped from 4 to 0 would
    still decode, to other values, and is refused instead."""
    path, blocks = _file_with_blocks(tmp_path)
    data = bytearray(open(blocks[0], "rb").read())
    at = data.find(b"\xa7shuffle\x04", data.find(b"aux_hidden_states"))  # the key, then fixint 4: float32's bytes
    assert at > 0
    data[at + 8] = 0
    open(blocks[0], "wb").write(bytes(data))
    with pytest.raises(CaptureFileError, match="seal|checksum"):
        load(path)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_block_removed_between_its_store_and_the_touch_before_publishing_is_stored_again(tmp_path, monkeypatch, ahead):
    """A job's own block taken by ``gc`` (a short ``--min-age``) after the job stored it and before its
    touch: the rows are still in hand, so it is stored again, for a file's job and a job ahead alike."""
    from sglang_capture.server.writer_pool import job_message
    from sglang_capture.writer import blocks as writer_blocks
    from sglang_capture.writer.process import WriterProcess

    job = _job(tmp_path, _ids(600), [7, 8], _rows(700), 0, name="again")
    message = {**job_message(job, None), "ahead": ahead}
    if ahead:
        message["n_rows"] = 2 * B
    touch, removed = writer_blocks.BlockStore.touch, []

    def touch_after_gc(store, refs, sizes):
        if refs and not removed:
            removed.append(refs[0].name)
            os.unlink(os.path.join(tmp_path, BLOCKS_DIR, block_relpath(refs[0].name)))
        return touch(store, refs, sizes)

    monkeypatch.setattr(writer_blocks.BlockStore, "touch", touch_after_gc)
    read_end, write_end = os.pipe()
    try:
        result = WriterProcess(CaptureConfig(capture_dir=str(tmp_path)), None, 0).write(message, write_end)["result"]
    finally:
        os.close(read_end)
        os.close(write_end)
    assert result["status"] == "ok" and removed, result
    assert os.path.exists(os.path.join(tmp_path, BLOCKS_DIR, block_relpath(removed[0])))
    assert result["blocks_written"] == (2 if ahead else 3) and result["rows_stored"] == (2 * B if ahead else 601)
    if not ahead:
        d = load(os.path.join(tmp_path, "again.capture.msgpack"))
        assert torch.equal(d["aux_hidden_states"], _rows(700)[:601, :H])


def test_the_agreement_of_two_token_keys_is_their_first_differing_token():
    """``_common`` reads agreement off the blocks' sort keys (8 bytes a token) by comparing bytes:
    against numpy's answer for every place the first difference can be, equal lengths or not."""
    from sglang_capture.server.block_index import _common, _order_key

    rng = numpy.random.default_rng(5)
    for n in (1, 2, 7, 64, 256):
        a = rng.integers(-(1 << 40), 1 << 40, n)
        assert _common(_order_key(a), _order_key(a)) == n
        assert _common(_order_key(a), _order_key(a[:n // 2])) == n // 2  # one is the other's beginning
        for at in {0, n // 3, n - 1}:
            b = a.copy()
            b[at] += 1
            expected = int(numpy.argmin(a == b))
            assert expected == at and _common(_order_key(a), _order_key(b)) == at
            assert _common(_order_key(b[:at + 1]), _order_key(a)) == at
