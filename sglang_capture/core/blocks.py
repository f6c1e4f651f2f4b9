"""Shared rows (``--capture-prefix-sharing on``): captured rows live in content-addressed blocks that
capture files reference, so a prefix many requests share is computed and stored once.

Positions are cut into *slots* of ``BLOCK_TOKENS`` tokens, ``[k*B, (k+1)*B)``. A *block* holds the
rows of one contiguous run ``[start, end)`` inside one slot, as a request computed them: a request
that reused the cached rows of its first D positions computes ``[D, N)``, which becomes a head
block ``[D, end of D's slot)``, whole slots, and a tail block. Nothing is stored twice along one
conversation: the next turn reuses the tail block and starts its own head block where it ends.

Names are content: a block's key is a hash of everything its rows depend on, so the same rows
computed twice (two DP ranks, two servers on one directory, a restart) get the same name and
are written once:

- ``layout_root(layout)``: the capture layout (model and its weights, layers, final states,
  storage dtype, this scheme's version and ``BLOCK_TOKENS``);
- ``slot_hash``: chained over whole slots, ``h_0 = root``, ``h_{k+1} = H(h_k, tokens of slot k)``,
  so ``h_k`` stands for every token before slot k (SGLang's HiCache chains its page hashes the
  same way, ``get_hash_str``; its function is not used here because the writer processes never
  import SGLang, and its chain has no layout in it);
- ``block_key``: ``H(h_k, start and end within the slot, the slot's tokens up to end)``.

H is BLAKE2b with 16-byte digests: a collision would put one prompt's rows under another's name,
so the hash resists crafted prompts, not only accidents (hashing costs microseconds per block).

On disk (``BLOCKS_DIR``) each block is a capture-format file (core/format.py) named by its key,
``.blocks/<first two hex digits>/<key>.block.msgpack``, holding the slot's tokens up to ``end``
and the rows' tensors; a capture file of schema v3 lists the blocks of its rows (``BlockRef``).
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence

import numpy

BLOCK_TOKENS = 256
SCHEME = "sglang_capture/blocks/1"
KEY_BYTES = 16
BLOCKS_DIR = ".blocks"
BLOCK_SUFFIX = ".block.msgpack"
# ``gc`` holds this file's lock exclusively while it judges blocks; a writer holds it shared while
# it touches the blocks a new capture file references and publishes that file (writer/blocks.py).
GC_LOCK = ".gc.lock"
BLOCK_KIND = "block"  # a block file's meta["kind"]
# A scheduler forgets a block no capture stored or reused for this long (server/shared_rows.py): ``gc``'s
# default --min-age is twice it, so a block it takes is one no server would hand to its next capture.
BLOCK_LEASE_S = 1800.0
# A v3 file's meta: the blocks holding its rows (``BlockRef`` lists), and which tensors they hold.
BLOCKS_KEY = "blocks"
BLOCK_TENSORS_KEY = "block_tensors"


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        h.update(p)
    return h.digest()


def token_bytes(tokens: numpy.ndarray) -> bytes:
    """Token ids as hashed: little-endian int64."""
    return numpy.ascontiguousarray(tokens, dtype="<i8").tobytes()


def slot_start(position: int) -> int:
    """The first position of the slot ``position`` lies in."""
    return position - position % BLOCK_TOKENS


def layout_root(layout: Mapping[str, Any]) -> bytes:
    """The chain's root for one capture layout (a JSON-able map; key order does not matter)."""
    doc = json.dumps({"scheme": SCHEME, "block_tokens": BLOCK_TOKENS, **layout}, sort_keys=True, separators=(",", ":"))
    return _h(doc.encode())


def slot_hash(prev: bytes, slot_tokens: numpy.ndarray) -> bytes:
    """``h_{k+1}`` from ``h_k`` and slot k's ``BLOCK_TOKENS`` tokens."""
    return _h(prev, token_bytes(slot_tokens))


def block_key(slot_h: bytes, start_in_slot: int, end_in_slot: int, slot_tokens: numpy.ndarray) -> bytes:
    """The key of the block holding rows ``[start, end)`` of a slot (offsets within it), whose
    prefix is ``slot_h`` and whose slot begins with ``slot_tokens`` (its first ``end_in_slot``)."""
    return _h(slot_h, struct.pack("<II", start_in_slot, end_in_slot), token_bytes(slot_tokens[:end_in_slot]))


def extend_hashes(hashes: List[bytes], tokens: Any, k: int) -> bytes:
    """``h_k`` of ``tokens`` (which must cover the first ``k`` slots), appending to ``hashes`` (``[root,
    h_1, ...]`` of the same tokens) the ones it lacks: a request's hashes are kept, never made twice."""
    while len(hashes) <= k:
        j = len(hashes) - 1
        hashes.append(slot_hash(hashes[j], tokens[j * BLOCK_TOKENS:(j + 1) * BLOCK_TOKENS]))
    return hashes[k]


def slot_hashes(tokens: numpy.ndarray, root: bytes, slots: int) -> List[bytes]:
    """``h_0 .. h_{slots-1}`` of ``tokens`` (which must cover the first ``slots - 1`` slots)."""
    out = [root]
    extend_hashes(out, tokens, slots - 1)
    return out


@dataclass(frozen=True)
class Block:
    """One block of a sequence: rows ``[start, end)`` (absolute positions) inside slot ``start // B``."""

    key: bytes
    slot_hash: bytes
    start: int
    end: int

    @property
    def slot_start(self) -> int:
        return slot_start(self.start)

    @property
    def name(self) -> str:
        return self.key.hex()


def plan_blocks(tokens: Any, start: int, end: int, root: bytes, hashes: Optional[List[bytes]] = None) -> List[Block]:
    """The blocks that hold rows ``[start, end)`` of the sequence ``tokens`` (its token ids, at
    least ``end`` of them): cut at slot boundaries, in position order. ``hashes``: the sequence's
    slot hashes known already (``[root, h_1, ...]``, extended here), where the caller keeps them."""
    if not 0 <= start <= end <= len(tokens):
        raise ValueError(f"rows [{start}, {end}) do not lie within {len(tokens)} tokens")
    out: List[Block] = []
    if start == end:
        return out
    hashes = [root] if hashes is None else hashes
    extend_hashes(hashes, tokens, (end - 1) // BLOCK_TOKENS)
    a = start
    while a < end:
        k = a // BLOCK_TOKENS
        s0 = k * BLOCK_TOKENS
        b = min(end, s0 + BLOCK_TOKENS)
        out.append(Block(block_key(hashes[k], a - s0, b - s0, tokens[s0:b]), hashes[k], a, b))
        a = b
    return out


def block_relpath(name: str) -> str:
    """A block's path under ``BLOCKS_DIR``: two hex digits of fan-out keep directories small."""
    return f"{name[:2]}/{name}{BLOCK_SUFFIX}"


def is_key(name: str) -> bool:
    """Whether ``name`` is a block key in hex."""
    return len(name) == 2 * KEY_BYTES and all(c in "0123456789abcdef" for c in name)


def is_block_name(name: str) -> bool:
    """Whether a file name under a fan-out directory is a block's (``<32 hex><BLOCK_SUFFIX>``)."""
    return name.endswith(BLOCK_SUFFIX) and is_key(name[:-len(BLOCK_SUFFIX)])


@dataclass(frozen=True)
class BlockRef:
    """A capture file's reference to rows ``[first, last)`` (absolute positions) of the block
    ``name`` that starts at ``start``. Any block of that name will do: blocks are sealed with the
    checksum of their own content (core/format.SEAL), not named by it, since two
    servers that compute the same rows store them within rounding of each other."""

    name: str
    start: int
    first: int
    last: int

    def as_list(self) -> List[Any]:
        return [self.name, self.start, self.first, self.last]

    @classmethod
    def from_list(cls, value: Any) -> BlockRef:
        """A reference as a file stores it (raises ValueError for anything else)."""
        if not isinstance(value, (list, tuple)) or len(value) != 4:
            raise ValueError(f"a block reference is [name, start, first, last], got {value!r:.80}")
        name, start, first, last = value
        if not (isinstance(name, str) and is_key(name)):
            raise ValueError(f"a block reference names no block: {name!r:.80}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, first, last)) \
                or not 0 <= start <= first < last or last - slot_start(start) > BLOCK_TOKENS:
            raise ValueError(f"block reference {name} has invalid rows {start}, {first}, {last}")
        return cls(name, start, first, last)


def blocks_end(share: Optional[Mapping[str, Any]], n_rows: int) -> int:
    """The row a capture job's blocks end at: its file's ``n_rows``, or one more where they also hold
    its answer's last token's row (``share["blocks_end"]``, server/answer_tail.py)."""
    return share.get("blocks_end", n_rows) if share else n_rows


def refs_upto(refs: Sequence[BlockRef], end: int) -> List[BlockRef]:
    """``refs`` (in row order) cut at row ``end``: a capture's blocks may hold one row past its file's,
    its answer's last token's (server/answer_tail.py), which only the chat's next turn references."""
    out = []
    for ref in refs:
        if ref.first >= end:
            break
        out.append(ref if ref.last <= end else BlockRef(ref.name, ref.start, ref.first, end))
    return out


def check_coverage(refs: Sequence[BlockRef], n_rows: int) -> Optional[str]:
    """Why ``refs`` do not cover rows ``[0, n_rows)`` exactly once in order, or None."""
    at = 0
    for ref in refs:
        if ref.first != at:
            return f"block {ref.name} holds rows from {ref.first}, but row {at} comes next"
        at = ref.last
    if at != n_rows:
        return f"the blocks hold {at} rows, the file has {n_rows}"
    return None
