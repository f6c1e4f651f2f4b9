"""``python -m sglang_capture`` = the ``sglang-capture`` command."""
from sglang_capture.cli import main

main()
