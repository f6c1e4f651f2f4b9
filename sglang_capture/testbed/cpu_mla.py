"""SGLang plugin, CPU test bed only: DeepSeek MLA on ``torch_native`` must use the absorbed path.

DeepSeek's attention registry has no ``torch_native`` handler and falls back to the triton one,
which picks MHA for a fresh prefill; the torch_native backend then reads the latent MLA cache
and fails on the head size. Active only with ``SGLANG_CAPTURE_CPU_TESTBED=1``.
"""
from __future__ import annotations

import os


def register() -> None:
    if os.environ.get("SGLANG_CAPTURE_CPU_TESTBED") != "1":
        return
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: _dispatch_mla_subtype(attn, forward_batch))
