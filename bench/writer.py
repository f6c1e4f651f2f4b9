"""Host-side ceiling of the capture writer: how many captured tokens/s the writer processes can
turn into published files, with no server and no GPU in the way.

    python bench/writer.py OUT.json [--tokens 2048] [--hidden 7168] [--files 24]
                           [--threads 4,8,12,16] [--codecs zstd+shuffle,zstd,none]
                           [--compress-threads 0] [--gil-hog 0,1] [--switch-interval-ms 1]
                           [--durability file,none] [--dtypes model,fp8] [--checksums xxh3_128,sha256]
                           [--dir /tmp/writer-bench]

Every configuration drives the package's real ``WriterPool`` (its supervisor's hand-off, assembly in a writer
process, encoding, hashing, temp file, flush (``--durability``), link, outcome record) with
``--files`` jobs of ``--tokens`` rows of activation-like bf16 (3 aux layers + final = 4 × hidden
columns), each first copied into the package's host pool (pinned when a GPU is present), as the
server's result copy does. ``--gil-hog 1`` adds a thread that runs pure Python without pause, the
way SGLang's scheduler thread does under load, to show what sharing the interpreter with it
costs. Single-thread rates of each stage (shuffle, zstd, each checksum, write+fsync)
are measured first, so a configuration's rate can be read as a fraction of them. ``--dtypes fp8``
hands the writers rows packed as the server packs them for ``--capture-dtype fp8`` (core/fp8.py;
packed here on the host, on the GPU in the server). Each run reports bytes per token on disk and
the writer processes' CPU per GB/s of raw bf16 capture (host cores per GB/s).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from typing import Dict, List

import torch

from sglang_capture.core import checksum
from sglang_capture.core import format as capture_format
from sglang_capture.core.capture_dir import prepare_capture_dir
from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.format import Codec, byte_planes, compressor_for, host_tensor
from sglang_capture.core.fp8 import pack, packed_layout
from sglang_capture.server.host_pool import HostPool
from sglang_capture.server.ledger import HostMemoryLedger
from sglang_capture.server.request_capture import RequestCapture
from sglang_capture.server.writer_pool import CaptureJob, WriterPool

# name -> (codec, shuffle, zstd level); level None is the package's default activation preset
CODEC_PRESETS = {"zstd+shuffle": ("zstd", True, None), "zstd": ("zstd", False, None),
                 "zstd1+shuffle": ("zstd", True, 1), "none": ("none", False, None)}


def activation_like(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 rows with the statistics that matter to zstd: mostly small values, a few large columns."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 0.6
    x[:, torch.randint(0, cols, (max(1, cols // 512),), generator=g)] *= 40.0
    out = x.to(torch.bfloat16)
    return out.pin_memory() if torch.cuda.is_available() else out


def stage_rates(sample: torch.Tensor, tmpdir: str) -> Dict[str, float]:
    """GB/s of raw bf16 for each writer stage on one thread, measured on ``sample``."""
    n = sample.numel() * sample.element_size()
    rows = host_tensor(sample).array

    def rate(fn) -> float:
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return n / best / 1e9

    shuffled = byte_planes(rows, 2)
    comp = compressor_for(Codec()).compress(shuffled)
    path = os.path.join(tmpdir, "stage.bin")

    def write_fsync() -> None:
        with open(path, "wb") as f:
            f.write(comp)
            f.flush()
            os.fsync(f.fileno())

    rates = {
        "copy_rows": rate(lambda: torch.empty_like(sample).copy_(sample)),
        "shuffle": rate(lambda: byte_planes(rows, 2)),
        "zstd_preset_shuffled": rate(lambda: compressor_for(Codec()).compress(shuffled)),
        "zstd1_shuffled": rate(lambda: compressor_for(Codec(level=1)).compress(shuffled)),
        "zstd1_unshuffled": rate(lambda: compressor_for(Codec(level=1)).compress(byte_planes(rows, 0))),
        **{f"{c}_of_compressed": rate(lambda c=c: checksum.of_bytes(comp, c)) * len(comp) / n for c in checksum.CHECKSUMS},
        "write_fsync_compressed": rate(write_fsync) * len(comp) / n,
    }
    os.unlink(path)
    return {k: round(v, 3) for k, v in rates.items()}


def gil_hog(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x = (x + i * i) % 1000003


def _writers_cpu_s(writer: WriterPool) -> float:
    """CPU seconds the running writer processes have used so far (their start-up included)."""
    total = 0.0
    for pid in writer.writer_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):  # gone, or not Linux: counted as nothing
            pass
    return total


def run_config(sources: List[torch.Tensor], files: int, tokens: int, hidden: int, threads: int, codec: str,
               compress_threads: int, hog: bool, switch_ms: float, durability: str, base_dir: str,
               dtype: str = "model", checksum_algorithm: str = checksum.DEFAULT_CHECKSUM) -> Dict:
    name, shuffle, level = CODEC_PRESETS[codec]
    d = tempfile.mkdtemp(dir=base_dir)
    cfg = CaptureConfig(capture_dir=d, codec=name, shuffle=shuffle, level=level, writers=threads,
                        compress_threads=compress_threads, max_pending_mb=1 << 20,
                        switch_interval_ms=switch_ms, durability=durability, checksum=checksum_algorithm)
    default_interval = sys.getswitchinterval()
    prepare_capture_dir(d)
    ledger = HostMemoryLedger(cfg.max_pending_bytes)
    per_file = tokens * 4 * hidden * 2
    pool = HostPool(min(files, 2 * threads) * (per_file + (1 << 20)), pin=torch.cuda.is_available())
    writer = WriterPool(cfg, ledger)
    t_start = time.monotonic()
    writer.start(pool)
    splits, dtypes = {"aux_hidden_states": (0, 3 * hidden), "last_hidden_states": (3 * hidden, 4 * hidden)}, {}
    if dtype == "fp8":
        splits, dtypes = packed_layout(splits, hidden, 4 * hidden)
        sources = [pack(src, hidden) for src in sources]
    stop = threading.Event()
    hog_thread = threading.Thread(target=gil_hog, args=(stop,), daemon=True) if hog else None
    if hog_thread:
        hog_thread.start()
    faults0 = sum(resource.getrusage(who).ru_minflt for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    while len(writer.writer_pids()) < threads and time.monotonic() - t_start < 60:
        time.sleep(0.01)  # every writer process up, so that their start-up is not counted below
    cpu0 = _writers_cpu_s(writer)
    t0 = time.monotonic()
    for i in range(files):
        cap = RequestCapture(rid=f"r{i}", name=f"bench-{i}", ledger=ledger)
        while (rows := pool.take(sources[i % len(sources)])) is None:
            time.sleep(0.001)  # the pool is full: wait for the writers, as the server does
        cap.add(0, rows)
        del rows
        writer.submit(CaptureJob(cap, tokens, splits, list(range(tokens)), [0], {"rid": f"r{i}"}, dtypes=dtypes))
    while writer.pending():
        time.sleep(0.005)
    wall = time.monotonic() - t0
    writer_cpu_s = _writers_cpu_s(writer) - cpu0
    stats = writer.counters()  # the supervisor's, before it stops
    stop.set()
    writer.close()
    faults = sum(resource.getrusage(who).ru_minflt for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) - faults0
    pool.close()
    sys.setswitchinterval(default_interval)
    shutil.rmtree(d)
    os.sync()  # no dirty pages from this configuration left to slow the next one down
    raw = files * tokens * 4 * hidden * 2
    n = max(stats["written"], 1)
    return {"threads": threads, "codec": codec, "dtype": dtype, "checksum": checksum_algorithm,
            "compress_threads": compress_threads, "gil_hog": hog,
            "disk_bytes_per_token": round(stats["bytes"] / (files * tokens)),
            "writer_cores_per_gb_s": round(writer_cpu_s / (raw / 1e9), 2),
            "durability": durability, "flushes": 2 * files if durability == "file" else 0,
            "switch_interval_ms": switch_ms or default_interval * 1000, "files": files, "failed": stats["failed"], "wall_s": round(wall, 3),
            "tok_per_s": round(files * tokens / wall), "raw_gb_per_s": round(raw / wall / 1e9, 3),
            "ratio": round(stats["raw_bytes"] / max(stats["bytes"], 1), 3), "minor_faults_per_file": faults // files,
            "ms_per_file": {k[:-2]: round(stats[k] / n * 1e3) for k in
                            ("queue_wait_s", "assemble_s", "encode_write_s", "fsync_publish_s")}}


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--files", type=int, default=24)
    p.add_argument("--threads", default="4,8,12,16")
    p.add_argument("--codecs", default="zstd+shuffle,zstd,none")
    p.add_argument("--compress-threads", default="0")
    p.add_argument("--gil-hog", default="0,1")
    p.add_argument("--switch-interval-ms", default="1", help="0 = Python's default (5 ms)")
    p.add_argument("--durability", default="file", help="comma-separated: file, none")
    p.add_argument("--dtypes", default="model", help="comma-separated: model (bf16), fp8")
    p.add_argument("--checksums", default=checksum.DEFAULT_CHECKSUM, help="comma-separated: " + ", ".join(checksum.CHECKSUMS))
    p.add_argument("--dir", default=None, help="where files are written (default: a temp dir)")
    a = p.parse_args(argv)
    base = a.dir or tempfile.mkdtemp(prefix="writer-bench-")
    os.makedirs(base, exist_ok=True)
    sources = [activation_like(a.tokens, 4 * a.hidden, seed) for seed in range(4)]
    res: Dict = {"config": {**vars(a), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "bytes_per_token_raw": 4 * a.hidden * 2},
                 "stage_rates_gb_per_s": stage_rates(sources[0], base), "runs": []}
    print("single-thread stage rates (GB/s of raw bf16):", res["stage_rates_gb_per_s"], file=sys.stderr, flush=True)
    grid = itertools.product([bool(int(h)) for h in a.gil_hog.split(",")], a.codecs.split(","),
                             [int(c) for c in a.compress_threads.split(",")],
                             [float(x) for x in a.switch_interval_ms.split(",")], a.durability.split(","),
                             [int(t) for t in a.threads.split(",")], a.dtypes.split(","), a.checksums.split(","))
    for hog, codec, ct, sw, dur, threads, dtype, cs in grid:
        r = run_config(sources, a.files, a.tokens, a.hidden, threads, codec, ct, hog, sw, dur, base, dtype, cs)
        r["frame_mb"] = capture_format.FRAME_BYTES >> 20
        res["runs"].append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(report(res))
    return 0


def report(res: Dict) -> str:
    rows = ["| dtype | codec | checksum | frame MB | durability | flushes | writers | zstd threads | GIL hog | switch ms | tok/s "
            "| raw GB/s | bytes/token on disk | ratio | writer cores per GB/s | ms/file: assemble / encode+write / flush+publish "
            "| minor faults/file |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        ms = r["ms_per_file"]
        rows.append(f"| {r['dtype']} | {r['codec']} | {r.get('checksum', 'sha256')} | {r['frame_mb']} | {r['durability']} | "
                    f"{r['flushes']} | {r['threads']} | "
                    f"{r['compress_threads']} | {'yes' if r['gil_hog'] else 'no'} | {r['switch_interval_ms']:g} | "
                    f"{r['tok_per_s']:,} | {r['raw_gb_per_s']:.2f} | {r['disk_bytes_per_token']:,} | {r['ratio']:.2f} | "
                    f"{r['writer_cores_per_gb_s']:.2f} | "
                    f"{ms['assemble']} / {ms['encode_write']} / {ms['fsync_publish']} | {r['minor_faults_per_file']:,} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
