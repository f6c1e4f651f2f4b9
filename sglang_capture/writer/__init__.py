"""What runs in the writer processes: hand jobs on, assemble a request's rows, encode, make durable, publish.

Each writer-rank scheduler process starts one supervisor (``supervisor``): it takes that process's
finished requests, runs the writer processes (``process``, each seen through ``child``), records
outcomes and keeps the stats file. The writer processes read rows from the scheduler's host pool
in place. None of them imports torch or SGLang (tests/test_boundaries.py checks it).
"""
