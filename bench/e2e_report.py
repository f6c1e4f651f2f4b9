"""bench/e2e.py's results: merging windows, saving e2e.json, the markdown report and the verdicts."""
from __future__ import annotations

import json
import os
import statistics
from typing import Dict, List, Optional

import pyspy_summary


def save(res: Dict, out: str, latest: Optional[Dict] = None) -> None:
    """Write OUT/e2e.json: the results so far, plus the measurement just taken (not yet merged)."""
    tmp = os.path.join(out, "e2e.json.tmp")
    with open(tmp, "w") as f:
        json.dump({**res, "_latest": latest} if latest else res, f, indent=1)
    os.replace(tmp, os.path.join(out, "e2e.json"))


def finish(res: Dict, out: str) -> int:
    save(res, out)
    print(report(res))
    return 0


def _clock_delta(before: Dict, after: Dict) -> Dict:
    """The scheduler thread's seam accounts (sglang_capture.server.seam_clock) over one window."""
    out = {}
    for k, v in after.items():
        calls = v["calls"] - before.get(k, {}).get("calls", 0)
        s = v["s"] - before.get(k, {}).get("s", 0.0)
        if calls > 0:
            out[k] = {"calls": calls, "s": round(s, 4), "us_per_call": round(1e6 * s / calls, 1)}
    return out


def merge(parts: List[Dict]) -> Dict:
    """One result from several windows of the same load: tokens/s over their summed time."""
    out: Dict = {"_peak_rss_bytes": max(p.get("_peak_rss_bytes", 0) for p in parts),
                 "_cpu": [p.get("_cpu") for p in parts], "_gpu": [p.get("_gpu") for p in parts],
                 "_prefill_batches": [p.get("_prefill_batches") for p in parts]}
    if "_writer" in parts[-1]:
        out["_writer"] = parts[-1]["_writer"]  # its counters add up over the server's life
    clocks = [p["_scheduler_thread"] for p in parts if "_scheduler_thread" in p]
    if clocks:
        out["_scheduler_thread"] = _clock_delta({}, {k: {"calls": sum(c.get(k, {}).get("calls", 0) for c in clocks),
                                                        "s": sum(c.get(k, {}).get("s", 0.0) for c in clocks)}
                                                    for k in sorted({k for c in clocks for k in c})})
    for kind in parts[0]:
        if kind.startswith("_"):
            continue
        rs = [p[kind] for p in parts]
        m = {k: sum(r[k] for r in rs) for k in ("requests", "failed", "capture_ok", "tokens", "seconds", "bytes_on_disk")}
        m.update(tok_per_s=m["tokens"] / m["seconds"], p50_s=statistics.median(r["p50_s"] for r in rs),
                 p99_s=max(r["p99_s"] for r in rs))
        out[kind] = m
    return out


def _paired_ratios(a_windows: List[float], d_windows: List[float]) -> List[float]:
    """Each (d) window against the mean of the (a) windows just before and after it."""
    if len(a_windows) != len(d_windows) + 1:
        return []
    return [d / ((a_windows[i] + a_windows[i + 1]) / 2) for i, d in enumerate(d_windows)]


def _bracketed(ratios: List[float]) -> str:
    """The report's words for ``_paired_ratios`` (nothing when there are none)."""
    if not ratios:
        return ""
    return (f" (each window against the (a) windows around it: {', '.join(f'{r:.3f}' for r in ratios)}; "
            f"median {statistics.median(ratios):.3f})")


def _mixed_order(mode: str) -> tuple:
    """Mixed-load modes grouped by rate, each group in run order: a, d, variants, a again."""
    base, _, rate = mode.partition("@")
    rank = {"a_mixed": 0, "b_mixed": 1}.get(base, 2)
    return (-float(rate or "inf"), rank, base)


def _modes(res: Dict) -> List[str]:
    modes = ["a_plain", "b_launcher_idle", "b_prefill", "d_prefill", *sorted(m for m in res if m.startswith("d_prefill_r")),
             "d_file_capture", "d_open_loop"]
    return modes + sorted((m for m in res if m.startswith(("a_mixed", "b_mixed", "d_mixed"))), key=_mixed_order) + ["c_json"]


def _tok(res: Dict, mode: str, kind: str) -> Optional[float]:
    return (res.get(mode) or {}).get(kind, {}).get("tok_per_s")


def _table_rows(res: Dict, modes: List[str]) -> List[str]:
    cfg = res["config"]
    bpt = cfg["bytes_per_token_raw"]
    rows = ["| mode | load | tok/s | raw capture GB/s | p50 s | p99 s | on disk | ratio | peak RSS GB |",
            "|---|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        for kind, r in (res.get(mode) or {}).items():
            if kind.startswith("_"):
                continue
            cap = r["capture_ok"] * cfg["tokens"]
            gbs = cap * bpt / r["seconds"] / 1e9 if cap else 0
            ratio = f"{cap * bpt / r['bytes_on_disk']:.2f}" if r["bytes_on_disk"] else "—"
            rows.append(f"| {mode} | {kind} ({r['requests']} req, {r['failed']} failed) | {r['tok_per_s']:,.0f} | "
                        f"{gbs:.2f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['bytes_on_disk'] / 1e9:.2f} GB | {ratio} | "
                        f"{res[mode].get('_peak_rss_bytes', 0) / 1e9:.1f} |")
    return rows


def _capacity_checks(res: Dict) -> List[str]:
    """Closed-loop capacity, the open-loop stream, (d)/(c), and the idle launcher against plain."""
    cfg, checks = res["config"], []
    d, c = _tok(res, "d_file_capture", "capture"), _tok(res, "c_json", "json")
    a_, b = _tok(res, "a_plain", "prefill"), _tok(res, "b_launcher_idle", "prefill")
    if d:
        checks.append(f"(d) capacity, closed loop: {d:,.0f} tok/s >= 25,000: {'PASS' if d >= 25000 else 'MISS'}")
    o = (res.get("d_open_loop") or {}).get("capture-open")
    if o:
        offered = cfg["capture_rate"] * cfg["tokens"]
        growth = o["latency_last_quarter_s"] / max(o["latency_first_quarter_s"], 1e-9)
        ok = o["capture_ok"] == o["requests"] and o["completion_tok_per_s"] >= 0.95 * offered and growth <= 1.5
        checks.append(f"(d) sustains {offered:,.0f} tok/s offered (open loop): completed at {o['completion_tok_per_s']:,.0f} tok/s, "
                      f"{o['capture_ok']}/{o['requests']} ok, latency {o['latency_first_quarter_s']:.2f} -> "
                      f"{o['latency_last_quarter_s']:.2f} s (first -> last quarter): {'PASS' if ok else 'MISS'}")
    if d and c:
        checks.append(f"(d)/(c) = {d / c:,.0f}x >= 50x: {'PASS' if d / c >= 50 else 'MISS'}")
    bp, dp = _tok(res, "b_prefill", "prefill"), _tok(res, "d_prefill", "capture")
    if bp and dp:
        w = res.get("capture_ab_windows", [])
        per = _bracketed([x[1] / x[0] for x in w]) if len(w) > 1 else ""
        checks.append(f"capture server, every request capturing / nothing capturing (same load, alternating windows): "
                      f"{dp / bp:.3f}{per}")
        for i, params in enumerate(cfg.get("request_variants") or []):
            rp = _tok(res, f"d_prefill_r{i}", "capture")
            if rp:
                per_d = ", ".join(f"{x[2 + i] / x[1]:.3f}" for x in w if len(x) > 2 + i)
                checks.append(f"capture server, every request capturing with {json.dumps(params)}: / nothing capturing "
                              f"{rp / bp:.3f}, / capturing without it {rp / dp:.3f} (per round: {per_d})")
    if a_ and b:
        ab = res.get("ab_windows", [])
        per = _bracketed(_paired_ratios([w[0] for w in ab], [w[1] for w in ab[:-1]]))
        checks.append(f"(b)/(a) = {b / a_:.3f} over {len(ab)} alternating window pairs{per} "
                      f"(>= 0.97): {'PASS' if b / a_ >= 0.97 else 'MISS'}")
    return checks


def _mixed_checks(res: Dict, modes: List[str]) -> List[str]:
    """Each mixed-load window of a capture server against the plain server's windows around it."""
    cfg, checks = res["config"], []
    for m in [x for x in modes if x.startswith(("b_mixed", "d_mixed"))]:
        base, _, rate_tag = m.partition("@")
        a_key = "a_mixed" + (f"@{rate_tag}" if rate_tag else "")
        am, dm = _tok(res, a_key, "mixed-other"), _tok(res, m, "mixed-other")
        if not (am and dm):
            continue
        label = (f" [{cfg['variants'][int(base.split('_v')[1])]}]" if "_v" in base
                 else f" [{json.dumps(cfg['request_variants'][int(base.split('_r')[1])])} per request]" if "_r" in base else "")
        rate = float(rate_tag) if rate_tag else cfg["capture_rate"]
        per = _bracketed(_paired_ratios(res[a_key].get("_windows", []), res[m].get("_windows", [])))
        if base.startswith("b_mixed"):
            checks.append(f"mixed load on the capture server, nothing capturing: (b)/(a) = {dm / am:.3f}{per}")
            continue
        b_key = "b_mixed" + (f"@{rate_tag}" if rate_tag else "")
        bm = _tok(res, b_key, "mixed-other") if base == "d_mixed" else None
        if bm:
            pairs = zip(res[b_key].get("_windows", []), res[m].get("_windows", []), strict=False)
            per_b = ", ".join(f"{d_ / b_:.3f}" for b_, d_ in pairs)
            checks.append(f"mixed load on the capture server, stream capturing / the same stream not capturing: "
                          f"(d)/(b) = {dm / bm:.3f} (per round: {per_b})")
        checks.append(f"mixed load{label}, capture stream {rate * cfg['tokens']:,.0f} tok/s, requests not capturing, "
                      f"(d)/(a) = {dm / am:.3f}{per} (>= 0.95): {'PASS' if dm / am >= 0.95 else 'MISS'}")
        if dm / am < 0.95:
            checks.append("  " + mixed_bottleneck(res[a_key], res[m], (res.get("pyspy") or {}).get(base)))
    return checks


def load_tok_per_s(mode: Dict) -> float:
    """tok/s of a window or mode that ran one kind of load (its only key not starting with "_")."""
    return next(v["tok_per_s"] for k, v in mode.items() if not k.startswith("_"))


PREFILL_WINDOWS = ("a_plain", "b_launcher_idle", "b_prefill", "d_prefill", "d_file_capture")


def _batches(mode: Dict) -> List[Dict]:
    """A mode's per-window prefill-batch counts: a list for merged modes, one dict for a single window."""
    pb = mode.get("_prefill_batches") or []
    return [w for w in ([pb] if isinstance(pb, dict) else pb) if w]


def _cache_checks(res: Dict) -> List[str]:
    """The prefill windows' premise (no request reads the radix cache: every batch runs the same
    attention path), and prefix_ab: what one shared, cached prefix does to plain and capture windows."""
    checks = []
    pa = res.get("prefix_ab") or {}
    modes = {m: res[m] for m in (*PREFILL_WINDOWS, *(m for m in res if m.startswith("d_prefill_r"))) if m in res}
    modes.update({f"prefix_ab {m}": r for m, r in pa.items() if m != "b_prefill_shared"})  # the one window meant to hit
    hits = {m: sum(w["cached_tokens"] for w in _batches(r)) for m, r in modes.items()}
    if any(hits.values()):
        checks.append("radix-cache hits in prefill windows (their prompts were meant never to match): "
                      + ", ".join(f"{m} {n} tokens" for m, n in hits.items() if n))
    silent = [m for m, r in {**modes, **pa}.items() if not sum(w["batches"] for w in _batches(r))]
    if silent:
        checks.append("no 'Prefill batch' lines in the server's log for " + ", ".join(silent)
                      + ": cache hits were not counted there (SGLang's --log-level must be info)")
    if pa:
        tok = {name: load_tok_per_s(r) for name, r in pa.items()}
        share = {name: f"{sum(w['clean_batches'] for w in _batches(r))}/{sum(w['batches'] for w in _batches(r))} clean, "
                       f"{sum(w['cached_tokens'] for w in _batches(r))} cached tokens" for name, r in pa.items()}
        checks.append(f"prefix_ab, a shared prefix / the usual prompts: nothing capturing "
                      f"{tok['b_prefill_shared'] / tok['b_prefill']:.3f}, capturing {tok['d_prefill_shared'] / tok['d_prefill']:.3f}; "
                      f"capturing / nothing capturing: usual prompts {tok['d_prefill'] / tok['b_prefill']:.3f}, "
                      f"shared prefix {tok['d_prefill_shared'] / tok['b_prefill_shared']:.3f}")
        checks.append("prefix_ab batches: " + "; ".join(f"{name} {v}" for name, v in share.items()))
    return checks


def _writer_checks(res: Dict) -> List[str]:
    w = (res.get("d_file_capture") or {}).get("_writer") or {}
    if not w:
        return []
    n = max(w.get("written", 0), 1)
    return [f"writer: peak held {w.get('peak_held_bytes', 0) / 1e9:.2f} GB of cap {w.get('cap_bytes', 0) / 1e9:.2f} GB "
            f"({'PASS' if w.get('peak_held_bytes', 0) <= w.get('cap_bytes', 1) else 'OVER'}), max queue "
            f"{w.get('max_queue')}, back-pressure waits {w.get('back_pressure_waits')}",
            "writer stage ms/file (summed over threads): " + ", ".join(
                f"{k[:-2]} {w.get(k, 0) / n * 1e3:.0f}" for k in ("queue_wait_s", "assemble_s", "encode_write_s", "fsync_publish_s"))
            + f"; raw {w.get('raw_bytes', 0) / n / 1e6:.0f} MB/file, failed {w.get('failed')}"]


def report(res: Dict) -> str:
    """The markdown table of every mode, then the verdicts against the targets, then the attributions."""
    modes = _modes(res)
    return "\n".join(_table_rows(res, modes) + [""] + _capacity_checks(res) + _cache_checks(res) + _mixed_checks(res, modes)
                     + _writer_checks(res) + _clock_rows(res, modes)
                     + pyspy_summary.rows(res.get("pyspy") or {}))


def _window_mean(mode: Dict, section: str, key: str) -> Optional[float]:
    """The mean of one ``_cpu``/``_gpu`` figure over a mode's windows (None where none has it)."""
    values = [w[key] for w in mode.get(section) or [] if w and w.get(key) is not None]
    values = [v[0] if isinstance(v, list) else v for v in values]  # scheduler_top_threads_cores: the busiest
    return statistics.fmean(values) if values else None


def mixed_bottleneck(a: Dict, d: Dict, spy: Optional[Dict] = None) -> str:
    """For a missed mixed-load target: which stage limited the requests that do not capture, from
    the windows' own measurements, and what would lift it.

    The GPU when it was >= 90% busy under plain SGLang; otherwise SGLang's scheduler thread when its
    busiest thread used >= 0.8 of a core (the GPU waited for it); otherwise neither saturated, and
    the load generator or the host is suspect. The capture server's extra load on the host (the
    writer processes) and, when py-spy sampled it, the package's own share of that thread follow.
    """
    gpu_a, gpu_d = _window_mean(a, "_gpu", "util_pct"), _window_mean(d, "_gpu", "util_pct")
    thread_a, thread_d = (_window_mean(x, "_cpu", "scheduler_top_threads_cores") for x in (a, d))
    host_a, host_d = _window_mean(a, "_cpu", "host_busy_pct"), _window_mean(d, "_cpu", "host_busy_pct")
    writers = _window_mean(d, "_cpu", "writer_processes_cores")
    if None in (gpu_a, thread_a, thread_d):
        return "bottleneck: not measured in these windows (no GPU or CPU samples)"
    if gpu_a >= 90:
        stage = "the GPU"
    elif thread_a >= 0.8:
        stage = "SGLang's scheduler thread"
    else:
        stage = "neither the GPU nor the scheduler thread (check the load generator's cores)"
    text = (f"bottleneck: {stage} (GPU {gpu_a:.0f}% busy in (a), {gpu_d or 0:.0f}% in (d); scheduler thread "
            f"{thread_a:.2f} / {thread_d:.2f} cores)")
    if writers is not None and host_a is not None and host_d is not None:
        text += f"; the writer processes used {writers:.1f} cores beside it (host {host_a:.0f}% -> {host_d:.0f}% busy)"
    own = ((spy or {}).get("frames") or {}).get("[sglang_capture]")
    if own:
        text += f"; the package's own code took {own['wall_pct']}% of the scheduler thread's wall time (py-spy)"
    if stage != "the GPU":
        text += (". Busy cores elsewhere slow that thread on a shared host (bench/RESULTS.md, r27: plain SGLang beside "
                 "five busy processes); what lifts it is fewer of them: a host with cores to spare, or fewer writer cycles "
                 "per byte (--capture-codec none)")
    return text


def _clock_rows(res: Dict, modes: List[str]) -> List[str]:
    """The capture server's scheduler thread per seam: µs per call, for batches that capture or not."""
    clocked = [m for m in modes if (res.get(m) or {}).get("_scheduler_thread")]
    if not clocked:
        return []
    seams = sorted({k for m in clocked for k in res[m]["_scheduler_thread"]})
    rows = ["", "| scheduler thread, µs per call (calls) | " + " | ".join(seams) + " |", "|---" * (len(seams) + 1) + "|"]
    for m in clocked:
        c = res[m]["_scheduler_thread"]
        rows.append(f"| {m} | " + " | ".join(f"{c[k]['us_per_call']:,.0f} ({c[k]['calls']})" if k in c else "—" for k in seams) + " |")
    return rows
