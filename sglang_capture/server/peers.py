"""Every rank of a capture server must run the capture patches, whichever node it is on.

On several nodes each node is started by its own command. A node started with plain
``python -m sglang.launch_server`` beside launcher nodes runs unpatched ranks: they keep capture
requests in the shared radix cache while patched ranks give them a private namespace, so the
ranks schedule different prefill lengths for one batch and their collectives wait on each other
for ever. So at model load every patched rank says so in torch.distributed's store, and global
rank 0 waits for all of them and stops the server with one line naming those that did not.
SGLang passes a barrier after loading the weights (``dist_barrier_after_load``) before this hook,
so the ranks arrive within moments of each other: the 60 s wait is generous
(``SGLANG_CAPTURE_PEER_WAIT_S`` sets another, for tests).

DP groups on several nodes (``--nnodes 2 --dp 2 --enable-dp-attention``) write their files on
their own node, while node 0's HTTP front waits for each request's outcome record in its own
capture dir: that works only when every node has one shared capture dir, at the same path. So
then each rank also leaves a marker file in its capture dir's ``.tmp/`` and names it in the
store, and global rank 0 refuses to start unless it sees every marker at its own path.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
from typing import List

from sglang_capture.core.capture_dir import TMP_DIR
from sglang_capture.core.durable import host_tag, temp_name

logger = logging.getLogger(__name__)

_KEY = "sglang_capture/patched/{}"


class UnpatchedRanks(RuntimeError):
    """Some ranks of the server run without the capture patches."""


class CaptureDirNotShared(RuntimeError):
    """DP groups on several nodes, but the nodes do not share one capture dir."""


def needs_shared_dir(server_args) -> bool:
    """Whether DP groups live on more than one node (their files and node 0's front must meet)."""
    return int(getattr(server_args, "nnodes", 1) or 1) > 1 and int(getattr(server_args, "dp_size", 1) or 1) > 1


def announce_and_check(capture_dir: str, shared_dir: bool = False) -> None:
    """Register this rank as patched (with, when ``shared_dir``, a marker in ``capture_dir``); on
    global rank 0, wait until every rank has, and check the markers (or raise)."""
    import torch.distributed as dist

    wait_s = float(os.environ.get("SGLANG_CAPTURE_PEER_WAIT_S", "60"))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(_KEY.format(rank), json.dumps(_leave_marker(capture_dir, rank) if shared_dir else {}))
    if rank != 0:
        return
    keys = [_KEY.format(r) for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 - the store raises its own timeout types; what matters is who is missing
        missing = _missing(store, world)
        if missing:
            message = (f"sglang_capture: rank(s) {missing} of {world} run without the capture patches (a node "
                       f"started with plain sglang.launch_server?): start every node with python -m "
                       f"sglang_capture.launch and the same --capture-* options")
            logger.error(message)
            raise UnpatchedRanks(message) from None
        raise
    if shared_dir:
        _check_markers(capture_dir, [json.loads(store.get(k)) for k in keys])


def _missing(store, world: int) -> List[int]:
    return [r for r in range(world) if not store.check([_KEY.format(r)])]


def _leave_marker(capture_dir: str, rank: int) -> dict:
    """An empty file in ``.tmp/`` named like a temp file, so a start-up clean-up removes it if left."""
    name = temp_name(f"peer-rank{rank}")
    with open(os.path.join(capture_dir, TMP_DIR, name), "x"):
        pass
    return {"rank": rank, "host": host_tag(), "dir": capture_dir, "marker": name}


def _check_markers(capture_dir: str, peers: List[dict]) -> None:
    """On global rank 0: every rank's marker must be in this node's capture dir, at the same path."""
    unseen: List[dict] = []
    for peer in peers:
        path = os.path.join(capture_dir, TMP_DIR, peer["marker"])
        if peer["dir"] != capture_dir or not os.path.exists(path):
            unseen.append(peer)
    for peer in peers:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(capture_dir, TMP_DIR, peer["marker"]))
    if unseen:
        first = unseen[0]
        message = (f"sglang_capture: --dp across nodes needs one --capture-dir shared by every node at the same path: "
                   f"rank(s) {[p['rank'] for p in unseen]} wrote into {first['dir']} on host {first['host']}, which "
                   f"node 0 ({host_tag()}) does not see in {capture_dir}; mount one shared directory at the same path "
                   f"on every node")
        logger.error(message)
        raise CaptureDirNotShared(message)
