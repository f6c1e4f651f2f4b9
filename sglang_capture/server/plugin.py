"""SGLang plugin entry point (group ``sglang.srt.plugins``): reaches every process SGLang spawns.

SGLang calls ``load_plugins()`` in its main process and at the top of every scheduler process,
which it starts with the ``spawn`` method (so patches made in the parent are not inherited).
The plugin is inert unless the launcher published a capture configuration in the environment:
a plain ``python -m sglang.launch_server`` in the same environment stays unpatched.
"""
from __future__ import annotations

from sglang_capture.core.config import CaptureConfig
from sglang_capture.server.instrumentor import INSTRUMENTOR


def register() -> None:
    """Install the capture hooks in this process when capture is configured (idempotent)."""
    config = CaptureConfig.from_env()
    if config is not None:
        INSTRUMENTOR.instrument(config)
