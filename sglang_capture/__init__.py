"""sglang_capture: capture EAGLE-3 hidden states from a live SGLang server into compressed files.

Start a server with ``python -m sglang_capture.launch --capture-dir DIR <sglang args>``, send
requests with ``"custom_params": {"capture": true}``, and read the files with ``load``.
"""
from sglang_capture.core.format import CaptureFileError
from sglang_capture.core.reader import load

__version__ = "0.1.0"
__all__ = ["load", "CaptureFileError", "__version__"]
