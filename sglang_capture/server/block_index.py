"""The blocks a scheduler knows of, stored or in flight, and how much of a request's prefix they cover.

A capture request may reuse cached KV only where its rows are stored (core/blocks.py), or in flight
(below): the hook on
SGLang's prefix limit (``hooks/prefix.py``) caps each capture request's radix-cache match at the
``Coverage`` this index finds for its tokens, and its file then references those blocks instead of
computing and storing the rows again.

Every rank of a request's scheduler group must cap it alike, or their batches would differ. So this
index changes only through ``BlockEvent``s: the writer rank posts them (a block stored, a block found
missing) and they travel SGLang's own request broadcast (``hooks/prefix.py``), every rank applying
the same events at the same step, before the requests that arrived with them. The index is bounded
(``capacity_tokens``, least recently used first): a block it forgot is recomputed, and its rows
are then found already stored by the writer (the same key) and not written again.

A block may also be *in flight*: a job of the writer rank that will store it is queued, so a chat's
next turn, sent as soon as the last answer came, reuses that answer's rows before its file is
written (server/shared_rows.py). Its size is ``IN_FLIGHT`` until the job's event says it is stored;
once the job is done (``settle``), what it did not store is dropped.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy

from sglang_capture.core.blocks import BLOCK_TOKENS, BlockRef, slot_hash, slot_start

# The index keeps up to this many slot tokens (16 bytes each: the ids and their sort key; and the keys of
# each slot's latest ADDED_KEPT additions): far more than a radix cache holds, whose hits are the only ones worth covering.
CAPACITY_TOKENS = 4 << 20
ADDED_KEPT = 256  # the latest blocks added to a slot that a cached match is checked against
IN_FLIGHT = -1  # the size of a block a queued job will store (its file's size is not known yet)


def as_tokens(ids: Any) -> numpy.ndarray:
    """Token ids as int64 numpy, without a copy where SGLang keeps them in an ``array('q')``."""
    if isinstance(ids, numpy.ndarray):
        return ids.astype(numpy.int64, copy=False)
    try:
        return numpy.frombuffer(ids, dtype=numpy.int64) if getattr(ids, "typecode", None) == "q" \
            else numpy.asarray(ids, dtype=numpy.int64)
    except (TypeError, ValueError):
        return numpy.asarray(list(ids), dtype=numpy.int64)


def prompt_ids(req: Any) -> numpy.ndarray:
    """A request's prompt ids, an int64 copy of its own. SGLang (0.5.17 on) keeps them first in
    ``full_untruncated_fill_ids``, an ``array('q')`` (the ids its radix match and prefill run on), so
    this is a copy of bytes; ``origin_input_ids`` is a list of Python ints, whose conversion costs
    ~25 ns a token (~55 us a 2,000-token chat turn on the scheduler thread) and was paid again by
    each thread that read the capture's job."""
    origin = req.origin_input_ids
    n = len(origin)
    fill = getattr(req, "full_untruncated_fill_ids", None)
    # the ends checked: an abort replaces the prompt, dLLM rewrites fill ids past its prefix
    if getattr(fill, "typecode", None) == "q" and len(fill) >= n and (n == 0 or (fill[0] == origin[0] and fill[n - 1] == origin[n - 1])):
        return numpy.frombuffer(fill, dtype=numpy.int64, count=n).copy()  # the view (and its export) ends here
    return numpy.array(origin, dtype=numpy.int64)


def joined(first: Any, second: Any) -> numpy.ndarray:
    """A prompt's and an answer's ids (SGLang's ``array('q')``s, lists or numpy) as one int64 array."""
    return numpy.concatenate([as_tokens(first), as_tokens(second)])


@dataclass(frozen=True)
class IndexedBlock:
    """A block, stored or in flight: rows ``[start, end)`` under prefix ``slot_hash``, the slot's first ``end -
    slot start`` tokens (``tokens``), and its file's size (a writer checks it before referencing it;
    ``IN_FLIGHT`` while a queued job is still to store it)."""

    name: str
    slot_hash: bytes
    start: int
    end: int
    tokens: numpy.ndarray
    size: int

    def __post_init__(self) -> None:
        if len(self.tokens) != self.end - slot_start(self.start):
            raise ValueError(f"block {self.name}: {len(self.tokens)} slot tokens for rows [{self.start}, {self.end})")


@dataclass
class BlockEvent:
    """What the writer rank tells every rank of its group, through SGLang's request broadcast
    (picklable: plain values and numpy arrays): blocks stored, blocks to forget, requests that hold
    others no more, blocks in flight and jobs done, and once, first,
    the capture layout every rank names blocks by (server/shared_rows.py), or why there is none."""

    added: List[IndexedBlock] = field(default_factory=list)
    dropped: List[str] = field(default_factory=list)
    layout: Optional[Dict[str, Any]] = None
    off: Optional[str] = None
    # owners of pending prompt slots (server/prompt_holds.py), released with their blocks stored or not
    released: List[str] = field(default_factory=list)
    given_up: List[str] = field(default_factory=list)
    # the blocks the writer rank's job ``in_flight_job`` will store, queued just now; and jobs done (after
    # their ``added``), whose blocks in flight that are not stored by then are forgotten
    in_flight: List[IndexedBlock] = field(default_factory=list)
    in_flight_job: int = 0
    settled: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class Coverage:
    """How far blocks stored or in flight cover a sequence from its start: rows ``[0, reach)``, by ``refs``, and
    the size of each block referenced; ``stop``, the slot hash where no stored block agreed further
    (None when the limit ended the match), and what a block added there must begin with to change
    it (``BlockIndex.still`` says whether it holds)."""

    reach: int
    refs: Tuple[BlockRef, ...] = ()
    sizes: Tuple[int, ...] = ()
    stop: Optional[bytes] = None
    want: bytes = b""  # the sort key a block there must begin with to reach further (its slot's tokens up to reach)
    after: Tuple[int, ...] = ()  # the queued jobs storing the blocks in flight it references, when it was found

    def upto(self, n: int) -> Tuple[BlockRef, ...]:
        """The references of rows ``[0, n)`` (``n <= reach``)."""
        out = []
        for ref in self.refs:
            if ref.first >= n:
                break
            out.append(ref if ref.last <= n else BlockRef(ref.name, ref.start, ref.first, n))
        return tuple(out)


NOTHING = Coverage(0)


def _common(a: bytes, b: bytes) -> int:
    """How many leading tokens two ``_order_key``s agree on (8 bytes a token; bytes compare as memcmp,
    where a numpy comparison of a slot's tokens costs more in allocations than in work)."""
    n = min(len(a), len(b)) // 8
    if a[:8 * n] == b[:8 * n]:
        return n
    lo, hi = 0, n - 1  # the longest agreeing run of tokens has lo..hi of them
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:8 * mid] == b[:8 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _order_key(tokens: numpy.ndarray) -> bytes:
    """Bytes that sort as ``tokens`` do, element by element (a sequence before any it begins)."""
    return (tokens.astype(numpy.int64, copy=False).view(numpy.uint64) ^ numpy.uint64(1 << 63)).astype(">u8").tobytes()


class _Sorted:
    """Blocks in the order of their slot tokens (as ``_order_key`` sorts them)."""

    __slots__ = ("keys", "blocks")

    def __init__(self) -> None:
        self.keys: List[bytes] = []
        self.blocks: List[IndexedBlock] = []

    def add(self, key: bytes, block: IndexedBlock) -> None:
        i = bisect.bisect_right(self.keys, key)  # after equal keys: every rank, applying the same events, orders alike
        self.keys.insert(i, key)
        self.blocks.insert(i, block)

    def _at(self, key: bytes, block: IndexedBlock) -> int:
        i = bisect.bisect_left(self.keys, key)
        while self.blocks[i] is not block:
            i += 1
        return i

    def remove(self, key: bytes, block: IndexedBlock) -> None:
        i = self._at(key, block)
        del self.keys[i], self.blocks[i]

    def swap(self, key: bytes, old: IndexedBlock, new: IndexedBlock) -> None:
        """Put ``new`` (the same tokens) where ``old`` is."""
        self.blocks[self._at(key, old)] = new

    def best(self, query: bytes, slot: int, at: int) -> Tuple[Optional[IndexedBlock], int]:
        """Of the blocks with rows at ``at``, the one whose tokens agree with the query (the
        ``_order_key`` of the slot's tokens from ``slot``) furthest past ``at``, and how far; (None,
        at) when none does.

        Walking away from where the query would sort, agreement never grows: in each direction the
        walk ends at the first block with rows at ``at`` (none further on agrees further), or at one
        that agrees no further than the best so far."""
        i = bisect.bisect_left(self.keys, query)
        best: Optional[IndexedBlock] = None
        reach = at
        for walk in (range(i - 1, -1, -1), range(i, len(self.blocks))):
            for j in walk:
                agree = slot + _common(self.keys[j], query)
                if agree <= reach:
                    break
                block = self.blocks[j]
                if block.start <= at:  # (agree > at, so at < block.end)
                    best, reach = block, agree
                    break
        return best, reach


class _Slot:
    """The blocks (stored or in flight) under one slot hash, in the order of their slot tokens.

    Every distinct prompt stores a block of its first slot, all under the layout's root hash: a scan
    of them for every prefix match cost the scheduler thread a fifth of its time on the CPU test bed
    after a few thousand prompts. In sorted order the blocks agreeing longest with a request's tokens
    lie beside where its tokens would sort (``_Sorted.best``). A match entering the slot at its first
    position can only use blocks that begin there (``heads``): behind a shared system prompt every
    other prompt's block begins where the prompt ends, and agrees with every request past the slot's
    first position, so among all blocks the walk would pass each of them."""

    __slots__ = ("every", "heads", "grown", "added", "forgotten")

    def __init__(self) -> None:
        self.every = _Sorted()
        self.heads = _Sorted()  # the blocks whose rows begin at the slot's first position
        self.grown = 0  # the index's version when a block was last added here
        self.added: List[Tuple[int, bytes]] = []  # (version, sort key) of the latest blocks added here
        self.forgotten = 0  # the version of the latest addition no longer in ``added``

    def __len__(self) -> int:
        return len(self.every.blocks)

    def add(self, block: IndexedBlock, version: int) -> None:
        key = _order_key(block.tokens)
        self.every.add(key, block)
        if block.start == slot_start(block.start):
            self.heads.add(key, block)
        self.grown = version
        self.added.append((version, key))
        if len(self.added) > ADDED_KEPT:
            self.forgotten = self.added[-ADDED_KEPT - 1][0]
            del self.added[:-ADDED_KEPT]

    def remove(self, block: IndexedBlock) -> None:
        key = _order_key(block.tokens)
        self.every.remove(key, block)
        if block.start == slot_start(block.start):
            self.heads.remove(key, block)

    def swap(self, old: IndexedBlock, new: IndexedBlock) -> None:
        """``old``, in flight, stored as ``new`` (the same name and tokens): it stays where it is."""
        key = _order_key(old.tokens)
        self.every.swap(key, old, new)
        if old.start == slot_start(old.start):
            self.heads.swap(key, old, new)

    def grew_for(self, want: bytes, since: int) -> bool:
        """Whether a block beginning with ``want`` was added here after index version ``since``."""
        if self.grown <= since:
            return False
        if self.forgotten > since:
            return True  # not every addition since is known any more
        for version, key in reversed(self.added):
            if version <= since:
                return False
            if key.startswith(want):
                return True
        return False

    def best(self, keys: bytes, slot: int, at: int, limit: int) -> Tuple[Optional[IndexedBlock], int]:
        """The block with rows at ``at`` whose tokens agree with the request's furthest (up to ``limit``)
        past ``at``, and how far; (None, at) when none agrees past it. ``keys``: the ``_order_key`` of
        the request's tokens."""
        query = keys[8 * slot:8 * min(limit, slot + BLOCK_TOKENS)]
        return (self.heads if at == slot else self.every).best(query, slot, at)


class BlockIndex:
    """Blocks stored or in flight, by the prefix hash of their slot (see the module docstring)."""

    def __init__(self, capacity_tokens: int = CAPACITY_TOKENS) -> None:
        self.capacity_tokens = capacity_tokens
        self.version = 0  # changes with every block added or dropped
        self._dropped = 0  # the version of the latest drop
        self._blocks: "OrderedDict[str, IndexedBlock]" = OrderedDict()  # least recently used first
        self._by_slot: Dict[bytes, _Slot] = {}
        self._tokens = 0
        self._flight: Dict[str, List[int]] = {}  # blocks in flight: the queued jobs that will store each
        self._flight_jobs: Dict[int, List[str]] = {}  # and the other way round
        # a block ending its slot: the hash through it (its slot hash and all its tokens), made once for
        # every request whose match passes through it (the request's own, as every token agrees)
        self._through: Dict[str, bytes] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, event: BlockEvent) -> None:
        """Apply one event (every rank of the group applies the same ones in the same order)."""
        self.drop(event.dropped)
        self.add(event.added)
        if event.in_flight:
            self.add_in_flight(event.in_flight_job, event.in_flight)
        self.settle(event.settled)

    def add(self, blocks: Iterable[IndexedBlock]) -> None:
        """Stored blocks (one in flight until now keeps its place, with its size)."""
        for block in blocks:
            known = self._blocks.get(block.name)
            if known is not None:
                if self._flight.pop(block.name, None) is not None:
                    self._by_slot[known.slot_hash].swap(known, block)
                    self._blocks[block.name] = block
                self._blocks.move_to_end(block.name)
                continue
            self._insert(block)
        self._trim()

    def add_in_flight(self, job: int, blocks: Iterable[IndexedBlock]) -> None:
        """The blocks (of size ``IN_FLIGHT``) the queued job ``job`` will store, where not stored already."""
        names = []
        for block in blocks:
            if block.name in self._blocks:
                self._blocks.move_to_end(block.name)
                jobs = self._flight.get(block.name)
                if jobs is None:
                    continue  # stored
                jobs.append(job)
            else:
                self._insert(block)
                self._flight[block.name] = [job]
            names.append(block.name)
        if names:
            self._flight_jobs[job] = names
        self._trim()

    def settle(self, jobs: Iterable[int]) -> None:
        """These jobs are done: the blocks in flight that no queued job will store any more are gone."""
        for job in jobs:
            for name in self._flight_jobs.pop(job, ()):
                waiting = self._flight.get(name)
                if waiting is not None and job in waiting:
                    waiting.remove(job)
                    if not waiting:
                        self._remove(name)

    def in_flight_jobs(self, names: Iterable[str]) -> List[int]:
        """The queued jobs that will store any of the blocks ``names`` (those in flight)."""
        return sorted({job for name in names for job in self._flight.get(name, ())})

    def _insert(self, block: IndexedBlock) -> None:
        self._blocks[block.name] = block
        self.version += 1
        self._by_slot.setdefault(block.slot_hash, _Slot()).add(block, self.version)
        self._tokens += len(block.tokens)

    def _trim(self) -> None:
        while self._tokens > self.capacity_tokens and self._blocks:
            self._remove(next(iter(self._blocks)))

    def drop(self, names: Iterable[str]) -> None:
        """Forget stored blocks (gone from the disk, or unused for a lease); one in flight stays until
        its jobs are done (``settle``): a capture may already reuse it, and its file waits for them."""
        for name in names:
            if name in self._blocks and name not in self._flight:
                self._remove(name)

    def _remove(self, name: str) -> None:
        block = self._blocks.pop(name)
        self._flight.pop(name, None)
        self._through.pop(name, None)
        same = self._by_slot[block.slot_hash]
        same.remove(block)
        if not same:
            del self._by_slot[block.slot_hash]
        self._tokens -= len(block.tokens)
        self.version += 1
        self._dropped = self.version

    def cover(self, tokens: numpy.ndarray, limit: int, hashes: List[bytes]) -> Coverage:
        """The stored rows that ``tokens`` (the request's ids) can reuse among its first ``limit``:
        slot by slot, the block whose tokens agree with the request's the furthest past where the
        covered rows end. A block's rows are only reused where every token before them agrees.
        ``hashes``: the request's slot hashes, ``[root, h_1, ...]``, extended here as slots are passed
        (its tokens never change where they are counted, so later calls hash nothing twice)."""
        refs: List[BlockRef] = []
        sizes: List[int] = []
        after: set = set()
        if len(tokens) < (len(hashes) - 1) * BLOCK_TOKENS:  # the request's tokens shrank: hash them again
            del hashes[1:]
        at, h, slot, stop, want = 0, hashes[0], 0, None, b""
        limit = min(limit, len(tokens))
        keys = _order_key(tokens[:limit])  # once: each slot's query is a slice of it
        while at < limit:
            same = self._by_slot.get(h)
            best, reach = same.best(keys, slot, at, limit) if same is not None else (None, at)
            if best is None:
                stop, want = h, keys[8 * slot:8 * (at + 1)]
                break
            self._blocks.move_to_end(best.name)
            refs.append(BlockRef(best.name, best.start, at, reach))
            sizes.append(best.size)
            if best.size == IN_FLIGHT:
                after.update(self._flight.get(best.name, ()))
            at = reach
            if at == slot + BLOCK_TOKENS:
                if len(hashes) == at // BLOCK_TOKENS:  # not hashed yet: the block's slot tokens are the request's
                    through = self._through.get(best.name)
                    if through is None:
                        through = self._through[best.name] = slot_hash(h, best.tokens[:BLOCK_TOKENS])
                    hashes.append(through)
                h, slot = hashes[at // BLOCK_TOKENS], at
        return Coverage(at, tuple(refs), tuple(sizes), stop, want, tuple(sorted(after)))

    def still(self, coverage: Coverage, since: int) -> bool:
        """Whether ``cover`` would find ``coverage``, which held at index version ``since``, again
        (same tokens and limit): no block agreeing with its tokens past its reach was added where it
        stopped since, and every block it references is still here as it was (then they are marked
        used, as a fresh match marks them). SGLang asks a request's prefix limit at every scheduling
        pass while it waits (under its lpm policy, every waiting request's), and under load blocks are
        added all the time, nearly always where they change no waiting request's match
        (``bench/prefix_limit_cost.py``)."""
        if since != self.version:
            if coverage.stop is not None:
                slot = self._by_slot.get(coverage.stop)
                if slot is not None and slot.grew_for(coverage.want, since):
                    return False
            if self._dropped > since:  # one it references may be gone, or back under its name with another size
                for ref, size in zip(coverage.refs, coverage.sizes, strict=True):
                    block = self._blocks.get(ref.name)
                    if block is None or block.size != size:
                        return False
        for ref in coverage.refs:
            self._blocks.move_to_end(ref.name)  # used, as a fresh match would mark them
        return True


def blocks_of(stored: Sequence[Sequence[Any]], tokens: numpy.ndarray) -> List[IndexedBlock]:
    """``IndexedBlock``s of the blocks a writer reports for a capture (``[name, slot_hash hex,
    start, end, size]`` each), whose sequence has ``tokens``."""
    out = []
    for name, slot_h, start, end, size in stored:
        out.append(IndexedBlock(name, bytes.fromhex(slot_h), start, end, tokens[slot_start(start):end].copy(), size))
    return out
