"""Checks across the ranks of a capture server, whichever node each runs on, at model load.

1. Every rank must run the capture patches.
On several nodes each node is started by its own command. A node started with plain
``python -m sglang.launch_server`` beside launcher nodes runs unpatched ranks: they keep capture
requests in the shared radix cache while patched ranks give them a private namespace, so the
ranks schedule different prefill lengths for one batch and their collectives wait on each other
for ever. So at model load every patched rank says so in torch.distributed's store, and global
rank 0 waits for all of them and stops the server with one line naming those that did not.
SGLang passes a barrier after loading the weights (``dist_barrier_after_load``) before this hook,
so the ranks arrive within moments of each other: the 60 s wait is generous
(``SGLANG_CAPTURE_PEER_WAIT_S`` sets another, for tests).

2. With several nodes, every writer rank's files must be visible where the HTTP front answers.
Under DP across nodes a DP group on node 1 writes its requests' files and outcome records, and the
response on node 0 waits for that outcome at the path node 1 reports. So each writer rank writes
a probe file into its capture dir and publishes its absolute path; global rank 0 must see every
probe at exactly that path (a shared filesystem mounted at the same place on every node), else it
stops the server with one line.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from typing import List

from sglang_capture.publish import INDEX_DIR, host_tag

logger = logging.getLogger(__name__)

_KEY = "sglang_capture/patched/{}"


class UnpatchedRanks(RuntimeError):
    """Some ranks of the server run without the capture patches."""


class CaptureDirNotShared(RuntimeError):
    """A writer rank's capture dir is not the one the HTTP front reads."""


_NO_PROBE = "-"


def announce_and_check(capture_dir: str, is_writer: bool, several_nodes: bool) -> None:
    """Register this rank (patched; where it writes); on global rank 0, wait for every rank and check."""
    import torch.distributed as dist

    wait_s = float(os.environ.get("SGLANG_CAPTURE_PEER_WAIT_S", "60"))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(_KEY.format(rank), _write_probe(capture_dir, rank) if is_writer and several_nodes else _NO_PROBE)
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
    _check_probes(store, world)


def _write_probe(capture_dir: str, rank: int) -> str:
    path = os.path.abspath(os.path.join(capture_dir, INDEX_DIR, f"probe-{host_tag()}-{os.getpid()}.json"))
    with open(path, "w") as f:
        json.dump({"rank": rank, "host": socket.gethostname()}, f)
    return path


def _check_probes(store, world: int) -> None:
    probes = {r: store.get(_KEY.format(r)).decode() for r in range(world)}
    probes = {r: p for r, p in probes.items() if p != _NO_PROBE}
    unseen = {r: p for r, p in probes.items() if not os.path.exists(p)}
    for p in probes.values():
        if p not in unseen.values():
            try:
                os.unlink(p)
            except OSError:
                pass
    if unseen:
        message = (f"sglang_capture: writer rank(s) {sorted(unseen)} write to a capture dir this node does not see "
                   f"({sorted(unseen.values())[0]} is missing here): with --dp > 1 across nodes, give every node the "
                   f"same --capture-dir on a shared filesystem, mounted at the same path")
        logger.error(message)
        raise CaptureDirNotShared(message)


def _missing(store, world: int) -> List[int]:
    return [r for r in range(world) if not store.check([_KEY.format(r)])]
