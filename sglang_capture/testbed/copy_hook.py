"""The result-copy hook driven outside a server, on real objects where the hook reads them.

``CopyHookCall`` builds what ``GenerationBatchResult.copy_to_cpu`` hands the hook inside SGLang's
scheduler: the scheduler's capture state (a real ``SchedulerCapture`` with a host pool), a batch of
requests that capture in FP8 or the model's dtype or not at all, the batch's ``BatchRows`` as
``run_batch`` launched it, and a result whose hidden states are the forward's tensor. Used by the
CPU test that every tensor handed from the forward stream to the copy stream is recorded on it
(tests/test_stream_ordering.py) and by the GPU check that runs the real hook under a busy forward
stream (r54 in bench/RESULTS.md; its script, bench/gpu_fp8_repeat.py, is at 95d42fb).
"""
from __future__ import annotations

import types
from typing import Any, List, Sequence

from sglang_capture.core.config import CaptureConfig
from sglang_capture.server.batch_rows import BatchRows
from sglang_capture.server.host_pool import HostPool
from sglang_capture.server.request_capture import RequestCapture
from sglang_capture.server.scheduler_capture import CAPTURE_ATTR, ModelInfo, SchedulerCapture

READERS = ("fp8", "model", "json", "plain")  # an FP8 capture, a model-dtype capture, SGLang's JSON, no reader


class CopyHookCall:
    """One call of the copy hook on ``hidden`` (rows of ``lens[i]`` per request, ``readers[i]`` each)."""

    def __init__(self, capture_dir: str, hidden: Any, hidden_size: int, readers: Sequence[str],
                 lens: Sequence[int], pool: HostPool) -> None:
        assert sum(lens) == hidden.shape[0] and len(lens) == len(readers) and set(readers) <= set(READERS)
        self.state = SchedulerCapture(CaptureConfig(capture_dir=capture_dir, writers=1))
        self.state.pool = pool
        self.state.model = ModelInfo(model_path="", architecture="", model_class="", hidden_size=hidden_size,
                                     num_layers=0, layers=(), dtype="bfloat16")
        self.reqs: List[Any] = []
        for reader, n in zip(readers, lens, strict=True):
            req = types.SimpleNamespace(return_hidden_states=reader != "plain", extend_range=types.SimpleNamespace(length=n))
            if reader in ("fp8", "model"):
                setattr(req, CAPTURE_ATTR, RequestCapture(rid="r", name="r", ledger=self.state.ledger, pool=pool,
                                                          fp8_block=hidden_size if reader == "fp8" else None,
                                                          counts=self.state.copies))
            self.reqs.append(req)
        mode = types.SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True, is_mixed=lambda: False)
        self.batch = types.SimpleNamespace(reqs=self.reqs, forward_mode=mode, extend_lens=list(lens))
        self.result = types.SimpleNamespace(logits_output=types.SimpleNamespace(hidden_states=hidden))
        self.sglang_copies: List[dict] = []  # the calls that reached SGLang's own copy_to_cpu

    def __call__(self) -> Any:
        """Run the hook as ``run_batch`` does, the batch launching; returns the host rows it left
        on the result (the pool block SGLang then reads as its hidden states)."""
        from sglang_capture.server.hooks.transfer import copy_hidden_to_pool

        def sglang_copy_to_cpu(return_logprob: bool, return_hidden_states: bool = True) -> None:
            self.sglang_copies.append({"return_logprob": return_logprob, "return_hidden_states": return_hidden_states})

        self.state.launching = BatchRows(self.batch, captures=True)
        try:
            copy_hidden_to_pool(self.state, sglang_copy_to_cpu, self.result, (False,), {"return_hidden_states": True})
        finally:
            self.state.launching = None
        return self.result.logits_output.hidden_states
