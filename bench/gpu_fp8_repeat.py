"""FP8 rows that cannot be overwritten: a check that fails when a stream hazard corrupts them.

    python bench/gpu_fp8_repeat.py race OUT_DIR [--rows 16384] [--width 28672] [--trials 10]
    python bench/gpu_fp8_repeat.py repeat MODEL_DIR OUT_DIR [--repeats 16] [--tokens 4096]
                                          [--load 64] [--server-args "..."]

``race``: the capture path's operations in isolation, on one GPU. A [rows, width] bf16 tensor made
on the forward stream is packed to FP8 (``core/fp8.pack``) on a side stream, its last reference
dropped, and the forward stream at once writes a new tensor of the same size. Without
``read_on_current_stream`` (host_pool.py) the caching allocator may give the new tensor the old
one's memory before the pack has read it; a sleep queued on the side stream first makes that race
happen every time, so the detector is shown to fail. Then the same race through the real copy
hook (``hooks/transfer.copy_hidden_to_pool``, on the objects SGLang hands it: testbed/copy_hook.py)
for a batch of FP8 captures, which it packs whole on the side stream: with the hook's own
``read_on_current_stream`` and, to show the detector, with that one call made a no-op. Also
measures the device memory ``pack`` takes beyond its output, against the whole-batch formula it
replaced.

``repeat``: a launcher on MODEL_DIR (the Kimi-compute shape, ``--load-format dummy``) with
``--capture-dtype fp8``; ``--load`` plain clients keep it decoding long generations while one
fixed prompt is captured ``--repeats`` times. The clients' prompts are all prefilled before the
first capture, so each capture's prefill runs alone in its batch and every repeat must store the
very same bytes as the first: a capture that read a later forward's memory differs. Rows are
compared per stored block (bytes equal, and cosine of the restored rows).
Writes OUT_DIR/gpu_fp8_<mode>.json and prints PASS or FAIL last.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
from typing import Dict, List

import requests
import torch

import sglang_capture
from sglang_capture.core.fp8 import pack
from sglang_capture.server.host_pool import read_on_current_stream
from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.fp8_reference import whole_batch_pack
from sglang_capture.testbed.once import cache_dir
from sglang_capture.testbed.server import Server, start_server, stop_server

GPU_ARGS = ("--attention-backend triton --grammar-backend none --cuda-graph-max-bs 128 --max-running-requests 128 "
            "--chunked-prefill-size 8192 --max-total-tokens 400000 --mem-fraction-static 0.88")


def _extra_memory(fn, x: torch.Tensor, block: int) -> int:
    """Peak device bytes ``fn(x, block)`` allocates beyond its own output."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(x, block)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    del out
    return extra


def _forward_tensor(a: argparse.Namespace, trial: int) -> torch.Tensor:
    """A fresh [rows, width] bf16 tensor of the forward stream, with no other cached block of its
    size: the next "forward" tensor must be offered its memory (a freed temporary of the same size
    would be picked first, hiding the race)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.empty(a.rows, a.width, device="cuda", dtype=torch.bfloat16).normal_().mul_(trial + 1)


def race(a: argparse.Namespace) -> Dict:
    forward, side = torch.cuda.current_stream(), torch.cuda.Stream()
    block = a.width // 4
    results: Dict = {"rows": a.rows, "width": a.width, "trials": a.trials, "corrupted": {}}
    for record in (False, True):
        corrupted = 0
        for trial in range(a.trials):
            x = _forward_tensor(a, trial)
            want, x_ptr = pack(x, block), x.data_ptr()
            side.wait_stream(forward)
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000)  # the pack's reads start well after the next "forward"
                if record:
                    read_on_current_stream(x)
                got = pack(x, block)
            del x  # the forward's last reference: its memory goes back to the allocator
            nxt = torch.empty(a.rows, a.width, device="cuda", dtype=torch.bfloat16).fill_(1000.0)  # the next forward
            torch.cuda.synchronize()
            results.setdefault("reused_memory", {}).setdefault(str(record), []).append(nxt.data_ptr() == x_ptr)
            corrupted += int(not torch.equal(got, want))
            del nxt, got, want
        results["corrupted"]["with_record_stream" if record else "without_record_stream"] = corrupted
    results["hooks"] = _race_through_the_copy_hook(a, forward, side)
    x = torch.randn(a.rows, a.width, device="cuda", dtype=torch.bfloat16)
    results["pack_extra_bytes"] = {"row_chunks": _extra_memory(pack, x, block),
                                   "whole_batch": _extra_memory(whole_batch_pack, x, block),
                                   "input_bytes": x.numel() * x.element_size()}
    results["detector_fails_without_fix"] = results["corrupted"]["without_record_stream"] > 0
    results["ok"] = results["corrupted"]["with_record_stream"] == 0 and results["detector_fails_without_fix"] \
        and results["hooks"]["ok"]
    return results


def _race_through_the_copy_hook(a: argparse.Namespace, forward, side) -> Dict:
    """``race`` with the real hook doing the reading: the forward's rows handed to the copy hook on
    the side stream (behind a sleep), their last reference dropped, the next forward written at once."""
    import tempfile

    from sglang_capture.server.hooks import transfer
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.testbed.copy_hook import CopyHookCall

    block = a.width // 4
    pool = HostPool(2 * a.rows * a.width + (64 << 20), pin=True)
    out: Dict = {"corrupted": {}, "reused_memory": {}}
    real = transfer.read_on_current_stream
    with tempfile.TemporaryDirectory() as capture_dir:
        for record in (False, True):
            corrupted = 0
            for trial in range(a.trials):
                x = _forward_tensor(a, trial)
                want, x_ptr = pack(x, block).cpu(), x.data_ptr()
                call = CopyHookCall(capture_dir, x, block, ["fp8", "fp8"], [a.rows // 2, a.rows - a.rows // 2], pool)
                del x  # the result object holds the forward's rows now, as in SGLang
                side.wait_stream(forward)
                transfer.read_on_current_stream = real if record else (lambda t: None)
                try:
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(50_000_000)  # the hook's reads start well after the next "forward"
                        host = call()  # drops the result's reference: the forward's memory is free
                finally:
                    transfer.read_on_current_stream = real
                nxt = torch.empty(a.rows, a.width, device="cuda", dtype=torch.bfloat16).fill_(1000.0)
                torch.cuda.synchronize()
                out["reused_memory"].setdefault(str(record), []).append(nxt.data_ptr() == x_ptr)
                corrupted += int(not torch.equal(host, want))
                del nxt, host, want, call
            out["corrupted"]["with_the_hooks_record" if record else "hooks_record_made_a_no_op"] = corrupted
    pool.close()
    out["detector_fails_without_fix"] = out["corrupted"]["hooks_record_made_a_no_op"] > 0
    out["ok"] = out["corrupted"]["with_the_hooks_record"] == 0 and out["detector_fails_without_fix"]
    return out


def _load(server: Server, stop: threading.Event, vocab: int, seed: int, counts: List[int]) -> None:
    """One plain client: short prompts, long generations, until ``stop``."""
    gen = torch.Generator().manual_seed(seed)
    while not stop.is_set():
        ids = torch.randint(3, vocab, (64,), generator=gen).tolist()
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}
        try:
            server.generate(body, timeout=600)
            counts[0] += 1
        except requests.RequestException:
            return


def repeat(a: argparse.Namespace) -> Dict:
    capture_dir = os.path.join(a.out_dir, "captures")
    os.makedirs(capture_dir, exist_ok=True)
    cfg = json.load(open(os.path.join(a.model_dir, "config.json")))
    cfg = cfg.get("text_config", cfg)
    cmd = [sys.executable, "-m", "sglang_capture.launch", "--capture-dir", capture_dir, "--capture-dtype", "fp8",
           "--model-path", a.model_dir, *shlex.split(a.server_args), *shlex.split(a.extra_server_args)]
    server = start_server(cmd, server_env(cache_dir()), os.path.join(a.out_dir, "server.log"), capture_dir)
    ids = torch.randint(3, cfg["vocab_size"], (a.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    stop, done = threading.Event(), [0]
    clients = [threading.Thread(target=_load, args=(server, stop, cfg["vocab_size"], 100 + i, done), daemon=True)
               for i in range(a.load)]
    refs: List[Dict] = []
    try:
        for c in clients:
            c.start()
        time.sleep(a.settle)  # every client's prompt prefilled: the server is decoding
        for i in range(a.repeats):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "custom_params": {
                "capture": True, "capture_name": f"fixed-{i:03d}"}}}
            r = server.generate(body, timeout=600)
            ref = r.json()["meta_info"]["capture"] if r.status_code == 200 else {"status": f"HTTP {r.status_code}"}
            if ref.get("status") != "ok":
                raise SystemExit(f"capture {i} did not succeed: {ref}")
            refs.append(ref)
    finally:
        stop.set()
        stop_server(server)
    first = sglang_capture.load(refs[0]["path"], raw_fp8=True)
    first_rows = sglang_capture.load(refs[0]["path"])
    H, per_repeat = first["hidden_size"], []
    for ref in refs[1:]:
        raw, rows = sglang_capture.load(ref["path"], raw_fp8=True), sglang_capture.load(ref["path"])
        stored = {k: int((raw[k].view(torch.uint8) != first[k].view(torch.uint8)).reshape(raw[k].shape[0], -1).any(-1).sum())
                  if raw[k].dtype == torch.float8_e4m3fn else int((raw[k] != first[k]).any(-1).sum())
                  for k in ("aux_hidden_states", "aux_hidden_states_scale", "last_hidden_states", "last_hidden_states_scale")}
        cos = {}
        for k in ("aux_hidden_states", "last_hidden_states"):
            x, y = first_rows[k].float(), rows[k].float()
            for b in range(x.shape[1] // H):
                c = torch.nn.functional.cosine_similarity(x[:, b * H:(b + 1) * H], y[:, b * H:(b + 1) * H], dim=-1)
                cos[f"{k}[{b}]"] = round(c.min().item(), 6)
        per_repeat.append({"name": os.path.basename(ref["path"]), "rows_differing": stored, "min_cos": cos})
    differing = sum(sum(p["rows_differing"].values()) for p in per_repeat)
    return {"model": a.model_dir, "server_args": f"{a.server_args} {a.extra_server_args}".strip(), "tokens": a.tokens, "repeats": a.repeats,
            "load_clients": a.load, "load_requests_finished": done[0], "rows": first["aux_hidden_states"].shape[0],
            "layers": first["layers"], "per_repeat": per_repeat, "rows_differing_total": differing, "ok": differing == 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("race")
    r.add_argument("out_dir")
    r.add_argument("--rows", type=int, default=16384)
    r.add_argument("--width", type=int, default=4 * 7168)
    r.add_argument("--trials", type=int, default=10)
    p = sub.add_parser("repeat")
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--repeats", type=int, default=16)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--load", type=int, default=64, help="plain clients decoding while the captures run")
    p.add_argument("--settle", type=float, default=20.0, help="seconds for the clients' prompts to be prefilled")
    p.add_argument("--server-args", default=GPU_ARGS)
    p.add_argument("--extra-server-args", default="", help="added to --server-args (e.g. --load-format dummy)")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = race(a) if a.mode == "race" else repeat(a)
    with open(os.path.join(a.out_dir, f"gpu_fp8_{a.mode}.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps({k: v for k, v in results.items() if k != "per_repeat"}))
    print("PASS" if results["ok"] else "FAIL")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
