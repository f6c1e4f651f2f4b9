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
"""
from __future__ import annotations

import datetime
import logging
import os
from typing import List

logger = logging.getLogger(__name__)

_KEY = "sglang_capture/patched/{}"


class UnpatchedRanks(RuntimeError):
    """Some ranks of the server run without the capture patches."""


def announce_and_check() -> None:
    """Register this rank as patched; on global rank 0, wait until every rank has (or raise)."""
    import torch.distributed as dist

    wait_s = float(os.environ.get("SGLANG_CAPTURE_PEER_WAIT_S", "60"))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(_KEY.format(rank), "1")
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


def _missing(store, world: int) -> List[int]:
    return [r for r in range(world) if not store.check([_KEY.format(r)])]
