"""The node's capture budget (pinned host memory, writer processes) is shared by its writer ranks."""
from __future__ import annotations

import types

import pytest

from sglang_capture.core.config import CaptureConfig
from sglang_capture.server.node_budget import NodeBudget, writer_ranks_on_node


def _args(dp=1, nnodes=1, dp_attention=False):
    return types.SimpleNamespace(dp_size=dp, nnodes=nnodes, enable_dp_attention=dp_attention)


@pytest.mark.parametrize("args, ranks", [
    (_args(), 1),                                # TP only: TP rank 0 writes
    (_args(dp=8, dp_attention=True), 8),         # --tp 8 --dp 8 --enable-dp-attention: one per DP group
    (_args(dp=2), 2),                            # two DP replicas
    (_args(nnodes=2), 1),                        # TP across two nodes: only node 0's TP rank 0
    (_args(dp=4, nnodes=2, dp_attention=True), 2),  # DP groups spread over the nodes
])
def test_writer_ranks_per_node(args, ranks):
    assert writer_ranks_on_node(args) == ranks


def test_dp8_shares_the_default_budget_instead_of_multiplying_it(tmp_path):
    config = CaptureConfig(capture_dir=str(tmp_path), writers=16)
    budget = NodeBudget.for_server(config, _args(dp=8, dp_attention=True))
    assert (budget.pending_bytes, budget.writers) == (1024 << 20, 2)  # 8 GiB and 16 processes over 8 ranks
    assert budget.ranks * budget.pending_bytes == 8192 << 20 and budget.ranks * budget.writers == 16
    alone = NodeBudget.for_server(config, _args())
    assert (alone.pending_bytes, alone.writers) == (8192 << 20, 16)
    assert "node budget 8192 MiB of host memory and 16 writer processes, shared by 8 writer rank(s): 1024 MiB and " \
           "2 process(es) on this rank" in budget.describe()
    assert budget.describe().endswith("16 processes in all, beside one writer supervisor per rank (its hand-off threads, "
                                      "little CPU)")


def test_every_rank_keeps_at_least_one_writer_and_one_mib(tmp_path):
    config = CaptureConfig(capture_dir=str(tmp_path), writers=3, max_pending_mb=1)
    budget = NodeBudget.for_server(config, _args(dp=8, dp_attention=True))
    assert (budget.writers, budget.pending_bytes) == (1, 1 << 20)
