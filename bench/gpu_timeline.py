"""Where a server's GPU time goes, from a torch profiler trace SGLang wrote (``/start_profile``).

    python bench/gpu_timeline.py TRACE.json.gz [TRACE2.json.gz ...]

For each trace (SGLang's ``*-TP-0.trace.json.gz``, GPU activities): the span from the first to the
last device activity; how much of it some kernel ran; the idle gaps between kernels, split by
whether the next kernel's launch came from the host after the gap began (the GPU waited for the
host: ``host_bound``) or was queued already (waiting on a copy or an event); device copies by
direction; the host's time in the CUDA calls that wait, pin or allocate device memory (synchronize,
host allocation, cudaMalloc / cudaFree); kernel time by the call that launched it (graph replays:
decode steps, and the graph segments of prefills, which SGLang 0.5.17 runs in breakable graphs by
default on CUDA; single launches: what runs between them, a prefill's attention among
them); graph launches and the interval between them; the
kernels taking most time. Two servers'
traces of the same load side by side say whether capture's extra step time is on the device or on
the host (issue 51). Prints one JSON object per trace, keyed by path; standard library only.
"""
from __future__ import annotations

import collections
import gzip
import json
import statistics
import sys
from typing import Any, Dict, List, Tuple

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaStreamWaitEvent")
PINS = ("cudaHostAlloc", "cudaMallocHost", "cudaHostRegister", "cudaFreeHost", "cudaHostUnregister")
# device allocations: each cudaFree waits for the whole device (the caching allocator frees only when
# an allocation cannot be met, after a retry), which would stall the overlap schedule
DEVICE_ALLOCS = ("cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync")
GAP_US = 20.0  # shorter gaps between kernels are launch latency, not waiting


def _events(path: str) -> List[Dict[str, Any]]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        doc = json.load(f)
    return [e for e in (doc.get("traceEvents", doc) if isinstance(doc, dict) else doc)
            if e.get("ph") == "X" and "dur" in e]


def _union(spans: List[Tuple[float, float, Dict[str, Any]]]) -> List[Tuple[float, float, Dict[str, Any], Dict[str, Any]]]:
    """Merged busy intervals: (start, end, first event, last event)."""
    out: List[Tuple[float, float, Dict[str, Any], Dict[str, Any]]] = []
    for a, b, e in sorted(spans, key=lambda s: s[0]):
        if out and a <= out[-1][1]:
            s, t, first, last = out[-1]
            out[-1] = (s, max(t, b), first, e if b >= t else last)
        else:
            out.append((a, b, e, e))
    return out


def summarize(path: str) -> Dict[str, Any]:
    """One trace's summary (times in ms)."""
    events = _events(path)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    if not device:
        return {"error": "no device activity in the trace (profiled without GPU activities?)"}
    launches = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    kernels = [e for e in device if e["cat"] == "kernel"]
    t0 = min(e["ts"] for e in device)
    t1 = max(e["ts"] + e["dur"] for e in device)
    busy = _union([(e["ts"], e["ts"] + e["dur"], e) for e in kernels])
    gaps: List[float] = []
    host_bound: Dict[str, List[float]] = collections.defaultdict(list)  # by the call that launched the next kernel
    for (_, end, _, _), (start, _, after, _) in zip(busy, busy[1:]):
        gap = start - end
        if gap < GAP_US:
            continue
        gaps.append(gap)
        launch = launches.get(after.get("args", {}).get("correlation"))
        if launch is not None and launch["ts"] > end:  # idle from the gap's start until the host launched it
            host_bound[launch["name"]].append(min(gap, launch["ts"] - end))
    gaps_sorted = sorted(gaps)
    copies: Dict[str, List[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in device:
        if e["cat"] == "gpu_memcpy":
            c = copies[e["name"][:48]]
            c[0] += 1
            c[1] += e["dur"]
            c[2] += float(e.get("args", {}).get("bytes", 0) or 0)
    calls: Dict[str, List[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in runtime:
        if e["name"] in WAITS + PINS + DEVICE_ALLOCS or e["name"] in ("cudaGraphLaunch", "cudaLaunchKernel", "cudaMemcpyAsync"):
            calls[e["name"]][0] += 1
            calls[e["name"]][1] += e["dur"]
    graphs = sorted(e["ts"] for e in runtime if e["name"] == "cudaGraphLaunch")
    intervals = [b - a for a, b in zip(graphs, graphs[1:])]
    by_kernel: Dict[str, float] = collections.Counter()
    # kernel time by the call that launched it: graph replays are decode steps and prefills' graph
    # segments (breakable prefill graphs), single launches what runs between them (a prefill's attention)
    by_launch: Dict[str, float] = collections.Counter()
    for e in kernels:
        by_kernel[e["name"][:80]] += e["dur"]
        launch = launches.get(e.get("args", {}).get("correlation"))
        by_launch[launch["name"] if launch is not None else "?"] += e["dur"]
    streams: Dict[str, float] = collections.Counter()
    for e in device:
        streams[str(e.get("args", {}).get("stream", "?"))] += e["dur"]
    span = t1 - t0
    busy_us = sum(b - a for a, b, _, _ in busy)
    return {
        "span_ms": round(span / 1e3, 2),
        "kernel_busy_ms": round(busy_us / 1e3, 2),
        "kernel_busy_share": round(busy_us / span, 4),
        "gaps": {"count": len(gaps), "total_ms": round(sum(gaps) / 1e3, 2),
                 "p50_us": round(gaps_sorted[len(gaps) // 2], 1) if gaps else 0,
                 "largest_us": [round(g, 1) for g in gaps_sorted[-8:][::-1]],
                 "host_bound": {k: {"count": len(v), "ms": round(sum(v) / 1e3, 2)} for k, v in host_bound.items()}},
        "copies": {k: {"count": int(n), "ms": round(d / 1e3, 3), "mb": round(b / 1e6, 1)} for k, (n, d, b) in copies.items()},
        "cuda_calls": {k: {"count": int(n), "ms": round(d / 1e3, 2)} for k, (n, d) in sorted(calls.items())},
        "kernel_ms_by_launch": {k: round(v / 1e3, 2) for k, v in sorted(by_launch.items())},
        "graph_launches": len(graphs),
        "graph_interval_ms": {"mean": round(statistics.fmean(intervals) / 1e3, 3) if intervals else None,
                              "p50": round(sorted(intervals)[len(intervals) // 2] / 1e3, 3) if intervals else None},
        "stream_busy_ms": {k: round(v / 1e3, 2) for k, v in sorted(streams.items(), key=lambda kv: -kv[1])[:6]},
        "kernels_top_ms": {k: round(v / 1e3, 2) for k, v in by_kernel.most_common(12)},
    }


def main(paths: List[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print(json.dumps({p: summarize(p) for p in paths}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
