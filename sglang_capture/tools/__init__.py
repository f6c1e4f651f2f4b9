"""The offline tools: the ``sglang-capture`` CLI (``cli``) and one module per command.

They talk to capture servers over HTTP and read capture files; none imports SGLang
(tests/test_boundaries.py checks it), so they run on machines without it.
"""
