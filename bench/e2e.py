"""End-to-end capture throughput on a GPU: plain SGLang against the capture server, per mode.

    python bench/e2e.py MODEL_DIR OUT_DIR [--tokens 2048] [--concurrency 64] [--seconds 20]
                        [--json-requests 8] [--capture-args "..."] [--sglang-args "..."]

Two servers are started in turn on MODEL_DIR (e.g. a Kimi-width tiny DeepSeek-V3: 4 layers,
hidden 7168), each measured with closed-loop load (``--concurrency`` clients sending requests
back to back for ``--seconds``) of random-token prompts (never a radix-cache hit):

- (a) ``plain``: ``python -m sglang.launch_server``, prefill-heavy (max_new_tokens 1)
- (a-mixed): same server, the mixed load below (the capture flag is ignored by a plain server)
- (b) ``launcher-idle``: ``python -m sglang_capture.launch``, no request captures
- (d) ``file-capture``: same server, every request captures 3 aux layers + final hidden state
- (d-mixed): half the clients capture (max_new_tokens 1), half do not (max_new_tokens 16)
- (c) ``json``: SGLang's built-in ``return_hidden_states`` (final hidden state only) on the
  capture server's non-capture path (identical to plain SGLang's), ``--json-requests`` requests

Reports tokens/s, raw capture GB/s, p50/p99 latency, bytes on disk, compression ratio, peak RSS
of the server's process tree, and the writer's queue depth and peak held host memory (from its
stats file), then checks the targets of issue 4 and names the bottleneck stage if one is missed.
Writes OUT_DIR/e2e.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import psutil
import requests

from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.server import Server, start_server, stop_server

_NAMES = itertools.count()  # capture names and seeds, unique over the whole run
BASE_ARGS = ["--attention-backend", "triton", "--grammar-backend", "none", "--mem-fraction-static", "0.6",
             "--cuda-graph-max-bs", "64", "--chunked-prefill-size", "16384", "--max-running-requests", "128"]


class RssSampler(threading.Thread):
    """Peak resident memory of a server's whole process tree, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.peak = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.2)


def body(tokens: int, vocab: int, rng: random.Random, max_new: int, capture: Optional[str], json_hs: bool) -> dict:
    b = {"input_ids": [rng.randrange(3, vocab) for _ in range(tokens)],
         "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    if capture:
        b["sampling_params"]["custom_params"] = {"capture": True, "capture_name": capture}
    if json_hs:
        b["return_hidden_states"] = True
    return b


def closed_loop(server: Server, clients: List[dict], seconds: float, vocab: int, max_requests: Optional[int] = None) -> Dict:
    """Each client dict: {"max_new": int, "capture": bool, "json": bool}. Returns per-kind stats."""
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()
    results: List[dict] = []
    counter = [0]

    def worker(i: int, spec: dict) -> None:
        rng = random.Random(next(_NAMES))
        session = requests.Session()
        while True:
            with lock:
                if (max_requests is not None and counter[0] >= max_requests) or time.monotonic() >= stop_at:
                    return
                counter[0] += 1
            name = f"bench-{os.getpid()}-{next(_NAMES)}" if spec["capture"] else None
            b = body(spec["tokens"], vocab, rng, spec["max_new"], name, spec["json"])
            t0 = time.monotonic()
            r = session.post(server.url + "/generate", json=b, timeout=900)
            dt = time.monotonic() - t0
            ok = r.status_code == 200
            # only capture responses are parsed: a JSON-path response is hundreds of MB of floats
            ref = r.json().get("meta_info", {}).get("capture") if ok and spec["capture"] else None
            with lock:
                results.append({"kind": spec["kind"], "tokens": spec["tokens"], "latency": dt, "ok": ok,
                                "capture_ok": bool(ref and ref.get("status") == "ok"),
                                "bytes": (ref or {}).get("bytes", 0), "end": time.monotonic()})

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(clients)) as pool:
        list(pool.map(lambda a: worker(*a), enumerate(clients)))
    elapsed = time.monotonic() - t0
    out = {}
    for kind in sorted({r["kind"] for r in results}):
        rs = [r for r in results if r["kind"] == kind]
        lat = sorted(r["latency"] for r in rs)
        toks = sum(r["tokens"] for r in rs)
        out[kind] = {"requests": len(rs), "failed": sum(not r["ok"] for r in rs),
                     "capture_ok": sum(r["capture_ok"] for r in rs), "tokens": toks, "seconds": elapsed,
                     "tok_per_s": toks / elapsed, "p50_s": lat[len(lat) // 2],
                     "p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))], "bytes_on_disk": sum(r["bytes"] for r in rs)}
    return out


def writer_stats(capture_dir: str) -> Dict:
    idx = os.path.join(capture_dir, ".index")
    stats: Dict = {}
    for f in os.listdir(idx) if os.path.isdir(idx) else []:
        if f.startswith("writer-"):
            with open(os.path.join(idx, f)) as fh:
                stats = json.load(fh)
    return stats


def run_server(cmd: List[str], out: str, name: str, capture_dir: str = "") -> Server:
    t0 = time.time()
    env = server_env(os.path.expanduser("~/.cache/sglang-capture-tests"))  # unchanged on a GPU machine
    s = start_server(cmd, env, os.path.join(out, f"{name}.log"), capture_dir)
    print(f"{name} server up in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return s


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--json-requests", type=int, default=8)
    p.add_argument("--capture-dir", default=None)
    p.add_argument("--capture-args", default="--capture-layers 1,2,3 --capture-writer-threads 8")
    p.add_argument("--sglang-args", default=" ".join(BASE_ARGS))
    p.add_argument("--modes", default="plain,capture")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    capture_dir = a.capture_dir or os.path.join(a.out, "captures")
    os.makedirs(capture_dir, exist_ok=True)
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    sg = shlex.split(a.sglang_args) + ["--model-path", a.model]
    T, C = a.tokens, a.concurrency
    prefill = [{"kind": "prefill", "tokens": T, "max_new": 1, "capture": False, "json": False}] * C
    capture = [{"kind": "capture", "tokens": T, "max_new": 1, "capture": True, "json": False}] * C
    mixed = ([{"kind": "mixed-capture", "tokens": T, "max_new": 1, "capture": True, "json": False}] * (C // 2)
             + [{"kind": "mixed-other", "tokens": T, "max_new": 16, "capture": False, "json": False}] * (C - C // 2))
    json_clients = [{"kind": "json", "tokens": T, "max_new": 1, "capture": False, "json": True}] * min(C, a.json_requests)
    res: Dict[str, Dict] = {"config": {"tokens": T, "concurrency": C, "seconds": a.seconds, "hidden": hidden,
                                       "bytes_per_token_raw": (3 + 1) * hidden * 2, "sglang_args": sg,
                                       "capture_args": a.capture_args}}
    modes = a.modes.split(",")

    def measure(server: Server, name: str, clients: List[dict], **kw) -> None:
        closed_loop(server, clients[:4], 3, vocab, max_requests=8)  # warm-up
        sampler = RssSampler(server.proc.pid)
        sampler.start()
        res[name] = closed_loop(server, clients, a.seconds, vocab, **kw)
        sampler.stop_event.set()
        res[name]["_peak_rss_bytes"] = sampler.peak
        print(f"{name}: " + ", ".join(f"{k} {v['tok_per_s']:,.0f} tok/s" for k, v in res[name].items()
                                      if isinstance(v, dict)), file=sys.stderr, flush=True)

    if "plain" in modes:
        s = run_server([sys.executable, "-m", "sglang.launch_server", *sg], a.out, "plain")
        try:
            measure(s, "a_plain", prefill)
            measure(s, "a_mixed", [dict(c, capture=False) for c in mixed])
        finally:
            stop_server(s)
    if "capture" in modes:
        cmd = [sys.executable, "-m", "sglang_capture.launch", "--capture-dir", capture_dir,
               *shlex.split(a.capture_args), *sg]
        s = run_server(cmd, a.out, "capture", capture_dir)
        try:
            measure(s, "b_launcher_idle", prefill)
            measure(s, "d_file_capture", capture)
            res["d_file_capture"]["_writer"] = writer_stats(capture_dir)
            _clean(capture_dir)
            measure(s, "d_mixed", mixed)
            _clean(capture_dir)
            closed_loop(s, json_clients[:1], 60, vocab, max_requests=1)  # warm the JSON path
            t0 = time.monotonic()
            res["c_json"] = closed_loop(s, json_clients, 1e9, vocab, max_requests=len(json_clients))
            print(f"c_json: {res['c_json']['json']['tok_per_s']:,.0f} tok/s ({time.monotonic() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
            res["_writer_final"] = writer_stats(capture_dir)
        finally:
            stop_server(s)
    with open(os.path.join(a.out, "e2e.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(report(res))
    return 0


def _clean(capture_dir: str) -> None:
    for f in os.listdir(capture_dir):
        if f.endswith(".capture.msgpack"):
            os.unlink(os.path.join(capture_dir, f))


def report(res: Dict) -> str:
    cfg = res["config"]
    bpt = cfg["bytes_per_token_raw"]
    rows = ["| mode | load | tok/s | raw capture GB/s | p50 s | p99 s | on disk | ratio | peak RSS GB |",
            "|---|---|---|---|---|---|---|---|---|"]
    for mode in ("a_plain", "a_mixed", "b_launcher_idle", "d_file_capture", "d_mixed", "c_json"):
        for kind, r in (res.get(mode) or {}).items():
            if kind.startswith("_"):
                continue
            cap = r["capture_ok"] * cfg["tokens"]
            gbs = cap * bpt / r["seconds"] / 1e9 if cap else 0
            ratio = f"{cap * bpt / r['bytes_on_disk']:.2f}" if r["bytes_on_disk"] else "—"
            rows.append(f"| {mode} | {kind} ({r['requests']} req, {r['failed']} failed) | {r['tok_per_s']:,.0f} | "
                        f"{gbs:.2f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['bytes_on_disk'] / 1e9:.2f} GB | {ratio} | "
                        f"{res[mode].get('_peak_rss_bytes', 0) / 1e9:.1f} |")
    checks = []
    tok = lambda m, k: (res.get(m) or {}).get(k, {}).get("tok_per_s")
    d, c, a_, b = tok("d_file_capture", "capture"), tok("c_json", "json"), tok("a_plain", "prefill"), tok("b_launcher_idle", "prefill")
    if d:
        checks.append(f"(d) {d:,.0f} tok/s >= 25,000: {'PASS' if d >= 25000 else 'MISS'}")
    if d and c:
        checks.append(f"(d)/(c) = {d / c:,.0f}x >= 50x: {'PASS' if d / c >= 50 else 'MISS'}")
    if a_ and b:
        checks.append(f"(b)/(a) = {b / a_:.3f} (>= 0.97): {'PASS' if b / a_ >= 0.97 else 'MISS'}")
    am, dm = tok("a_mixed", "mixed-other"), tok("d_mixed", "mixed-other")
    if am and dm:
        checks.append(f"mixed non-capture (d)/(a) = {dm / am:.3f} (>= 0.95): {'PASS' if dm / am >= 0.95 else 'MISS'}")
    w = (res.get("d_file_capture") or {}).get("_writer") or {}
    if w:
        checks.append(f"writer: peak held {w.get('peak_held_bytes', 0) / 1e9:.2f} GB of cap {w.get('cap_bytes', 0) / 1e9:.2f} GB "
                      f"({'PASS' if w.get('peak_held_bytes', 0) <= w.get('cap_bytes', 1) else 'OVER'}), max queue "
                      f"{w.get('max_queue')}, back-pressure waits {w.get('back_pressure_waits')}")
        n = max(w.get("written", 0), 1)
        checks.append("writer stage ms/file (summed over threads): " + ", ".join(
            f"{k[:-2]} {w.get(k, 0) / n * 1e3:.0f}" for k in ("queue_wait_s", "assemble_s", "encode_write_s", "fsync_publish_s"))
            + f"; raw {w.get('raw_bytes', 0) / n / 1e6:.0f} MB/file, failed {w.get('failed')}")
    return "\n".join(rows + [""] + checks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
