"""Could zstd run on the GPU? nvCOMP's zstd against the writers' CPU codec, on Kimi-width captures.

    python bench/gpu_codec.py [--tokens 8192] [--hidden 7168] [--chunk-kb 64,1024,4096,16384]
                              [--repeat 3] [--out FILE.json]

One capture's rows (aux [T, 3H] + final [T, H], activation-like bf16 as in serialization.py, and
the same rows as ``--capture-dtype fp8`` packs them) are cut into chunks of ``--chunk-kb``; each
chunk is byte-shuffled on the GPU (the layout ``core/format.byte_planes`` gives a frame), all
chunks are compressed in one nvCOMP batch with RAW bitstreams (plain zstd frames, no nvCOMP
header) and the compressed bytes are copied to the host. Every frame is then decoded with the
``zstandard`` package, as ``sglang_capture.load`` does, and compared with its input: the files
would need no GPU to read only if this holds.

Reported per chunk size and dtype: ratio, GB/s of raw input (shuffle + compress + copy of the
compressed bytes, synchronised), host CPU seconds per GB of raw input (this process's user + system
time over the timed loop: the host cores one GB/s of capture would keep busy), each stage's wall
and CPU time alone (the encode's wall bounds the GPU time it would take from a server's forward
passes), and the CPU path
(the writers' activation preset + shuffle, one thread, frames of 64 MB) on the same bytes. Issue
18's bar: at most 1 host core per GB/s, and worth it only if the ratio holds. Without nvCOMP (``pip
install nvidia-nvcomp-cu13``) or a GPU, the nvCOMP rows say why and the CPU rows still run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Callable, Dict, List, Tuple

import numpy
import torch
import zstandard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serialization import activation_like  # noqa: E402

from sglang_capture.core.format import FRAME_BYTES, Codec, compressor_for  # noqa: E402
from sglang_capture.core.fp8 import pack  # noqa: E402


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], object], repeat: int) -> Tuple[float, float, object]:
    """Best wall time and the CPU time of that run."""
    best = (float("inf"), 0.0, None)
    for _ in range(repeat):
        c0, t0 = cpu_seconds(), time.perf_counter()
        out = fn()
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        if wall < best[0]:
            best = (wall, cpu, out)
    return best


def shuffled_chunks(rows: torch.Tensor, chunk_bytes: int) -> List[torch.Tensor]:
    """Whole rows per chunk, each chunk's bytes split into byte planes (2 for bf16, 1 for fp8)."""
    row_bytes = rows.shape[1] * rows.element_size()
    per = max(1, chunk_bytes // row_bytes)
    out = []
    for i in range(0, rows.shape[0], per):
        block = rows[i:i + per].contiguous()
        b = block.view(torch.uint8).reshape(-1, block.element_size())
        out.append(b.t().contiguous().reshape(-1) if block.element_size() > 1 else b.reshape(-1))
    return out


def nvcomp_run(rows: torch.Tensor, chunk_kb: int, repeat: int) -> Dict:
    from nvidia import nvcomp

    codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW)
    raw = rows.numel() * rows.element_size()

    def encode(chunks):
        # nvCOMP 6: a batch is an nvcomp.BatchArray (as_arrays); encode() of one Array per call ran
        # at 0.01 GB/s on the H200 (r39: 2,048 Python calls per capture), so only the batch counts
        return list(codec.encode(nvcomp.as_arrays(chunks)))

    def to_host(frames) -> List[bytes]:
        """The frames in one device-to-host copy (one copy per frame costs a Python call each):
        concatenated on the device through DLPack, cut back into frames on the host."""
        try:
            parts = [torch.from_dlpack(f).view(torch.uint8).reshape(-1) for f in frames]
        except Exception:  # an nvCOMP without DLPack: per-frame copies, the slow path
            return [numpy.asarray(f.cpu()).tobytes() for f in frames]
        flat = memoryview(torch.cat(parts).cpu().numpy())
        ends = numpy.cumsum([p.numel() for p in parts]).tolist()
        return [flat[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]

    def once():
        chunks = shuffled_chunks(rows, chunk_kb << 10)
        host = to_host(encode(chunks))
        torch.cuda.synchronize()
        return chunks, host

    def stage(fn):
        """One stage alone between device synchronisations: its wall and host CPU seconds."""
        torch.cuda.synchronize()
        c0, t0 = cpu_seconds(), time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, {"wall_s": round(time.perf_counter() - t0, 4), "cpu_s": round(cpu_seconds() - c0, 4)}

    to_host(encode(shuffled_chunks(rows[:64], chunk_kb << 10)))  # warm-up
    wall, cpu, (chunks, host) = timed(once, repeat)
    # where the time goes: the encode's wall between synchronisations bounds the GPU time it takes
    # from the model's forward passes when both share the GPU
    split_chunks, shuffle_t = stage(lambda: shuffled_chunks(rows, chunk_kb << 10))
    frames, encode_t = stage(lambda: encode(split_chunks))
    _, copy_t = stage(lambda: to_host(frames))
    dec = zstandard.ZstdDecompressor()
    readable = all(dec.decompress(f, max_output_size=c.numel()) == bytes(c.cpu().numpy())
                   for f, c in zip(host, chunks, strict=True))
    size = sum(len(f) for f in host)
    return {"frames": len(host), "ratio": round(raw / size, 3), "bytes_per_token": round(size / rows.shape[0]),
            "gb_per_s": round(raw / wall / 1e9, 2), "host_cores_per_gb_s": round(cpu / (raw / 1e9), 3),
            "zstandard_reads_every_frame": readable, "stages": {"shuffle": shuffle_t, "encode": encode_t, "copy": copy_t},
            "encode_gpu_s_per_gb_at_most": round(encode_t["wall_s"] / (raw / 1e9), 3)}


def cpu_run(rows: torch.Tensor, repeat: int) -> Dict:
    host = rows.cpu()
    raw = host.numel() * host.element_size()
    chunks = [c.numpy().tobytes() for c in shuffled_chunks(host, FRAME_BYTES)]
    comp = compressor_for(Codec())

    wall, cpu, frames = timed(lambda: [comp.compress(c) for c in chunks], repeat)
    size = sum(len(f) for f in frames)
    return {"frames": len(frames), "ratio": round(raw / size, 3), "bytes_per_token": round(size / rows.shape[0]),
            "gb_per_s": round(raw / wall / 1e9, 2), "host_cores_per_gb_s": round(cpu / (raw / 1e9), 3)}


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--chunk-kb", default="64,1024,4096,16384")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = torch.cat([activation_like(a.tokens, 3 * a.hidden, 0, device), activation_like(a.tokens, a.hidden, 1, device)], -1)
    data = {"bf16": bf16, "fp8": pack(bf16, a.hidden)}
    results: List[Dict] = []
    for dtype, rows in data.items():
        results.append({"dtype": dtype, "codec": "cpu zstd preset+shuffle, 1 thread", **cpu_run(rows, a.repeat)})
        for kb in (int(k) for k in a.chunk_kb.split(",")):
            row = {"dtype": dtype, "codec": f"nvcomp zstd, {kb} KB chunks"}
            try:
                if device != "cuda":
                    raise RuntimeError("no GPU")
                row.update(nvcomp_run(rows, kb, a.repeat))
            except Exception as e:  # a missing or failing nvCOMP is a result here, not a crash
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            results.append(row)
            print(json.dumps(row), flush=True)
    print("| dtype | codec | ratio | bytes/token | GB/s raw | host cores per GB/s | zstandard reads it |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['dtype']} | {r['codec']} | {r['error']} |  |  |  |  |")
        else:
            print(f"| {r['dtype']} | {r['codec']} | {r['ratio']} | {r['bytes_per_token']:,} | {r['gb_per_s']} | "
                  f"{r['host_cores_per_gb_s']} | {r.get('zstandard_reads_every_frame', 'yes')} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"tokens": a.tokens, "hidden": a.hidden, "device": device, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
