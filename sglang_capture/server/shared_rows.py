"""Prefix sharing in a scheduler process (``--capture-prefix-sharing on``): capture requests keep
their radix-cache hits where the rows of the hit are stored (or in flight: a queued job stores them),
and their files reference those rows.

What each part does:

- the layout (``configure``, the writer rank at model load): what rows depend on besides their
  tokens (core/blocks.layout_root): the model and the identity of its weights (names, sizes and
  times of the checkpoint's files, and its config's digest; for dummy weights the SGLang release),
  config overrides, layers, final states, model dtype, quantization, KV-cache dtype, the layer
  convention; the storage dtype is added per request. It is the writer rank's alone and reaches
  the group's other ranks in the first block event, so every rank names blocks alike whatever its
  node's copy of the weights looks like. Weights that cannot be told apart turn sharing off, on
  every rank alike.
- ``mark`` (``Req.__init__``, every rank): a capture request stays in the radix cache's shared
  namespace and carries a ``RequestShare``; a request whose rows do not follow from its token ids
  and the layout alone (a LoRA adapter, input embeddings, positional overrides, images, a streaming
  session) is captured privately instead, as with sharing off, and the log says so once per reason.
- ``limit`` (SGLang's prefix limit, ``Req._compute_max_prefix_len``, every rank): the radix match
  is capped where the blocks this index knows of, stored or in flight, stop covering the request's
  tokens (server/block_index.py), and not taken below ``MIN_REUSE_ROWS``. A prefix cached by a plain
  request, or by a capture whose blocks are neither stored nor queued to be, is therefore computed
  again, never referenced.
- ``in_flight`` (the writer rank, as a job is queued) and ``settled`` (as it is done): the blocks a
  queued job will store count as stored, so a chat's next turn, sent the moment its last answer came,
  reuses that answer's rows before its file is written. ``share_of`` then names the jobs the file
  waits for (``after``): the writer supervisor hands it to a writer only once they are done, and a
  block one of them failed to store fails the file (``MissingBlocks``, naming it), never a wrong row.
- ``share_of`` (finish, the writer rank): the job's references for the rows before the first row
  the request computed, and for any it computed again although they are stored (its prefix left the
  radix cache), and the layout its new blocks are keyed under.
- ``held`` and ``admitted`` (SGLang's admission, every rank): a capture admitted with prompt slots
  to store ahead owns them, and a sharing capture whose next slot one owns waits in the queue until
  the writer rank releases the owner (server/prompt_holds.py).
- ``stored`` (the writer link's pump, server/writer_pool.py): the blocks a writer stored or found missing become a
  ``BlockEvent``; ``take_events`` (the writer rank's scheduler thread) puts the events into
  SGLang's request broadcast, with one dropping the blocks no capture used for ``BLOCK_LEASE_S``
  (``gc`` may take them after twice that), and ``apply`` (every rank) applies them, so every rank
  of the group caps every request alike.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

from sglang_capture.core.blocks import (
    BLOCK_LEASE_S,
    BLOCK_TOKENS,
    blocks_end,
    extend_hashes,
    layout_root,
    plan_blocks,
    slot_hash,
    slot_start,
)
from sglang_capture.server.block_index import (
    IN_FLIGHT,
    NOTHING,
    BlockEvent,
    BlockIndex,
    Coverage,
    as_tokens,
    blocks_of,
    joined,
)
from sglang_capture.server.prompt_holds import NONE, PENDING, STORED, PromptHolds

logger = logging.getLogger(__name__)

SHARE_ATTR = "_sglang_capture_share"  # the RequestShare of a capture request whose rows are shared
# Stored rows covering fewer positions than this are computed again (and stored again): a chat template's common header is
# not worth a radix hit, which on MLA models moves the whole prefill batch off SGLang's MHA path (a
# 1-token hit in every request cost a Kimi-compute server a third of its prefill rate, bench/RESULTS.md r51).
MIN_REUSE_ROWS = 32
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".py")
LEASE_CHECK_S = 60.0  # how often the writer rank looks for blocks whose lease ran out
# A capture whose answer may take more tokens than this has its prompt's blocks stored ahead of its file
# (``ahead_share``); one that answers sooner (``extract``'s prefill-only requests: 1 token) is done
# before such a job could help anyone, which would only add a second job and a second read of its rows.
AHEAD_MIN_TOKENS = 16


class RequestShare:
    """A capture request's view of the stored blocks: its layout root, its slots' prefix hashes (its
    tokens only grow), the coverage of its latest prefix match (reused for the same limit while
    ``BlockIndex.still`` says it holds) and the widest one seen, which its finish may need when a
    later match (a prefill chunk's, after the prefix was taken) found less."""

    __slots__ = ("root", "hashes", "coverage", "widest", "_limit", "_checked", "ahead_asked", "ahead", "ahead_done",
                 "admitted", "was_held")

    def __init__(self, root: bytes) -> None:
        self.root = root
        self.hashes: List[bytes] = [root]
        self.coverage: Coverage = NOTHING
        self.widest: Coverage = NOTHING
        self._limit: Optional[int] = None
        self._checked = 0  # the index version at which ``coverage`` last held
        self.ahead_asked = False  # its prefill ended: its prompt blocks were stored ahead, or need not be
        # the blocks stored ahead of its file (``[name, slot_hash hex, start, end, size]`` each, in
        # order), and the rows and bytes of them that job wrote, set by the writer link's pump
        self.ahead: Optional[Tuple[List[list], List[int]]] = None
        # the writer rank: the done event of the job storing them, once queued (not the job: it refers
        # to this share, and a cycle would outlive the request until a full collection)
        self.ahead_done: Optional[threading.Event] = None
        self.admitted = False  # taken into a prefill batch once (server/prompt_holds.py: whether it owns slots)
        self.was_held = False  # held back at least once (counted once)

    def cap(self, index: BlockIndex, tokens: Any, limit: int) -> int:
        """How many of the first ``limit`` positions may come from the radix cache: those whose rows are
        stored or in flight."""
        limit = min(limit, len(tokens))  # what the match can reach: fewer tokens than the limit end it sooner
        if limit != self._limit or not index.still(self.coverage, self._checked):
            self.coverage = index.cover(as_tokens(tokens), limit, self.hashes)
            self._limit = limit
            if self.coverage.reach >= self.widest.reach:
                self.widest = self.coverage
        self._checked = index.version
        return self.coverage.reach

    def through(self, k: int, tokens: Any) -> bytes:
        """The hash through slot ``k`` of ``tokens`` (``h_{k+1}``; they must cover the slot), kept in
        ``hashes`` as ``BlockIndex.cover`` keeps them."""
        return extend_hashes(self.hashes, tokens, k + 1)

    def covering(self, first_row: int) -> Optional[Coverage]:
        """A coverage of the rows before ``first_row``: the latest match's, else the widest seen."""
        return next((c for c in (self.coverage, self.widest) if c.reach >= first_row), None)


def _files_identity(directory: str) -> List[List[Any]]:
    """Names, sizes and modification times of a checkpoint's files, and its config's digest."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(directory, name))
            out.append([name, st.st_size, st.st_mtime_ns])
    config = os.path.join(directory, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            out.append(["config.json sha256", hashlib.sha256(f.read()).hexdigest()])
    return out


def weights_identity(server_args: Any) -> Tuple[Optional[Dict[str, Any]], str]:
    """What names the weights a server loads, for the layout root (rows from other weights must never
    be reused), and None with the reason when they cannot be told apart."""
    load_format = str(getattr(server_args, "load_format", "auto"))
    path = str(server_args.model_path)
    revision = getattr(server_args, "revision", None)
    out: Dict[str, Any] = {"load_format": load_format, "revision": revision,
                           "overrides": getattr(server_args, "json_model_override_args", None),
                           "loader": getattr(server_args, "model_loader_extra_config", None)}
    if load_format == "dummy":
        from sglang_capture.patches.version_gate import installed_sglang_version

        out["sglang"] = installed_sglang_version()  # random weights from its seed: alike while SGLang is
    if os.path.isfile(path):  # one file (GGUF)
        st = os.stat(path)
        return {**out, "path": os.path.realpath(path), "files": [[os.path.basename(path), st.st_size, st.st_mtime_ns]]}, ""
    if not os.path.isdir(path):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, revision=revision, local_files_only=True,
                                     cache_dir=getattr(server_args, "download_dir", None))
        except Exception as e:  # noqa: BLE001 - not in a local hub cache this process can read
            return None, f"its weights ({path}) are not in a local directory or hub cache to tell them apart by ({e})"
    return {**out, "path": os.path.realpath(path), "files": _files_identity(path)}, ""


# Server options under which no capture waits at admission (server/prompt_holds.py): caches that stage
# KV from outside the radix cache before admission, priority preemption (it would preempt for a
# request then held) and LoRA (SGLang counts a request passed over toward the batch's adapters).
HOLDS_OFF = (("enable_hierarchical_cache", "HiCache"), ("enable_lmcache", "LMCache"), ("enable_flexkv", "FlexKV"),
             ("radix_cache_backend", "a registered radix-cache backend"),
             ("enable_priority_scheduling", "priority scheduling"), ("enable_lora", "LoRA"))


def holds_off(server_args: Any) -> Optional[str]:
    """Why captures may not wait at admission for a prompt another capture is storing, or None."""
    return next((what for attr, what in HOLDS_OFF if getattr(server_args, attr, False)), None)


def _answers_long(req: Any) -> bool:
    """Whether ``req``'s answer may run past ``AHEAD_MIN_TOKENS``: worth storing its prompt ahead."""
    most = getattr(req.sampling_params, "max_new_tokens", None)
    return most is None or most - len(req.output_ids) > AHEAD_MIN_TOKENS


def _ahead_state(req: Any) -> str:
    """The writer rank: what became of an owner's job ahead (server/prompt_holds.py). Once it is
    queued its blocks are in flight (``in_flight``, posted before this release), reused as if stored."""
    share: Optional[RequestShare] = getattr(req, SHARE_ATTR, None)
    if share is None:  # it turned private
        return NONE
    if share.ahead_done is not None:
        return NONE if share.ahead_done.is_set() and share.ahead is None else STORED
    if share.ahead_asked or req.finished() or getattr(req, "is_retracted", False):
        return NONE  # declined, failed, or no longer prefilling
    return PENDING


def private_reason(req: Any) -> Optional[str]:
    """Why a capture request's rows cannot be shared: they depend on more than its token ids and the layout."""
    if getattr(req, "lora_id", None) is not None:
        return "requests with a LoRA adapter"
    if getattr(req, "input_embeds", None) is not None:
        return "requests with input_embeds"
    if getattr(req, "positional_embed_overrides", None) is not None:
        return "requests with positional embedding overrides"
    if getattr(req, "multimodal_inputs", None) is not None:
        return "multimodal requests (images, audio, video)"
    if getattr(req, "session", None) is not None:
        return "requests of a streaming session"
    return None


class SharedRows:
    """One scheduler process's side of prefix sharing (see the module docstring)."""

    def __init__(self, capacity_tokens: Optional[int] = None, may_hold: bool = True) -> None:
        self.index = BlockIndex(capacity_tokens) if capacity_tokens else BlockIndex()
        self.may_hold = may_hold  # see ``holds_off``
        self.layout: Optional[Dict[str, Any]] = None  # the writer rank's, from the first block event
        self.off: Optional[str] = None  # why this group shares nothing after all (every rank alike)
        self._roots: Dict[str, bytes] = {}
        self._events: Deque[BlockEvent] = collections.deque()
        self._told: set = set()
        self._lock = threading.Lock()
        self._used: Dict[str, float] = {}  # the writer rank: when a capture last stored or reused each block
        self._unsettled: set = set()  # the writer rank: jobs whose blocks were posted in flight, not done yet
        # jobs that put blocks in flight (the writer rank), and captures admitted reusing rows in flight
        self.in_flight_counts = {"jobs": 0, "reused": 0}
        self._next_lease_check = time.monotonic() + LEASE_CHECK_S
        self.holds = PromptHolds()

    def configure(self, layout: Optional[Dict[str, Any]], why_not: str = "") -> None:
        """The writer rank, at model load: its layout (None: sharing off, ``why_not``), for every rank."""
        self._events.append(BlockEvent(layout=layout, off=why_not if layout is None else None))

    def root(self, storage: str) -> bytes:
        """The layout root of rows stored as ``storage`` (model, fp8)."""
        root = self._roots.get(storage)
        if root is None:
            root = self._roots[storage] = layout_root({**self.layout, "storage": storage})
        return root

    def say_once(self, reason: str) -> None:
        with self._lock:
            if reason in self._told:
                return
            self._told.add(reason)
        logger.warning("sglang_capture: prefix sharing does not cover %s: they are captured privately (their whole "
                       "sequence computed and stored in their own file); said once", reason)

    def mark(self, req: Any, storage: str) -> bool:
        """Give a new capture request its share of the stored blocks; False when it must be private."""
        if self.layout is None:  # turned off, on every rank (the writer rank's first event says why)
            return False
        why = private_reason(req)
        if why is not None:
            self.say_once(why)
            return False
        setattr(req, SHARE_ATTR, RequestShare(self.root(storage)))
        return True

    def limit(self, req: Any, limit: int) -> Optional[int]:
        """The prefix limit of a sharing capture request (``limit`` is SGLang's own); None when the
        request turned out to need private capture (images arrive after the request is made)."""
        share = getattr(req, SHARE_ATTR)
        why = private_reason(req)
        if why is not None:
            self.say_once(why)
            delattr(req, SHARE_ATTR)
            return None
        tokens = req.full_untruncated_fill_ids
        if len(tokens) < limit:  # not refreshed yet (a waiting request ranked before its first match)
            tokens = list(req.origin_input_ids) + list(req.output_ids)
        reach = share.cap(self.index, tokens, limit)
        return min(limit, reach) if reach >= MIN_REUSE_ROWS else 0

    def share_of(self, req: Any, first_row: int, n_rows: int) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
        """The job's shared-rows part for a finished request whose computed rows start at ``first_row``
        (of ``n_rows``), or why its rows cannot be put together (positions before ``first_row`` neither
        computed nor stored). Rows it computed again although stored (the radix cache had evicted them)
        are referenced too, from ``computed`` on, where they are ``MIN_REUSE_ROWS`` or more, not stored
        twice: the writer stores them only where their block is gone by then (writer/blocks.py
        ``BlockStore.still_stored``)."""
        share: Optional[RequestShare] = getattr(req, SHARE_ATTR, None)
        if share is None:
            return None, None
        coverage = share.covering(first_row)
        if coverage is None:
            return None, (f"rows {share.widest.reach}-{first_row - 1} were neither computed nor found stored "
                          "(the radix cache reused more than the stored blocks cover)")
        start = first_row
        if coverage.reach - first_row >= MIN_REUSE_ROWS:  # not a chat template's common header in another's block
            start = min(coverage.reach, n_rows)
        refs = [r.as_list() for r in coverage.upto(start)]
        sizes = {r[0]: size for r, size in zip(refs, coverage.sizes) if size != IN_FLIGHT}
        out = {"root": share.root.hex(), "start": start, "computed": first_row, "refs": refs, "sizes": sizes}
        # the jobs storing rows in flight it reuses (when matched, or now): its job is written after them
        after = sorted(set(coverage.after).union(self.index.in_flight_jobs(r[0] for r in refs)))
        if after:
            out["after"] = after
        ahead = share.ahead
        if ahead is not None and ahead[0][0][2] == start and ahead[0][-1][3] <= n_rows:  # its prompt's, stored meanwhile
            for name, _, a, b, size in ahead[0]:
                refs.append([name, a, a, b])
                sizes[name] = size
            out.update(start=ahead[0][-1][3], ahead=ahead[1])  # the rows and bytes its own job wrote ahead
        return out, None

    def ahead_share(self, req: Any, first_row: int, prompt_rows: int) -> Optional[Dict[str, Any]]:
        """Once, when a sharing capture request's prefill is done (``prompt_rows`` rows, computed from
        ``first_row``): the share of a job storing its prompt's whole slots ahead of its file, or None
        when fewer than a slot's rows are new or its answer may take at most ``AHEAD_MIN_TOKENS``
        tokens (its file's job stores them). The request's own file
        then references these blocks (``share_of``), and requests that share its prompt reuse them
        as soon as they are indexed, not only once its answer is done."""
        share: Optional[RequestShare] = getattr(req, SHARE_ATTR, None)
        if share is None or share.ahead_asked:
            return None
        share.ahead_asked = True
        if not _answers_long(req):
            return None
        whole = slot_start(prompt_rows)
        out, why = self.share_of(req, first_row, whole)
        if out is None or why is not None or whole - out["start"] < BLOCK_TOKENS:
            return None
        return out

    def held(self, req: Any) -> bool:
        """SGLang's admission (``PrefillAdder.add_one_req``), every rank: whether the sharing capture
        ``req`` waits, because another capture now computes the slot its stored rows stop at
        (server/prompt_holds.py). Its coverage is that of the prefix match just made."""
        share: Optional[RequestShare] = getattr(req, SHARE_ATTR, None)
        if share is None or not self.holds:
            return False
        tokens = req.full_untruncated_fill_ids
        k = share.coverage.reach // BLOCK_TOKENS
        if (k + 1) * BLOCK_TOKENS > len(tokens) or not self.holds.held(req.rid, share.through(k, tokens)):
            return False
        if not share.was_held:
            share.was_held = True
            self.holds.counts["held"] += 1
        return True

    def admitted(self, req: Any) -> None:
        """After SGLang admitted ``req`` to a prefill batch, every rank: a sharing capture whose
        prompt's whole slots past its stored rows will be stored ahead of its file (``ahead_share``'s
        rules) owns them until they are (server/prompt_holds.py)."""
        share: Optional[RequestShare] = getattr(req, SHARE_ATTR, None)
        if share is None or share.admitted:
            return
        share.admitted = True
        if share.coverage.reach >= MIN_REUSE_ROWS and self.index.in_flight_jobs(r.name for r in share.coverage.refs):
            self.in_flight_counts["reused"] += 1
        if not self.may_hold or not _answers_long(req):
            return
        tokens = req.full_untruncated_fill_ids
        reach = share.coverage.reach if share.coverage.reach >= MIN_REUSE_ROWS else 0
        whole = slot_start(len(req.origin_input_ids) + len(req.output_ids))
        if whole - reach < BLOCK_TOKENS:
            return
        self.holds.own(req.rid, [share.through(k, tokens) for k in range(reach // BLOCK_TOKENS, whole // BLOCK_TOKENS)],
                       req)

    def stored(self, job: Any, stored: List[list], missing: List[str], ok: bool = True) -> None:
        """The writer link's pump (server/writer_pool.py: the scheduler thread, or the idle pump): the blocks a writer stored or reused
        for ``job`` (or found gone), for every rank's index. The lease of the blocks before the job's rows
        is renewed only when its file was published: only then were they touched on the disk, which is
        what ``gc`` goes by."""
        now = time.monotonic()
        with self._lock:
            for name in [s[0] for s in stored] + ([r[0] for r in job.share["refs"]] if ok else []):
                self._used[name] = now
            for name in missing:
                self._used.pop(name, None)
        added = blocks_of(stored, joined(job.input_ids, job.output_ids)) if stored else []
        with self._lock:  # settled once: here, or by ``settled`` if this never gets this far
            settled = [job.id] if job.id in self._unsettled else []
            if added or missing or settled:
                self._events.append(BlockEvent(added=added, dropped=list(missing), settled=settled))
            self._unsettled.discard(job.id)
        ahead_of = getattr(job, "ahead_of", None)
        if ahead_of is not None and stored:
            ahead_of.ahead = (stored, job.written or [0, 0])

    def in_flight(self, job: Any) -> None:
        """The writer rank, as ``job`` (a capture's file or its job ahead, numbered) is queued, before
        any writer can answer for it: the blocks it will store are posted to every rank as in flight,
        so that a capture admitted meanwhile reuses their rows (its file waits for this job). Called on
        the scheduler thread, which finished the request: a chat's next turn, sent once this answer is
        out, finds them. Hashes only the slots its stored rows did not reach (``job.hashes``)."""
        share, n = job.share, blocks_end(job.share, job.n_rows)
        if share is None or share["start"] >= n:
            return
        hashes = job.hashes if job.hashes is not None else [bytes.fromhex(share["root"])]
        tokens = joined(job.input_ids, job.output_ids)
        blocks = blocks_of([[b.name, b.slot_hash.hex(), b.start, b.end, IN_FLIGHT]
                            for b in plan_blocks(tokens, share["start"], n, hashes[0], hashes)], tokens)
        with self._lock:
            self._unsettled.add(job.id)
            self.in_flight_counts["jobs"] += 1
        self._events.append(BlockEvent(in_flight=blocks, in_flight_job=job.id))

    def settled(self, job: Any) -> None:
        """Any thread, once ``job`` is done without its blocks' event (its supervisor died, or it was
        never sent): its blocks in flight are forgotten on every rank."""
        with self._lock:
            if job.id not in self._unsettled:
                return
            self._unsettled.discard(job.id)
        self._events.append(BlockEvent(settled=[job.id]))

    def take_events(self) -> List[BlockEvent]:
        """The writer rank's scheduler thread: the events posted since the last call, and now and
        then one dropping the blocks whose lease ran out."""
        now = time.monotonic()
        if self.holds.owners():
            released, given_up = self.holds.due(_ahead_state, now)
            if released or given_up:  # after the blocks' own events: the held requests' matches find them
                self._events.append(BlockEvent(released=released, given_up=given_up))
        if now >= self._next_lease_check:
            self._next_lease_check = now + LEASE_CHECK_S
            with self._lock:
                expired = [name for name, at in self._used.items() if now - at > BLOCK_LEASE_S]
                for name in expired:
                    del self._used[name]
            if expired:
                self._events.append(BlockEvent(dropped=expired))
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def apply(self, events: List[BlockEvent]) -> None:
        """Every rank: the writer rank's events, in order."""
        for event in events:
            if event.layout is not None or event.off is not None:
                self.layout, self.off, self._roots = event.layout, event.off, {}
                if event.off:
                    logger.warning("sglang_capture: prefix sharing is off on this server: %s; every capture is "
                                   "private (its whole sequence computed and stored in its own file)", event.off)
            self.index.apply(event)
            if self.holds.gives_up_any():
                for block in event.added + event.in_flight:
                    if len(block.tokens) == BLOCK_TOKENS:  # the block ends its slot: the hash through it
                        self.holds.stored_slot(slot_hash(block.slot_hash, block.tokens))
            if event.released or event.given_up:
                self.holds.release(event.released)
                self.holds.release(event.given_up, given_up=True)
