"""Shared core: what both sides of the data's path agree on, importable anywhere.

The file format (``format``), reading a file (``reader``), the names of files and outcome
records (``names``, ``capture_dir``), durable file writes (``durable``), layer ids (``layers``),
loss-mask spans, the capture options (``config``), the HTTP capture contract (``protocol``), who
may capture (``selection``) and the scheduler-to-writer wire protocol (``handoff``). Nothing here
imports SGLang; torch is imported only inside the functions that make or take tensors (FP8
packing, ``load``), so that importing the core never loads it (tests/test_boundaries.py checks both).
"""
