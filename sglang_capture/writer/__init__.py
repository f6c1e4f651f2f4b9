"""What runs in the writer processes: assemble a request's rows, encode, make durable, publish.

Each writer process (``process``) is started by a scheduler process and reads rows from its
host pool in place. It never imports torch or SGLang (tests/test_boundaries.py checks it).
"""
