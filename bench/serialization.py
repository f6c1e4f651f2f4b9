"""Per-request cost of turning one capture into bytes: SGLang's JSON path against this package's.

    python bench/serialization.py [--tokens 512,2048,8192] [--hidden 7168] [--json-max-tokens 2048] [--out FILE.json]

One capture = aux [T, 3H] + final [T, H] in bf16 (Kimi-K2.5 width by default: 57,344 B/token).
The data is activation-like (per-channel log-normal scales, heavy tails, a few massive channels),
generated on the GPU when there is one. Paths, each timed on the same tensors:

- ``sglang-json``: what SGLang 0.5.17 does: ``.cpu().clone().tolist()`` in the scheduler, pickled
  across its two IPC hops (scheduler -> detokenizer -> HTTP process), then ``orjson.dumps`` as
  the HTTP layer does. Skipped above ``--json-max-tokens`` (Python floats need ~32 B each).
- ``d2h-pinned`` / ``d2h-pageable`` (GPU only): the device-to-host copy alone.
- ``msgpack-raw``, ``zstd-1``, ``zstd-1+shuffle``, ``zstd-3+shuffle``, ``zstd-1+shuffle-mt``,
  ``preset+shuffle`` (the server's default): this package's ``write_capture`` into memory (codec
  ``none`` / zstd level or the activation preset / byte-shuffle / libzstd worker threads), from
  host tensors.
- ``fp8-raw``, ``fp8-preset+shuffle``: ``--capture-dtype fp8``: quantized where the tensors are
  (on the GPU when there is one), copied to the host, written; ``min_row_cos`` against bf16.

Prints one markdown table (MB/s of bf16 input, us/token, bytes/token on the wire or disk, speed
against sglang-json) and writes the rows as JSON.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import platform
import sys
import time
from typing import Callable, Dict, List

import torch

from sglang_capture.core.format import Codec, write_capture
from sglang_capture.core.fp8 import dequantize, quantize


def activation_like(tokens: int, width: int, seed: int, device: str) -> torch.Tensor:
    """bf16 values shaped like a residual stream: per-channel scales, t-ish tails, massive channels."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = torch.exp(torch.randn(width, generator=g, device=device) * 0.7)
    x = torch.randn(tokens, width, generator=g, device=device)
    x = x * (1 + 0.5 * torch.randn(tokens, width, generator=g, device=device).abs()) * scale
    x[:, :4] *= 80.0  # a few "massive activation" channels
    return x.to(torch.bfloat16)


def best_of(fn: Callable[[], int], repeat: int) -> tuple:
    best, out = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def sglang_json(aux: torch.Tensor, last: torch.Tensor) -> int:
    import orjson

    rows = torch.cat([aux, last], dim=-1)
    lists = rows.cpu().clone().tolist()
    for _ in range(2):  # scheduler -> detokenizer -> tokenizer manager, pickled each hop
        lists = pickle.loads(pickle.dumps(lists, protocol=pickle.HIGHEST_PROTOCOL))
    return len(orjson.dumps({"meta_info": {"hidden_states": lists}}, option=orjson.OPT_SERIALIZE_NUMPY))


def package_path(aux: torch.Tensor, last: torch.Tensor, codec: Codec) -> int:
    buf = io.BytesIO()
    tensors = {"aux_hidden_states": aux, "last_hidden_states": last}
    n, _ = write_capture(buf, {"rid": "bench"}, tensors, codec)
    return n


def package_fp8(aux_d: torch.Tensor, last_d: torch.Tensor, hidden: int, codec: Codec) -> int:
    """The fp8 path: quantize on the tensors' device, copy to the host, write."""
    tensors = {}
    for name, t in (("aux_hidden_states", aux_d), ("last_hidden_states", last_d)):
        q, scale = quantize(t, hidden)
        tensors[name], tensors[name + "_scale"] = q.cpu(), scale.cpu()
    n, _ = write_capture(io.BytesIO(), {"rid": "bench"}, tensors, codec)
    return n


def fp8_min_row_cos(t: torch.Tensor, hidden: int) -> float:
    q, scale = quantize(t, hidden)
    back = dequantize(q, scale, torch.float32)
    return torch.nn.functional.cosine_similarity(back, t.float(), dim=-1).min().item()


def d2h(aux: torch.Tensor, last: torch.Tensor, pinned: bool) -> int:
    total = 0
    for t in (aux, last):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        host.copy_(t, non_blocking=pinned)
        total += host.numel() * host.element_size()
    torch.cuda.synchronize()
    return total


CODECS = {
    "msgpack-raw": Codec("none", shuffle=False),
    "zstd-1": Codec("zstd", 1, shuffle=False),
    "zstd-1+shuffle": Codec("zstd", 1, shuffle=True),
    "zstd-3+shuffle": Codec("zstd", 3, shuffle=True),
    "zstd-1+shuffle-mt": Codec("zstd", 1, shuffle=True, threads=-1),
    "preset+shuffle": Codec("zstd", None, shuffle=True),
}
FP8_CODECS = {"fp8-raw": Codec("none", shuffle=False), "fp8-preset+shuffle": Codec("zstd", None, shuffle=True)}


def run(tokens: List[int], hidden: int, json_max: int, repeat: int) -> List[Dict]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rows: List[Dict] = []
    for T in tokens:
        aux_d = activation_like(T, 3 * hidden, 1, device)
        last_d = activation_like(T, hidden, 2, device)
        aux, last = aux_d.cpu(), last_d.cpu()
        raw = (aux.numel() + last.numel()) * 2
        cases: Dict[str, Callable[[], int]] = {}
        if T <= json_max:
            cases["sglang-json"] = lambda: sglang_json(aux_d, last_d)
        if cuda:
            cases["d2h-pinned"] = lambda: d2h(aux_d, last_d, True)
            cases["d2h-pageable"] = lambda: d2h(aux_d, last_d, False)
        for name, codec in CODECS.items():
            cases[name] = lambda c=codec: package_path(aux, last, c)
        for name, codec in FP8_CODECS.items():
            cases[name] = lambda c=codec: package_fp8(aux_d, last_d, hidden, c)
        fp8_cos = min(fp8_min_row_cos(aux_d, hidden), fp8_min_row_cos(last_d, hidden))
        json_s = None
        for name, fn in cases.items():
            s, nbytes = best_of(fn, 1 if name == "sglang-json" else repeat)
            json_s = s if name == "sglang-json" else json_s
            rows.append({"tokens": T, "hidden": hidden, "path": name, "seconds": s, "raw_bytes": raw,
                         "out_bytes": nbytes, "MB_per_s": raw / s / 1e6, "us_per_token": s / T * 1e6,
                         "bytes_per_token": nbytes / T, "speedup_vs_json": (json_s / s) if json_s else None,
                         "min_row_cos": fp8_cos if name.startswith("fp8") else None})
            print(f"  T={T} {name}: {raw / s / 1e6:,.0f} MB/s", file=sys.stderr, flush=True)
    return rows


def table(rows: List[Dict]) -> str:
    lines = ["| T | path | MB/s (bf16 in) | µs/token | bytes/token | ratio (raw/out) | × sglang-json |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["raw_bytes"] / r["out_bytes"] if not r["path"].startswith("d2h") else 1.0
        sp = f"{r['speedup_vs_json']:,.0f}×" if r["speedup_vs_json"] and r["path"] != "sglang-json" else "—"
        lines.append(f"| {r['tokens']} | {r['path']} | {r['MB_per_s']:,.0f} | {r['us_per_token']:,.1f} | "
                     f"{r['bytes_per_token']:,.0f} | {ratio:.2f} | {sp} |")
    return "\n".join(lines)


def main(argv: List[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--json-max-tokens", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = run([int(t) for t in a.tokens.split(",")], a.hidden, a.json_max_tokens, a.repeat)
    host = {"machine": platform.node(), "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    print(f"host: {host}")
    print(table(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"host": host, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
