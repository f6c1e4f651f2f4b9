"""Prefix sharing in a scheduler process (``--capture-prefix-sharing on``): capture requests keep
their radix-cache hits where the rows of the hit are stored, and their files reference those rows.

What each part does:

- ``mark`` (``Req.__init__``, every rank): a capture request stays in the radix cache's shared
  namespace and carries a ``RequestShare``; a request whose rows do not follow from its token ids
  alone (input embeddings, positional overrides, images, a streaming session) is captured
  privately instead, as with sharing off, and the log says so once per reason.
- ``limit`` (SGLang's prefix limit, ``Req._compute_max_prefix_len``, every rank): the radix match
  is capped where the stored blocks this index knows of stop covering the request's tokens
  (server/block_index.py). A prefix cached by a plain request, or by a capture whose blocks are not
  stored, is therefore computed again, never referenced.
- ``share_of`` (finish, the writer rank): the job's references for the rows before the first row
  the request computed, and the layout its new blocks are keyed under.
- ``stored`` (a hand-off thread): the blocks a writer stored or found missing become a
  ``BlockEvent``; ``take_events`` (the writer rank's scheduler thread) puts the events into
  SGLang's request broadcast, and ``apply`` (every rank) applies them, so every rank of the group
  caps every request alike.

The layout root names what rows depend on besides the tokens (core/blocks.py): the model and the
identity of its weights (names, sizes and times of the checkpoint's files; the snapshot of a hub
model; for dummy weights the SGLang release), layers, final states, storage dtype, quantization,
KV-cache dtype, and the request's LoRA adapter.
"""
from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
from typing import Any, Deque, Dict, List, Optional, Tuple

from sglang_capture.core.blocks import layout_root
from sglang_capture.server.block_index import (
    NOTHING,
    BlockEvent,
    BlockIndex,
    Coverage,
    as_tokens,
    blocks_of,
)

logger = logging.getLogger(__name__)

SHARE_ATTR = "_sglang_capture_share"  # the RequestShare of a capture request whose rows are shared
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")


class RequestShare:
    """A capture request's view of the stored blocks: its layout root and the coverage of its
    latest prefix match (cached until the index or the request's limit changes)."""

    __slots__ = ("root", "coverage", "_key")

    def __init__(self, root: bytes) -> None:
        self.root = root
        self.coverage: Coverage = NOTHING
        self._key: Optional[Tuple[int, int]] = None

    def cap(self, index: BlockIndex, tokens: Any, limit: int) -> int:
        """How many of the first ``limit`` positions may come from the radix cache: those whose rows are stored."""
        key = (limit, index.version)
        if key != self._key:
            self.coverage = index.cover(as_tokens(tokens), limit, self.root)
            self._key = key
        return self.coverage.reach


def weights_identity(server_args: Any) -> Dict[str, Any]:
    """What names the weights a server loads, for the layout root: rows from other weights must
    never be reused."""
    load_format = str(getattr(server_args, "load_format", "auto"))
    if load_format == "dummy":
        from sglang_capture.patches.version_gate import installed_sglang_version

        return {"load_format": load_format, "sglang": installed_sglang_version()}
    path = str(server_args.model_path)
    revision = getattr(server_args, "revision", None)
    if not os.path.isdir(path):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, revision=revision, local_files_only=True)
        except Exception:  # noqa: BLE001 - not in the local hub cache: these rows are reused by this server only
            return {"path": path, "revision": revision, "unresolved": secrets.token_hex(8)}
    files = []
    for name in sorted(os.listdir(path)):
        if name.endswith(WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(path, name))
            files.append([name, st.st_size, st.st_mtime_ns])
    return {"path": os.path.realpath(path), "revision": revision, "load_format": load_format, "files": files}


def private_reason(req: Any) -> Optional[str]:
    """Why a capture request's rows cannot be shared: they depend on more than its token ids."""
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

    def __init__(self, layout: Dict[str, Any], is_writer: bool, capacity_tokens: Optional[int] = None) -> None:
        self.layout = layout
        self.is_writer = is_writer
        self.index = BlockIndex(capacity_tokens) if capacity_tokens else BlockIndex()
        self._roots: Dict[Tuple[str, Optional[str]], bytes] = {}
        self._events: Deque[BlockEvent] = collections.deque()
        self._told: set = set()
        self._told_lock = threading.Lock()

    def root(self, storage: str, lora: Optional[str]) -> bytes:
        """The layout root of rows stored as ``storage`` (model, fp8) under LoRA adapter ``lora``."""
        key = (storage, lora)
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = layout_root({**self.layout, "storage": storage, "lora": lora})
        return root

    def say_once(self, reason: str) -> None:
        with self._told_lock:
            if reason in self._told:
                return
            self._told.add(reason)
        logger.warning("sglang_capture: prefix sharing does not cover %s: they are captured privately (their whole "
                       "sequence computed and stored in their own file); said once", reason)

    def mark(self, req: Any, storage: str) -> bool:
        """Give a new capture request its share of the stored blocks; False when it must be private."""
        why = private_reason(req)
        if why is not None:
            self.say_once(why)
            return False
        setattr(req, SHARE_ATTR, RequestShare(self.root(storage, getattr(req, "lora_id", None))))
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
        return min(limit, share.cap(self.index, tokens, limit))

    def share_of(self, req: Any, first_row: int) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
        """The job's shared-rows part for a finished request whose rows start at ``first_row``, or
        why its rows cannot be put together (positions before ``first_row`` neither computed nor stored)."""
        share: Optional[RequestShare] = getattr(req, SHARE_ATTR, None)
        if share is None:
            return None, None
        coverage = share.coverage
        if first_row > coverage.reach:
            return None, (f"rows {coverage.reach}-{first_row - 1} were neither computed nor found stored "
                          "(the radix cache reused more than the stored blocks cover)")
        refs = coverage.upto(first_row)
        return {"root": share.root.hex(), "start": first_row, "refs": [r.as_list() for r in refs],
                "sizes": {r.name: size for r, size in zip(refs, coverage.sizes)}}, None

    def stored(self, job: Any, stored: List[list], missing: List[str]) -> None:
        """A hand-off thread: the blocks a writer stored (or found gone) for ``job``, for every rank's index."""
        if not stored and not missing:
            return
        tokens = as_tokens(list(job.input_ids) + list(job.output_ids))
        self._events.append(BlockEvent(added=blocks_of(stored, tokens), dropped=list(missing)))

    def take_events(self) -> List[BlockEvent]:
        """The writer rank's scheduler thread: the events posted since the last call."""
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def apply(self, events: List[BlockEvent]) -> None:
        for event in events:
            self.index.apply(event)
