"""Summarize a torch-profiler trace of an SGLang server (``/start_profile``) into a few numbers.

Where does a server's time go over the profiled forward steps: how busy the GPU is (kernels
and copies merged over all streams), the idle gaps between GPU work (the scheduler thread not
keeping up shows as gaps), the kernels that take the time, device-host copies, and the CUDA
runtime calls the CPU made (synchronizations and allocations stall the scheduler thread).

    python bench/trace_summary.py TRACE.json.gz [...]      # one JSON summary per trace
"""
from __future__ import annotations

import collections
import gzip
import json
import sys
from typing import Dict, Iterable, List, Tuple

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_US = 1000.0  # an idle stretch of the GPU this long is counted as a gap


def load(path: str) -> List[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return [e for e in doc.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _merged(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _top(durations: Dict[str, List[float]], n: int) -> List[dict]:
    rows = sorted(durations.items(), key=lambda kv: -sum(kv[1]))[:n]
    return [{"name": k[:90], "count": len(v), "total_ms": round(sum(v) / 1000, 2)} for k, v in rows]


def summarize(events: List[dict], steps: int = 0) -> Dict:
    """The summary of one trace's events (``steps``: forward steps profiled, for per-step figures)."""
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    out: Dict = {"events": len(events), "gpu_events": len(gpu)}
    if ops:  # CPU activity traced: which operators the scheduler thread spends its time in
        by_op: Dict[str, List[float]] = collections.defaultdict(list)
        for e in ops:
            by_op[e["name"]].append(e["dur"])
        out["cpu_ops_top"] = _top(by_op, 15)
        out["cpu_ops_over_1ms"] = _top({k: [d for d in v if d >= 1000] for k, v in by_op.items() if max(v) >= 1000}, 10)
    if runtime:
        by_call: Dict[str, List[float]] = collections.defaultdict(list)
        for e in runtime:
            by_call[e["name"]].append(e["dur"])
        out["cuda_runtime_top"] = _top(by_call, 12)
    if not gpu:
        return out
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    busy = _merged((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    busy_us = sum(b - a for a, b in busy)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:], strict=False)]
    big = [g for g in gaps if g >= GAP_US]
    kernels: Dict[str, List[float]] = collections.defaultdict(list)
    copies: Dict[str, Dict[str, float]] = collections.defaultdict(lambda: {"count": 0, "ms": 0.0, "bytes": 0})
    streams: Dict[str, float] = collections.defaultdict(float)
    for e in gpu:
        streams[str(e.get("args", {}).get("stream", e.get("tid")))] += e["dur"]
        if e["cat"] == "kernel":
            kernels[e["name"]].append(e["dur"])
        else:
            c = copies[e["name"]]
            c["count"] += 1
            c["ms"] += e["dur"] / 1000
            c["bytes"] += e.get("args", {}).get("bytes", 0) or 0
    span_ms = (t1 - t0) / 1000
    out.update({
        "span_ms": round(span_ms, 1),
        "steps": steps,
        "gpu_busy_pct": round(100 * busy_us / (t1 - t0), 1),
        "kernel_ms": round(sum(sum(v) for v in kernels.values()) / 1000, 1),
        "gaps_over_1ms": {"count": len(big), "total_ms": round(sum(big) / 1000, 1),
                          "max_ms": round(max(big) / 1000, 1) if big else 0.0},
        "stream_busy_ms": {k: round(v / 1000, 1) for k, v in sorted(streams.items(), key=lambda kv: -kv[1])[:6]},
        "kernels_top": _top(kernels, 15),
        "copies": {k: {"count": v["count"], "ms": round(v["ms"], 2), "GB_per_s": round(v["bytes"] / v["ms"] / 1e6, 1) if v["ms"] else None,
                       "MB": round(v["bytes"] / 1e6, 1)} for k, v in copies.items()},
    })
    if steps:
        out["span_ms_per_step"] = round(span_ms / steps, 2)
        out["kernel_ms_per_step"] = round(out["kernel_ms"] / steps, 2)
    return out


def main(argv: List[str]) -> int:
    for path in argv:
        print(json.dumps({"trace": path, **summarize(load(path))}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
