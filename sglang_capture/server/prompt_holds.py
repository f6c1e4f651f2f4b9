"""Sharing capture requests held back in SGLang's queue while another capture computes the prompt
they share (``--capture-prefix-sharing on``).

A sharing capture may reuse only stored rows (server/shared_rows.py). Chats that open together with
one new system prompt would each compute it, since none of them has stored it yet, and a prompt's
blocks are stored only once its prefill is done (the job ahead of the file). With SGLang's overlap
schedule two more batches form before the first result is even processed (bench/RESULTS.md r87).
So when a sharing capture that will store its prompt ahead (an *owner*) is admitted to a prefill
batch, the prompt slots it computes are pending. A sharing capture whose next slot is one of them
waits in the queue (``held``) until the owner is released: then its radix hit covers those slots.

Every rank of the group must admit alike, so who is pending changes only at points every rank
shares: owners are taken at admission (every rank, the same step) and released by the writer
rank's ``BlockEvent.released`` (``due``: after the blocks' own event), once the owner's job ahead
is answered or was not asked for, the owner has ended, or ``HOLD_MAX_S`` has passed. A hold costs
the held request that wait, never a row: what it then reuses is what the index says is stored.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

# The longest an owner holds others: its job ahead waits behind file jobs in the writers' queue
# under load, and a held request must then compute the prompt itself rather than wait on.
HOLD_MAX_S = 1.0


@dataclass
class _Owner:
    hashes: List[bytes]  # the hash through each prompt slot it computes (core/blocks.slot_hash)
    since: float
    req: Any


class PromptHolds:
    """Pending prompt slots and their owners, in one scheduler process (see the module docstring)."""

    def __init__(self) -> None:
        self._by_hash: Dict[bytes, str] = {}
        self._owners: Dict[str, _Owner] = {}
        self.counts = {"owners": 0, "held": 0, "timed_out": 0}  # "held": requests, each counted once (SharedRows)

    def __bool__(self) -> bool:
        return bool(self._by_hash)

    def own(self, rid: str, hashes: List[bytes], req: Any) -> None:
        """Every rank, at ``req``'s admission: the prompt slots through ``hashes`` are pending."""
        self._owners[rid] = _Owner(hashes, time.monotonic(), req)
        for h in hashes:
            self._by_hash.setdefault(h, rid)
        self.counts["owners"] += 1

    def held(self, rid: str, through: bytes) -> bool:
        """Whether the request ``rid``, whose next slot hashes to ``through``, waits for another owner."""
        owner = self._by_hash.get(through)
        return owner is not None and owner != rid

    def due(self, answered: Callable[[Any], bool], now: Optional[float] = None) -> List[str]:
        """The writer rank: the owners to release, ``answered(req)`` saying whether one's job ahead
        was answered (its blocks' event is posted by then) or will not come."""
        now = time.monotonic() if now is None else now
        out = []
        for rid, owner in self._owners.items():
            if answered(owner.req) or owner.req.finished():
                out.append(rid)
            elif now - owner.since > HOLD_MAX_S:
                out.append(rid)
                self.counts["timed_out"] += 1
        return out

    def release(self, rids: List[str]) -> None:
        """Every rank, applying the writer rank's event: these owners hold nobody any more."""
        for rid in rids:
            owner = self._owners.pop(rid, None)
            if owner is None:
                continue
            for h in owner.hashes:
                if self._by_hash.get(h) == rid:
                    del self._by_hash[h]
