"""Loaded at start-up by every Python process of a CPU test-bed server (testbed/cpu.py puts this
folder first on ``PYTHONPATH``), and by nothing else: SGLang's CPU workarounds (cpu_mla.py) are
applied in each scheduler process once SGLang's model runner is imported, and the pure-torch
stand-ins for the sgl_kernel CPU ops of SGLang's EAGLE path (spec_kernels.py) are defined as soon as
``sgl_kernel`` is imported, before SGLang's modules import them from it (and the intel_amx attention
backend, which EAGLE needs on a CPU, is given the sequence lengths it drops once it is imported).

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

    def _spec_kernels(_module: object) -> None:
        from sglang_capture.testbed.spec_kernels import install

        install()

    wrapt.register_post_import_hook(_spec_kernels, "sgl_kernel")

    def _intel_amx(_module: object) -> None:
        from sglang_capture.testbed.spec_kernels import patch_intel_amx_backend

        patch_intel_amx_backend()

    wrapt.register_post_import_hook(_intel_amx, "sglang.srt.layers.attention.intel_amx_backend")
