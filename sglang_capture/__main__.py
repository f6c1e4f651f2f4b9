"""``python -m sglang_capture`` = the ``sglang-capture`` command."""
from sglang_capture.tools.cli import main

main()
