"""Loaded at start-up by every Python process of a CPU test-bed server (testbed/cpu.py puts this
folder first on ``PYTHONPATH``), and by nothing else: SGLang's CPU workarounds (cpu_mla.py) are
applied in each scheduler process once SGLang's model runner is imported.

This is not an SGLang plugin entry point on purpose: those load in every SGLang server of every
install, and the test bed must never touch a user's server.
"""
import os

if os.environ.get("SGLANG_CAPTURE_CPU_TESTBED") == "1":
    import wrapt

    def _apply(_module: object) -> None:
        from sglang_capture.testbed.cpu_mla import apply

        apply()

    wrapt.register_post_import_hook(_apply, "sglang.srt.model_executor.model_runner")
