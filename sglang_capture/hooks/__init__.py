"""What each patch does: one small module per seam family, wrapt wrappers only, no I/O.

``patches/`` says which SGLang functions are wrapped and by which function here.
"""
