"""Multi-turn chat traffic (issue 50): what capture costs a server whose requests re-send their history.

    python bench/gpu_sessions.py MODEL_DIR OUT_DIR [--sessions 64] [--turns 8] [--system 1024] [--user 128]
                                [--answer 64] [--think 0] [--rounds 2] [--servers on,off] [--sglang-args "..."]

The load, closed loop: ``--sessions`` chats at once, each ``--turns`` turns; every chat opens with the
same ``--system`` token system prompt; each turn adds ``--user`` new tokens and the model answers
``--answer`` tokens (ignore_eos); every turn sends the whole history as ``input_ids``, ``--think``
seconds after the last answer (a user reading and typing). A pass is every chat's every turn; its
rate is requests per second over the pass.

One launcher server per ``--servers`` entry, all on the GPU at once: ``on`` (``--capture-prefix-sharing on``)
and ``off`` (as before sharing: every capture computes and stores its whole sequence). On each, in
alternating windows of one pass each (``none``, then ``capture``, ``--rounds`` times), with new chats each
window (the system prompt is the same for all): ``none`` sends plain requests, ``capture`` asks every
request for capture (``custom_params.capture``: the response waits for its file, so the next turn can
reuse it). Per window: pass time, requests/s, the writer stats' deltas (rows stored and reused, block
and file bytes), the unique tokens of the window's chats. Then ``--check`` chats of the last ``on``
capture window are captured again whole on the ``off`` server, prefill only, and compared row by row
(0.1st-percentile cosine per column block: each aux layer and the final state).

Production traffic as the operator captures it: ``--servers plain,fraction`` adds a launcher that
selects nothing (``plain``) and one with ``--capture-fraction 1`` (``fraction``: every request is
captured, responses do not wait for files), both with sharing on, in alternating windows of plain
requests; their summary is under ``fraction``.

Every window records the GPU's busy share (``gpu``, from nvidia-smi where there is one), and a
capturing window, and a ``plain`` server's window, the scheduler thread's time in the patched seams
(``seams``: calls, microseconds a call and of them the thread's CPU, per seam, for batches that capture
or not, server/seam_clock.py, and per generation of garbage collections, `gc/gen0..2`; none for a
server's first window, whose counts would include the end of its warm-up). With
``--py-spy-seconds S``, py-spy samples the scheduler and HTTP processes of each server for S seconds
in its last-round window (summaries under ``pyspy``, named server-mode; raw files in OUT_DIR/pyspy):
where capture's host time goes on this decode-heavy load (issue 51). With ``--profile``, one more
window per server (not in the summary; the same chats on each) runs whole under SGLang's torch
profiler, GPU activities only; each trace (OUT_DIR/profile/NAME) is summarized under ``timeline``
(bench/gpu_timeline.py): whether capture's extra time is on the device or the GPU waiting for the
host (a window traced whole, not N steps, so both servers' traces hold the same turns).

Writes OUT_DIR/gpu_sessions.json (rewritten after every window) and prints a table.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shlex
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import e2e_probes  # bench/ is on sys.path: this script lives there
import gpu_timeline
import requests

from sglang_capture.core.capture_dir import writer_stats
from sglang_capture.core.config import CaptureConfig
from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.once import cache_dir
from sglang_capture.testbed.server import Server, capture_cmd, start_server, stop_server

TIMINGS = ("queue_wait_s", "assemble_s", "blocks_s", "encode_write_s", "fsync_publish_s")
COUNTED = ("written", "bytes", "block_bytes", "blocks_written", "blocks_reused", "rows_stored", "rows_shared",
           "rows_for_next_turn", "raw_bytes", "failed", "missing_blocks", "ahead_jobs", "parked", *TIMINGS)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def counters(docs: Dict[str, Dict[str, Any]]) -> Dict[str, float]:
    """The writer ranks' counters summed (``docs``: their stats files, settled: every answered request counted)."""
    out = {k: 0.0 for k in COUNTED}
    for doc in docs.values():
        for k in COUNTED:
            out[k] += doc.get(k, 0) or 0
    return out


def stored_rows(window: Dict[str, Any]) -> float:
    """Rows a capture window wrote to blocks: its files' own and the answers' last rows (a next
    turn's, server/answer_tail.py; records before it count none)."""
    delta = window["delta"]
    return delta["rows_stored"] + delta.get("rows_for_next_turn", 0)


class Chats:
    """The chats of one window: token ids drawn from a seed, the system prompt shared by all windows."""

    def __init__(self, a: argparse.Namespace, seed: int) -> None:
        self.a = a
        rng = random.Random(seed)
        self.system = [random.Random(0).randrange(100, a.vocab) for _ in range(a.system)]
        self.users = [[[rng.randrange(100, a.vocab) for _ in range(a.user)] for _ in range(a.turns)]
                      for _ in range(a.sessions)]


def run_chat(url: str, chats: Chats, s: int, capture: bool, name: str) -> Dict[str, Any]:
    a = chats.a
    history, last, errors, latencies, file_rows, computed = list(chats.system), None, [], [], 0, 0
    session = requests.Session()
    for t in range(a.turns):
        if t and a.think:
            time.sleep(a.think)
        history = history + chats.users[s][t]
        params: Dict[str, Any] = {"max_new_tokens": a.answer, "temperature": 0, "ignore_eos": True}
        if capture:
            params["custom_params"] = {"capture": True, "capture_name": f"{name}-s{s}-t{t}"}
        t0 = time.monotonic()
        r = session.post(url + "/generate", json={"input_ids": history, "sampling_params": params}, timeout=600)
        latencies.append(time.monotonic() - t0)
        r.raise_for_status()
        out = r.json()
        computed += len(history) - out["meta_info"].get("cached_tokens", 0)
        if capture:
            ref = out["meta_info"]["capture"]
            if ref["status"] != "ok":
                errors.append(ref.get("error", ref["status"]))
            else:
                file_rows += ref["rows"]
            last = ref
        history = history + out["output_ids"]
    session.close()
    return {"rows": len(history) - 1, "last": last, "errors": errors, "latencies": latencies, "file_rows": file_rows,
            "prefill_tokens": computed}


# The scheduler processes' counters of prefix sharing, summed over ranks: captures that waited at admission
# for another's prompt blocks, their owners, holds that timed out (server/prompt_holds.py); jobs that put
# blocks in flight, and captures admitted reusing rows in flight (server/shared_rows.py)
# the scheduler side's counters per window (None: every name its stats give, as the answers' last rows kept
# and why not, server/answer_tail.py)
SCHEDULER_COUNTED = {"prompt_holds": ("owners", "held", "timed_out"), "in_flight": ("jobs", "reused"),
                     "answer_tail": None}
# the CUDA caching allocator's counters in the scheduler process (server/writer_pool.py): a retry
# frees every cached block and synchronizes the device, and so does each cudaFree, stalling the
# overlap schedule; compared between a capturing server and one that captures nothing
ALLOCATOR_COUNTED = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def scheduler_counters(docs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, int]]:
    return {key: {k: sum((d.get(key) or {}).get(k, 0) for d in docs.values())
                  for k in (names or sorted({k for d in docs.values() for k in (d.get(key) or {})}))}
            for key, names in SCHEDULER_COUNTED.items()}


def allocator_counts(docs: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, int]]:
    """``ALLOCATOR_COUNTED`` summed over the ranks' stats files (pushed at most every STATS_PUSH_S),
    or None while a rank's file has none (no CUDA, or not pushed yet): never counts since start."""
    if not docs or any(not d.get("device_allocator") for d in docs.values()):
        return None
    return {k: sum(d["device_allocator"].get(k, 0) for d in docs.values()) for k in ALLOCATOR_COUNTED}


def allocator_delta(before: Optional[Dict[str, int]], after: Optional[Dict[str, int]]) -> Optional[Dict[str, int]]:
    """A window's allocator counts, or None when either end has none."""
    return None if before is None or after is None else {k: after[k] - before[k] for k in ALLOCATOR_COUNTED}


def seams_after(capture_dir: str, ended: float, wait_s: float = 3.0) -> Dict[str, Dict[str, Any]]:
    """The stats files of a server that captures nothing, once they hold its seams as of ``ended``
    (time.time()): its scheduler side pushes them within a push interval of their last change, so a
    file written a second after the load ended has them; a file that does not come within ``wait_s``
    had nothing newer to say."""
    deadline = time.monotonic() + wait_s
    while True:
        docs = writer_stats(capture_dir)
        if (docs and all(d.get("time", 0.0) >= ended + 1.0 for d in docs.values())) or time.monotonic() > deadline:
            return docs
        time.sleep(0.1)


def window(server: Server, chats: Chats, capture: bool, name: str, count: Optional[bool] = None,
           seams: bool = False) -> Dict[str, Any]:
    """One pass; ``capture``: every request asks for capture; ``count``: the writer counters' deltas
    (by default when ``capture``; a ``fraction`` server captures plain requests); ``seams``: the
    scheduler thread's seams alone, for a server that captures nothing (``plain``)."""
    a = chats.a
    count = capture if count is None else count
    docs = writer_stats(server.capture_dir, settled=True) if count or seams else {}
    before, clock_before, sched_before = counters(docs), e2e_probes.scheduler_clock(docs), scheduler_counters(docs)
    alloc_before = allocator_counts(docs)

    def chats_pass() -> List[Dict[str, Any]]:
        with ThreadPoolExecutor(a.sessions) as pool:
            return list(pool.map(lambda s: run_chat(server.url, chats, s, capture, name), range(a.sessions)))

    results, seconds, gpu_busy = e2e_probes.timed_with_gpu(chats_pass)
    lat = sorted(x for r in results for x in r["latencies"])
    out: Dict[str, Any] = {"seconds": round(seconds, 3), "requests": a.sessions * a.turns,
                           "requests_per_s": round(a.sessions * a.turns / seconds, 2),
                           "latency_p50_s": round(lat[len(lat) // 2], 4), "latency_p99_s": round(lat[int(len(lat) * 0.99)], 4),
                           "gpu": gpu_busy,
                           # prompt tokens the server computed (not from its radix cache): a capture's first turns
                           # compute the system prompt until one of them has stored it
                           "prefill_tokens": sum(r["prefill_tokens"] for r in results)}
    if count or seams:
        # a server that captures nothing writes no outcome records for ``settled`` to wait on
        docs = writer_stats(server.capture_dir, settled=True) if count else seams_after(server.capture_dir, time.time())
        # per seam account: the window's calls, microseconds a call and of them the thread's CPU (decode steps, ...)
        out["seams"] = e2e_probes.clock_deltas(clock_before, e2e_probes.scheduler_clock(docs)) if clock_before else None
        out["allocator"] = allocator_delta(alloc_before, allocator_counts(docs))
    if count:
        after = counters(docs)
        delta = {k: after[k] - before[k] for k in COUNTED}
        for key, now in scheduler_counters(docs).items():
            delta[key] = {k: now[k] - sched_before[key].get(k, 0) for k in now}
        # rows a chat needs (its last turn's, the system prompt's counted once per window) and those stored
        unique = a.system + sum(r["rows"] - a.system for r in results)
        out.update(delta=delta, unique_rows=unique, file_rows=sum(r["file_rows"] for r in results),
                   errors=sum(len(r["errors"]) for r in results),
                   first_errors=[e for r in results for e in r["errors"]][:3],
                   last_files=[r["last"]["path"] for r in results if r["last"] and r["last"]["status"] == "ok"])
    return out


def profile_window(server: Server, out_dir: str) -> None:
    """Start SGLang's torch profiler (GPU activities only: no CPU op tracing to slow the scheduler
    thread; CPU ones where the server runs on the CPU, whose trace then holds no device activity),
    writing under ``out_dir``; it runs until ``/stop_profile``."""
    device = requests.get(server.url + "/server_info", timeout=60).json().get("device", "cuda")
    os.makedirs(out_dir, exist_ok=True)
    r = requests.post(server.url + "/start_profile", timeout=120, json={
        "output_dir": out_dir, "activities": ["GPU" if device == "cuda" else "CPU"], "with_stack": False,
        "record_shapes": False})
    if r.status_code != 200:
        raise SystemExit(f"start_profile on {server.url}: {r.status_code} {r.text[:200]}")


def cosines(a_rows: Any, b_rows: Any, block: int) -> List[float]:
    """0.1st-percentile row cosine of each ``block``-column block."""
    import torch

    out = []
    for lo in range(0, a_rows.shape[1], block):
        c = torch.nn.functional.cosine_similarity(a_rows[:, lo:lo + block].float(), b_rows[:, lo:lo + block].float(), dim=-1)
        out.append(float(torch.quantile(c, 0.001)))
    return out


def check_rows(on_files: List[str], off: Server, n: int) -> Dict[str, Any]:
    """The last turn of ``n`` chats read through shared blocks against a private capture of the same tokens."""
    import sglang_capture

    worst: Optional[List[float]] = None
    for i, path in enumerate(on_files[:n]):
        d = sglang_capture.load(path)
        ids = d["input_ids"].tolist() + d["output_ids"].tolist()[:-1]
        r = requests.post(off.url + "/generate", timeout=600, json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 1, "custom_params": {"capture": True, "capture_name": f"check-{i}"}}}).json()
        p = sglang_capture.load(r["meta_info"]["capture"]["path"])
        h = d["hidden_size"]
        c = cosines(d["aux_hidden_states"], p["aux_hidden_states"], h) + cosines(d["last_hidden_states"],
                                                                                 p["last_hidden_states"], h)
        worst = c if worst is None else [min(x, y) for x, y in zip(worst, c)]
    return {"chats": min(n, len(on_files)), "p0_1_cos_per_column": worst}


def summarize(windows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per server: pass time capturing against not (sums over its rounds), and for the first capture
    window the rows and bytes stored against its chats' unique rows; the bytes those rows take in
    self-contained files are the ``off`` server's bytes per file row."""
    out: Dict[str, Any] = {}
    for name in sorted({w["pair"] for w in windows}):
        ws = [w for w in windows if w["pair"] == name]
        none = [w["seconds"] for w in ws if w["mode"] == "none"]
        cap = [w for w in ws if w["mode"] == "capture"]
        if none and cap:
            out[name] = {"capture_over_none": round(sum(none) / sum(w["seconds"] for w in cap), 4),
                         "none_s": none, "capture_s": [w["seconds"] for w in cap],
                         "none_prefill_tokens": [w.get("prefill_tokens") for w in ws if w["mode"] == "none"],
                         "capture_prefill_tokens": [w.get("prefill_tokens") for w in cap],
                         # every row written to blocks: the files' and the answers' last rows kept for next turns
                         "rows_stored_per_unique_row": round(stored_rows(cap[0]) / cap[0]["unique_rows"], 4)
                         if cap[0]["delta"]["rows_stored"] else None,
                         "file_rows_per_unique_row": round(cap[0]["file_rows"] / cap[0]["unique_rows"], 4),
                         "writer_s_per_file": {k: round(cap[0]["delta"][k] / max(cap[0]["delta"]["written"], 1), 4)
                                               for k in TIMINGS},
                         "errors": sum(w["errors"] for w in cap)}
    return out


def check_bytes(on_files: List[str], n: int, system: int) -> Dict[str, Any]:
    """What ``n`` chats' own rows take on disk (the blocks their last turn references past the shared
    system prompt, and their files) against the same rows in one self-contained file each, encoded as
    the server encodes files."""
    import io

    import sglang_capture
    from sglang_capture.core.blocks import block_relpath
    from sglang_capture.core.format import write_capture
    from sglang_capture.core.reader import block_refs, blocks_dir, load_records

    shared = alone = 0
    for path in on_files[:n]:
        meta, _ = load_records(path)
        names = {r.name for r in block_refs(meta, path) if r.start >= system}
        shared += sum(os.path.getsize(os.path.join(blocks_dir(path), block_relpath(b))) for b in names)
        chat = os.path.basename(path).rsplit("-t", 1)[0]  # its turns' files: <window>-s<chat>-t<turn>
        shared += sum(os.path.getsize(p) for p in glob.glob(os.path.join(os.path.dirname(path), chat + "-t*.capture.msgpack")))
        d = sglang_capture.load(path)
        buf = io.BytesIO()
        write_capture(buf, d["meta"], {k: d[k][system:] for k in ("aux_hidden_states", "last_hidden_states")},
                      CaptureConfig(capture_dir="/").codec_spec())
        alone += len(buf.getvalue())
    return {"chats": min(n, len(on_files)), "bytes": shared, "self_contained_bytes": alone,
            "ratio": round(shared / max(alone, 1), 4)}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--user", type=int, default=128)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--think", type=float, default=0.0, help="seconds between an answer and the next turn")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--off-rounds", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--check", type=int, default=8)
    ap.add_argument("--servers", default="on,off")
    ap.add_argument("--caps", default="/tmp/caps-sessions")
    ap.add_argument("--sglang-args", default="")
    ap.add_argument("--capture-args", default="")
    ap.add_argument("--py-spy-seconds", type=float, default=0.0,
                    help="sample each server's scheduler and HTTP processes this long in its last-round window")
    ap.add_argument("--profile", action="store_true",
                    help="one more window per server, the whole of it under SGLang's torch profiler")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    result: Dict[str, Any] = {"args": vars(a), "windows": [], "started": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def save() -> None:
        with open(os.path.join(a.out, "gpu_sessions.json"), "w") as f:
            json.dump(result, f, indent=1)

    servers: Dict[str, Server] = {}
    env = server_env(cache_dir())
    names = [s for s in a.servers.split(",") if s]

    def start(name: str) -> None:
        caps = os.path.join(a.caps, name)
        shutil.rmtree(caps, ignore_errors=True)
        os.makedirs(caps)
        sharing = ["--capture-prefix-sharing", name if name in ("on", "off") else "on"]
        selects = ["--capture-fraction", "1"] if name == "fraction" else []
        # --sglang-args last: on a CPU they override the test bed's small KV pool
        cmd = capture_cmd(a.model, caps, *sharing, *selects, *shlex.split(a.capture_args)) + shlex.split(a.sglang_args)
        t0 = time.monotonic()
        servers[name] = start_server(cmd, env, os.path.join(a.out, f"server-{name}.log"), caps)
        log(f"{name} up in {time.monotonic() - t0:.0f} s")

    try:
        threads = [threading.Thread(target=start, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if set(servers) != set(names):
            raise SystemExit("a server did not start (see its log)")
        seed = 1
        plan = [(name, name, mode, r) for name in names if name in ("on", "off")
                for r in range(a.rounds if name == "on" else a.off_rounds) for mode in ("none", "capture")]
        if {"plain", "fraction"} <= set(names):
            plan += [(name, "fraction", mode, r) for r in range(a.rounds)
                     for name, mode in (("plain", "none"), ("fraction", "capture"))]
        spied: Dict[str, Any] = {}
        seamed: set = set()  # servers whose first window is done
        for name, pair, mode, r in plan:
            last_round = r == (a.rounds if name in ("on", "plain", "fraction") else a.off_rounds) - 1
            spies = ([e2e_probes.py_spy_window(servers[name], f"{name}-{mode}" + suffix, a.py_spy_seconds,
                                               os.path.join(a.out, "pyspy"), spied, http=bool(suffix))
                      for suffix in ("", "-http")] if a.py_spy_seconds > 0 and last_round else [])
            w = window(servers[name], Chats(a, seed), mode == "capture" and name in ("on", "off"), f"{name}-w{seed}",
                       count=mode == "capture", seams=name == "plain")
            for spy in spies:
                spy.join()
            result["pyspy"] = spied.get("pyspy", {})
            if name not in seamed:  # a server's first window counts its warm-up's last steps too
                seamed.add(name)
                w["seams"] = None
            w.update(server=name, pair=pair, mode=mode, round=r, seed=seed)
            seed += 1
            result["windows"].append(w)
            save()
            log(f"{name} {mode} r{r}: {w['seconds']:.2f} s, {w['requests_per_s']} req/s"
                + (f", stored {stored_rows(w):.0f} rows of {w['unique_rows']} unique, "
                   f"{w['errors']} errors" if mode == "capture" else ""))
        if a.profile:
            result["timeline"] = {}
            for name in names:  # the same chats on each server (each has its own radix cache), traced whole
                out_dir = os.path.join(a.out, "profile", name)
                shutil.rmtree(out_dir, ignore_errors=True)
                profile_window(servers[name], out_dir)
                try:
                    w = window(servers[name], Chats(a, seed), name in ("on", "off"), f"{name}-profile", count=False)
                finally:  # SGLang writes the trace before it answers
                    r = requests.post(servers[name].url + "/stop_profile", timeout=600)
                    if r.status_code != 200:
                        log(f"stop_profile on {name}: {r.status_code} {r.text[:200]}")
                traces = glob.glob(os.path.join(out_dir, "*-TP-0*.trace.json*"))
                result["timeline"][name] = gpu_timeline.summarize(traces[0]) if traces else {"error": "no trace written"}
                result["timeline"][name]["window_s"] = w["seconds"]
                log(f"{name} profiled: {json.dumps(result['timeline'][name])[:300]}")
                save()
        on = [w for w in result["windows"] if w["server"] == "on" and w["mode"] == "capture"]
        if on and "off" in servers:
            result["rows"] = check_rows(on[-1]["last_files"], servers["off"], a.check)
        if on:
            result["bytes"] = check_bytes(on[0]["last_files"], a.check, a.system)
        result["summary"] = summarize(result["windows"])
        save()
        print(json.dumps({k: result.get(k) for k in ("summary", "rows", "bytes")}, indent=1))
        return 0
    finally:
        for s in servers.values():
            stop_server(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
