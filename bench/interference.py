"""How much do busy neighbour processes slow plain SGLang, and through what: cores or memory?

On the H200 host the capture server's requests that do not capture ran 5-15% slower beside the
writer processes (bench/RESULTS.md), although the package's own code takes under 2% of the
scheduler thread (py-spy) and the writers run on other cores. This runs plain SGLang under the
mixed load of ``bench/e2e.py`` while N background processes do one kind of work each, in
alternating windows with none:

- ``spin``: pure-Python arithmetic, a few KB of memory (takes cores only: turbo budget, SMT);
- ``stream``: numpy copies between two 256 MB arrays (memory bandwidth and the shared cache);
- ``writer``: the writer's own encoding (byte-shuffle, zstd, SHA-256) of a Kimi-width capture
  of 2,048 tokens, to /dev/null, at the rate ``--writer-files-per-s`` spread over the N processes
  (the disk left out).

    python bench/interference.py MODEL_DIR OUT_DIR [--procs 5] [--rounds 2] [--seconds 8]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import statistics
import sys
import time
from typing import Dict, List

import e2e
import e2e_load
import numpy

from sglang_capture.core.format import Codec, HostTensor, write_capture

LOADS = ("spin", "stream", "writer")


def _spin(stop) -> None:
    x = 1
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _stream(stop) -> None:
    src = numpy.ones(256 << 20, dtype=numpy.uint8)
    dst = numpy.empty_like(src)
    while not stop.is_set():
        numpy.copyto(dst, src)


def _writer(stop, hidden: int, files_per_s: float) -> None:
    """Encode a [2048, 3 x hidden] + [2048, hidden] bf16 capture to /dev/null, ``files_per_s`` a second."""
    rng = numpy.random.default_rng(os.getpid())
    bf16 = lambda cols: (rng.standard_normal((2048, cols), dtype=numpy.float32).view(numpy.uint32) >> 16).astype(numpy.uint16)
    tensors = {"aux_hidden_states": HostTensor("bfloat16", bf16(3 * hidden)), "last_hidden_states": HostTensor("bfloat16", bf16(hidden))}
    due = time.monotonic()
    with open(os.devnull, "wb") as sink:
        while not stop.is_set():
            write_capture(sink, {"rid": "x"}, tensors, Codec())
            due += 1.0 / files_per_s
            time.sleep(max(0.0, due - time.monotonic()))


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--procs", type=e2e._at_least(1), default=5, help="background processes per load (the writers used ~5 cores)")
    p.add_argument("--rounds", type=e2e._at_least(1), default=2)
    p.add_argument("--seconds", type=float, default=8)
    p.add_argument("--tokens", type=e2e._at_least(1), default=2048)
    p.add_argument("--concurrency", type=e2e._at_least(1), default=32, help="closed-loop decode clients")
    p.add_argument("--rate", type=float, default=12.5, help="open-loop prompt-only requests/s beside them")
    p.add_argument("--writer-files-per-s", type=float, default=12.5)
    p.add_argument("--sglang-args", default=" ".join(e2e.BASE_ARGS))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    prompts = e2e_load.PROMPTS["run"] = e2e_load.Prompts(a.tokens, cfg["vocab_size"])
    spec = lambda kind, max_new: {"kind": kind, "tokens": a.tokens, "max_new": max_new, "capture": False, "json": False}
    others, stream = [spec("mixed-other", 16)] * a.concurrency, spec("mixed-capture", 1)
    server = e2e.run_server([sys.executable, "-m", "sglang.launch_server", *shlex.split(a.sglang_args), "--model-path", a.model],
                            a.out, "plain")
    ctx = multiprocessing.get_context("fork")
    res: Dict = {"config": vars(a), "windows": []}
    try:
        e2e_load.Load(server.url, prompts).run(others, 5, procs=4, open_spec=stream, rate=a.rate)  # new batch shapes
        order = [w for _ in range(a.rounds) for w in ("none", *LOADS)] + ["none"]
        for load in order:
            stop = ctx.Event()
            target = {"spin": _spin, "stream": _stream, "writer": _writer}.get(load)
            args = (stop, cfg["hidden_size"], a.writer_files_per_s / a.procs) if load == "writer" else (stop,)
            procs = [ctx.Process(target=target, args=args, daemon=True) for _ in range(a.procs)] if target else []
            for pr in procs:
                pr.start()
            time.sleep(1.0 if procs else 0.0)  # the load running before the window opens
            r = e2e_load.Load(server.url, prompts).run(others, a.seconds, procs=4, open_spec=stream, rate=a.rate)
            stop.set()
            for pr in procs:
                pr.join(10)
            w = {"load": load, "others_tok_per_s": r["mixed-other"]["tok_per_s"], "p99_s": r["mixed-other"]["p99_s"]}
            res["windows"].append(w)
            print(json.dumps(w), file=sys.stderr, flush=True)
    finally:
        e2e.stop_server(server)
    res["ratios"] = ratios(res["windows"])
    with open(os.path.join(a.out, "interference.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(report(res))
    return 0


def ratios(windows: List[Dict]) -> Dict[str, List[float]]:
    """Each loaded window against the mean of the unloaded windows that open and close its round."""
    out: Dict[str, List[float]] = {}
    base = [i for i, w in enumerate(windows) if w["load"] == "none"]
    for lo, hi in zip(base, base[1:], strict=False):
        ref = (windows[lo]["others_tok_per_s"] + windows[hi]["others_tok_per_s"]) / 2
        for w in windows[lo + 1:hi]:
            out.setdefault(w["load"], []).append(round(w["others_tok_per_s"] / ref, 3))
    return out


def report(res: Dict) -> str:
    rows = ["| background load | others' tok/s ÷ unloaded (per round) | median |", "|---|---|---|"]
    for load, rs in res["ratios"].items():
        rows.append(f"| {load} x {res['config']['procs']} | {', '.join(f'{r:.3f}' for r in rs)} | {statistics.median(rs):.3f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
