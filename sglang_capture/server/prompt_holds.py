"""Sharing capture requests held back in SGLang's queue while another capture computes the prompt
they share (``--capture-prefix-sharing on``).

A sharing capture may reuse only rows stored or queued to be (server/shared_rows.py). Chats that
open together with one new system prompt would each compute it, since none of them has queued it yet:
a prompt's blocks are queued only once its prefill's result is processed (the job ahead of the file),
and with SGLang's overlap schedule two more batches form before that (bench/RESULTS.md r87).
So when a sharing capture that will store its prompt ahead (an *owner*) is admitted to a prefill
batch, the prompt slots it computes are pending. A sharing capture whose next slot is one of them
waits in the queue (``held``) until the owner is released: then its radix hit covers those slots.

Every rank of the group must admit alike, so who is pending changes only at points every rank
shares: owners are taken at admission (every rank, the same step) and released by the writer
rank's ``BlockEvent`` (``due``: after the event putting its blocks in flight). An owner is released
once its job ahead is queued; without its blocks (none was asked for, the owner ended or was
retracted first, or its prefill held others longer than ``HOLD_PREFILL_S``) its slots are *given
up*: no later capture owns them again, so the requests it held go in together and compute them, as
without holds. A hold costs the held request that wait, never a row: what it then reuses is what the
index says is stored or in flight.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

# The longest an owner holds others before its job ahead is queued: its own prefill (chunked, in a loaded
# batch) comes first; a held request then computes the prompt itself.
HOLD_PREFILL_S = 10.0
REPOST_S = 5.0  # a release not applied this long after it was posted is posted again (applying one twice is harmless)
GIVEN_UP_KEPT = 4096  # slots given up that no capture owns again (least recently given up forgotten first)

# What the writer rank's ``state_of(req)`` says of an owner: its job ahead is queued, its blocks in flight
# (STORED), no blocks will come (NONE), or they may still (PENDING: its prefill runs).
STORED, NONE, PENDING = "stored", "none", "pending"


@dataclass
class _Owner:
    hashes: List[bytes]  # the hash through each prompt slot it computes (core/blocks.slot_hash)
    since: float
    req: Any
    posted: Optional[float] = None  # the writer rank: when its release was posted to every rank


class PromptHolds:
    """Pending prompt slots and their owners, in one scheduler process (see the module docstring)."""

    def __init__(self) -> None:
        self._by_hash: Dict[bytes, List[str]] = {}
        self._owners: Dict[str, _Owner] = {}
        self._given_up: "OrderedDict[bytes, None]" = OrderedDict()
        self._posted_given_up: set = set()  # the writer rank: owners posted as given up, until released
        self.counts = {"owners": 0, "held": 0, "timed_out": 0}  # "held": requests, each counted once (SharedRows)

    def __bool__(self) -> bool:
        """Whether any slot is pending (SGLang asks ``held`` of every request it tries to admit)."""
        return bool(self._by_hash)

    def owners(self) -> bool:
        return bool(self._owners)

    def own(self, rid: str, hashes: List[bytes], req: Any) -> None:
        """Every rank, at ``req``'s admission: the prompt slots through ``hashes`` are pending,
        except those given up."""
        hashes = [h for h in hashes if h not in self._given_up]
        if not hashes:
            return
        self._owners[rid] = _Owner(hashes, time.monotonic(), req)
        for h in hashes:
            self._by_hash.setdefault(h, []).append(rid)
        self.counts["owners"] += 1

    def held(self, rid: str, through: bytes) -> bool:
        """Whether the request ``rid``, whose next slot hashes to ``through``, waits for another owner."""
        owners = self._by_hash.get(through)
        return owners is not None and any(o != rid for o in owners)

    def due(self, state_of: Callable[[Any], str], now: Optional[float] = None) -> Tuple[List[str], List[str]]:
        """The writer rank: the owners to release, as (with their blocks stored, given up)."""
        now = time.monotonic() if now is None else now
        stored: List[str] = []
        given_up: List[str] = []
        for rid, owner in self._owners.items():
            if owner.posted is not None:
                if now - owner.posted > REPOST_S:  # lost on its way: never leave those it holds waiting
                    owner.posted = now
                    (given_up if rid in self._posted_given_up else stored).append(rid)
                continue
            state = state_of(owner.req)
            if state == PENDING:
                if now - owner.since <= HOLD_PREFILL_S:
                    continue
                self.counts["timed_out"] += 1
            owner.posted = now
            if state != STORED:
                self._posted_given_up.add(rid)
            (stored if state == STORED else given_up).append(rid)
        return stored, given_up

    def release(self, rids: List[str], given_up: bool = False) -> None:
        """Every rank, applying the writer rank's event: these owners hold nobody any more; ``given_up``:
        their slots were not stored, and no later capture owns them."""
        for rid in rids:
            owner = self._owners.pop(rid, None)
            self._posted_given_up.discard(rid)
            if owner is None:
                continue
            for h in owner.hashes:
                owners = self._by_hash.get(h)
                if given_up:  # nobody holds anyone on it any more, another owner computing it neither
                    self._by_hash.pop(h, None)
                    self._given_up[h] = None
                    self._given_up.move_to_end(h)
                elif owners is not None and rid in owners:
                    owners.remove(rid)
                    if not owners:
                        del self._by_hash[h]
        while len(self._given_up) > GIVEN_UP_KEPT:
            self._given_up.popitem(last=False)

    def gives_up_any(self) -> bool:
        return bool(self._given_up)

    def stored_slot(self, through: bytes) -> None:
        """Every rank, applying a block event: the slot through ``through`` is stored after all, so a
        capture may own it again once its blocks are gone."""
        self._given_up.pop(through, None)
