"""``python -m sglang_capture.launch [--capture-* options] <sglang.launch_server args>``.

The entry point users prefix to their server command; ``server/launch.py`` does the work.
"""
from sglang_capture.server.launch import main

if __name__ == "__mp_main__":  # spawn re-runs the main module in every child: patch there too
    from sglang_capture.server.plugin import register

    register()

if __name__ == "__main__":
    main(prog_name="python -m sglang_capture.launch")
