"""Test bed: only what makes real SGLang run on a CPU-only machine (tests and the demo).

Nothing in the capture path imports this package. It builds tiny random-weight models with an
offline tokenizer, a stub ``libcuda.so.1`` so SGLang's CUDA-built kernel wheel can be loaded
without a driver, and an SGLang plugin that routes DeepSeek MLA to the absorbed path on the
``torch_native`` attention backend (``../shared/reference/sglang-on-cpu.md`` explains each).
"""

# The models ``sglang-capture demo --model`` serves (tools/demo.py builds each): here, and not in
# the CLI or the demo, so that both read one list without importing each other.
DEMO_MODELS = ("smollm2", "tiny-dsv3")
