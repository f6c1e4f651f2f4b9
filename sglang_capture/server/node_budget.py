"""The capture budget of one node, shared among the writer ranks that run on it.

``--capture-max-pending-mb`` (host memory for pending rows, pinned once at start) and
``--capture-writers`` (writer processes) describe what capture may take of a *node*. Every rank
that owns request outputs writes its own requests' files: one per node under plain TP, one per
DP group under DP attention or DP replicas. Giving each of them the whole budget would pin
64 GiB and start up to 128 writer processes for ``--dp 8`` on one host, so each writer rank
takes an equal share, at least one writer process and 1 MiB each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_capture.core.config import CaptureConfig


def writer_ranks_on_node(server_args: Any) -> int:
    """How many ranks on this node write capture files.

    One per DP group (DP attention) or DP replica, spread evenly over the nodes; without DP, only
    the node holding TP rank 0 writes. (DP attention across nodes needs one capture dir that every
    node shares, checked at model load, peers.py; DP without attention across nodes is refused.)
    """
    dp = max(1, int(getattr(server_args, "dp_size", 1) or 1))
    nodes = max(1, int(getattr(server_args, "nnodes", 1) or 1))
    return max(1, dp // nodes)


@dataclass(frozen=True)
class NodeBudget:
    """What the node may spend on capture, and this rank's share of it."""

    ranks: int
    node_pending_bytes: int
    node_writers: int

    @classmethod
    def for_server(cls, config: CaptureConfig, server_args: Any) -> NodeBudget:
        return cls(writer_ranks_on_node(server_args), config.max_pending_bytes, config.writer_processes())

    @property
    def pending_bytes(self) -> int:
        """This rank's host memory for pending rows."""
        return max(1 << 20, self.node_pending_bytes // self.ranks)

    @property
    def writers(self) -> int:
        """This rank's writer processes."""
        return max(1, self.node_writers // self.ranks)

    def describe(self) -> str:
        """The start-up log line: the node's totals and this rank's share."""
        return (f"node budget {self.node_pending_bytes >> 20} MiB of host memory and {self.node_writers} writer "
                f"processes, shared by {self.ranks} writer rank(s): {self.pending_bytes >> 20} MiB and "
                f"{self.writers} process(es) on this rank; the node holds {self.ranks * (self.pending_bytes >> 20)} MiB "
                f"and {self.ranks * self.writers} processes in all, beside one writer supervisor per rank (its hand-off "
                f"threads, little CPU)")
