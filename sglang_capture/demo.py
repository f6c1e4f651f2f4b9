"""``python -m sglang_capture.demo``: the whole path on a built-in default, verified.

Builds a tiny DeepSeek-V3 (Kimi-K2.5's architecture) with an offline tokenizer, starts a capture
server through ``sglang_capture.launch`` (CPU here, GPU where there is one), captures a few
samples, checks each file's rows and ids against the response, and prints where they are.
"""
from __future__ import annotations

import os
import sys
import tempfile

import click

from sglang_capture.reader import load
from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.server import capture_cmd, start_server, stop_server
from sglang_capture.testbed.tiny_models import build_all

SAMPLES = [
    "Kimi K2.5 uses the DeepSeek V3 architecture with MLA and MoE layers.",
    "Hidden states are captured from every decoder layer of the model.",
    "The quick brown fox jumps over the lazy dog.",
]


@click.command()
@click.option("--out", default=None, help="Folder for models, captures and the server log (default: a new temp dir).")
def main(out: str) -> None:
    """Capture a few samples from a tiny DeepSeek-V3 and verify them."""
    out = os.path.abspath(out or tempfile.mkdtemp(prefix="sglang-capture-demo-"))
    capture_dir = os.path.join(out, "captures")
    os.makedirs(capture_dir, exist_ok=True)
    cache = os.path.expanduser("~/.cache/sglang-capture-tests")
    click.echo(f"building a tiny DeepSeek-V3 under {out}/models ...")
    model = build_all(os.path.join(out, "models"))["tiny-dsv3"]
    click.echo("starting the capture server (about 30-60 s) ...")
    server = start_server(capture_cmd(model, capture_dir, "--capture-layers", "1,2,3"), server_env(cache),
                          os.path.join(out, "server.log"), capture_dir)
    failures = 0
    try:
        for i, text in enumerate(SAMPLES):
            body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True,
                                                      "custom_params": {"capture": True, "capture_name": f"demo-{i}"}}}
            resp = server.generate(body).json()
            ref = resp["meta_info"]["capture"]
            data = load(ref["path"])
            rows = data["aux_hidden_states"].shape[0]
            ok = (ref["status"] == "ok" and data["output_ids"].tolist() == resp["output_ids"]
                  and rows == len(data["input_ids"]) + len(data["output_ids"]) - 1
                  and data["last_hidden_states"].shape == (rows, data["hidden_size"]))
            failures += not ok
            click.echo(f"  {'OK ' if ok else 'BAD'} {ref['path']}: {rows} rows, aux {list(data['aux_hidden_states'].shape)} "
                       f"{data['aux_hidden_states'].dtype}, layers {data['layers']}, {ref['bytes']} bytes")
    finally:
        stop_server(server)
    click.echo(f"demo: {len(SAMPLES) - failures} of {len(SAMPLES)} samples captured and verified in {capture_dir}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
