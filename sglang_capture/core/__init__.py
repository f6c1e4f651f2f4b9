"""Shared core: what both sides of the data's path agree on, importable anywhere.

The file format (``format``), reading a file (``reader``), the names of files and outcome
records (``names``, ``capture_dir``), durable file writes (``durable``), layer ids (``layers``),
loss-mask spans, the capture options (``config``) and the scheduler-to-writer wire protocol
(``handoff``). Nothing here imports SGLang or torch (tests/test_boundaries.py checks it).
"""
