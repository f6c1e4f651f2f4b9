"""What capture costs SGLang's HTTP process per request (issue 51 item 2), against plain requests at the same rate.

    python bench/http_cost.py [--model PATH] [--rate 60] [--seconds 8] [--rounds 3] [--py-spy] [--out F.json]
    python bench/http_cost.py --waits [--rate 400] [--seconds 8] [--write-after 0.02]

Starts one capture launcher (``--model``: a tiny random Llama built for the CPU tests when not
given; on a GPU host SGLang picks the GPU) and sends it short ``/generate`` requests (16 prompt
tokens, 1 new token) open loop at ``--rate`` per second, in alternating windows of three kinds:
``plain`` (no capture), ``client`` (``custom_params.capture``: the answer waits for the file and
carries its reference) and ``operator`` (the server's own mark, as ``--capture-fraction`` sets it:
no wait, no reference). Per window: CPU seconds of the HTTP process (tokenizer manager, uvicorn,
the package's request and response hooks) per answered request, and the answers' latency. The
difference between a capture kind and ``plain`` is what the package adds to the HTTP process
(the writers' and the scheduler's work are other processes). ``--py-spy`` samples the HTTP
process in each kind's last window and reports the share of its on-CPU samples in package frames.
The same windows count the scheduler process's CPU per request by thread (issue 51 item 1: what
the scheduler process pays per capture): SGLang's scheduler thread, the package's threads there
(``sglang-capture-*``, named by ``py-spy dump``) and the rest (torch, ZMQ).

``--waits`` isolates the wait for the outcome record, without a server: responses start waiting at
``--rate`` per second while another process renames each one's record into ``.index/`` ``--write-after``
seconds later, as a writer does. For the inotify watch and for polling with backoff (the
watch's fallback, and what every wait did before it), it reports this process's CPU per wait and
how long after its record each wait ended.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import statistics
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

import aiohttp
import pyspy_summary
from e2e_probes import _py_spy as find_py_spy

from sglang_capture.core.capture_dir import DirFds, index_path, prepare_capture_dir, record_outcome
from sglang_capture.server.outcome_watch import OutcomeWatch
from sglang_capture.testbed.cpu import server_env
from sglang_capture.testbed.once import cache_dir
from sglang_capture.testbed.server import Server, capture_cmd, start_server, stop_server
from sglang_capture.testbed.tiny_models import build_all

KINDS = ("plain", "client", "operator")
PACKAGE = "/sglang_capture/"
LAUNCHERS = ("/sglang_capture/launch.py", "/sglang_capture/server/launch.py")  # the root of every HTTP-process stack


def stat_cpu_s(path: str) -> float:
    """CPU seconds (user + system) in a ``/proc`` stat file: a process's (all threads) or a thread's."""
    fields = open(path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of process ``pid``."""
    return stat_cpu_s(f"/proc/{pid}/stat")


def scheduler_pid(root: int) -> Optional[int]:
    """SGLang's scheduler process (``sglang::scheduler``) under the server ``root``."""
    import psutil

    for p in psutil.Process(root).children(recursive=True):
        if "scheduler" in p.name():
            return p.pid
    return None


def thread_groups(pid: int) -> Dict[int, str]:
    """The scheduler process's threads by native id: ``scheduler`` (its main thread), the package's
    threads by their Python names (``py-spy dump``), ``other`` for the rest (unnamed, native)."""
    groups = {int(tid): "other" for tid in os.listdir(f"/proc/{pid}/task")}
    groups[pid] = "scheduler"
    exe = find_py_spy()
    if exe is not None:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--json", "--nonblocking"], capture_output=True, text=True)
        for t in json.loads(out.stdout or "[]"):
            if t.get("os_thread_id") in groups and t["thread_name"].startswith("sglang-capture"):
                groups[t["os_thread_id"]] = t["thread_name"].rstrip("0123456789-")
    return groups


def threads_cpu_s(pid: int, groups: Dict[int, str]) -> Dict[str, float]:
    """CPU seconds so far of the process's threads, summed by ``groups`` (threads not in it: ``other``)."""
    out: collections.Counter = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[groups.get(int(tid), "other")] += stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # the thread ended meanwhile
            continue
    return dict(out)


def body(kind: str, i: int) -> Dict:
    params: Dict = {"max_new_tokens": 1, "temperature": 0}
    if kind == "client":
        params["custom_params"] = {"capture": True}
    elif kind == "operator":
        params["custom_params"] = {"capture": True, "capture_by": "operator"}
    return {"input_ids": [(i * 7 + k) % 500 + 10 for k in range(16)], "sampling_params": params}


async def window(url: str, kind: str, rate: float, seconds: float, first: int) -> Dict:
    """Open-loop requests at ``rate`` for ``seconds``; every answer awaited. Latencies in s."""
    lat: List[float] = []
    errors = collections.Counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(i: int) -> None:
            t0 = time.monotonic()
            async with session.post(url + "/generate", json=body(kind, i)) as r:
                doc = await r.json()
            if r.status != 200:
                errors[f"HTTP {r.status}"] += 1
            elif kind == "client" and doc["meta_info"].get("capture", {}).get("status") != "ok":
                errors[str(doc["meta_info"].get("capture"))[:120]] += 1
            else:
                lat.append(time.monotonic() - t0)

        tasks = []
        t0 = time.monotonic()
        n = int(rate * seconds)
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(first + i)))
        await asyncio.gather(*tasks)
    return {"requests": n, "answered": len(lat), "errors": dict(errors),
            "latency_p50_ms": round(1e3 * statistics.median(lat), 2) if lat else None,
            "latency_p99_ms": round(1e3 * sorted(lat)[int(0.99 * (len(lat) - 1))], 2) if lat else None}


def py_spy_share(pid: int, seconds: float, out: str) -> Optional[Dict]:
    """Start sampling the HTTP process (py-spy raw, all threads) into ``out``; None without py-spy."""
    exe = find_py_spy()
    if exe is None:
        return None
    p = subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", f"{seconds:g}", "--rate", "200",
                          "--nonblocking", "--threads", "--full-filenames", "--format", "raw", "-o", out],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return {"proc": p, "out": out}


def summarize_py_spy(path: str) -> Dict:
    """Share of the samples with a package frame (the launcher's root frame aside), and the top package leaves."""
    total = ours = 0
    leaves: collections.Counter = collections.Counter()
    for stacks in pyspy_summary.load(path).values():
        for frames, n in stacks.items():
            total += n
            mine = [f for f in frames if PACKAGE in f and not any(x in f for x in LAUNCHERS)]
            if mine:
                ours += n
                leaves[mine[-1].split(" (")[0] + " " + mine[-1].rsplit("/", 1)[-1]] += n
    return {"samples": total, "package_share": round(ours / total, 4) if total else None,
            "package_top": leaves.most_common(6)}


def _write_records(capture_dir: str, t0: float, rate: float, n: int, after: float) -> None:
    """Another process, as the writers: record ``i``'s outcome renamed in at ``t0 + i / rate + after``."""
    dirs = DirFds.open(capture_dir)
    for i in range(n):
        time.sleep(max(0.0, t0 + i / rate + after - time.monotonic()))
        record_outcome(dirs, f"w{i}", {"status": "ok", "bytes": i})


def waits(rate: float, seconds: float, after: float, inotify: bool) -> Dict:
    """``rate * seconds`` waits, their records written by another process ``after`` s after each starts."""
    capture_dir = tempfile.mkdtemp(prefix="http-cost-waits-")
    prepare_capture_dir(capture_dir)
    n = int(rate * seconds)
    t0 = time.monotonic() + 2.0  # the writer process starts (spawn) before its first record is due
    writer = multiprocessing.get_context("spawn").Process(target=_write_records, args=(capture_dir, t0, rate, n, after))
    writer.start()

    async def run() -> List[float]:
        watch = OutcomeWatch(asyncio.get_running_loop(), use_inotify=inotify)
        late: List[float] = []

        async def one(i: int) -> None:
            ref = await watch.wait({"index": index_path(capture_dir, f"w{i}")}, 30.0)
            # from when the writer process was due to rename the record in (it may be a little late itself)
            late.append(time.monotonic() - (t0 + i / rate + after) if ref["status"] == "ok" else float("inf"))

        tasks = []
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        watch.close()
        return late

    cpu0 = time.process_time()
    late = asyncio.run(run())
    cpu = time.process_time() - cpu0
    writer.join()
    late.sort()
    return {"waits": n, "inotify": inotify, "cpu_ms_per_wait": round(1e3 * cpu / n, 4),
            "ended_after_record_ms_p50": round(1e3 * late[n // 2], 2),
            "ended_after_record_ms_p99": round(1e3 * late[int(0.99 * (n - 1))], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--rate", type=float, default=60.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--py-spy", action="store_true")
    ap.add_argument("--launcher-args", default="", help="extra launcher options, one string")
    ap.add_argument("--waits", action="store_true", help="only the wait for outcome records, without a server")
    ap.add_argument("--write-after", type=float, default=0.02, help="--waits: s from a wait's start to its record")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.waits:
        res = {"write_after_s": args.write_after, "rate": args.rate,
               "windows": [waits(args.rate, args.seconds, args.write_after, inotify)
                           for _ in range(args.rounds) for inotify in (True, False)]}
        for w in res["windows"]:
            print(json.dumps(w), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    cache = cache_dir()
    model = args.model or build_all(os.path.join(cache, "models"))["tiny-llama"]
    work = tempfile.mkdtemp(prefix="http-cost-")
    os.makedirs(os.path.join(work, "captures"))
    cmd = capture_cmd(model, os.path.join(work, "captures"), *args.launcher_args.split())
    server: Server = start_server(cmd, server_env(cache), os.path.join(work, "server.log"),
                                  os.path.join(work, "captures"))
    res: Dict = {"rate": args.rate, "seconds": args.seconds, "windows": []}
    try:
        asyncio.run(window(server.url, "client", args.rate, 2.0, 10**6))  # warm-up
        sched = scheduler_pid(server.proc.pid)
        groups = thread_groups(sched) if sched is not None else {}
        first = 0
        for r in range(args.rounds):
            for kind in KINDS:
                spy = None
                if args.py_spy and r == args.rounds - 1:
                    spy = py_spy_share(server.proc.pid, args.seconds, os.path.join(work, f"{kind}.txt"))
                cpu0 = process_cpu_s(server.proc.pid)
                sched0 = threads_cpu_s(sched, groups) if sched is not None else {}
                w = asyncio.run(window(server.url, kind, args.rate, args.seconds, first))
                n = max(w["requests"], 1)
                w.update(kind=kind, round=r, http_cpu_ms_per_request=round(
                    1e3 * (process_cpu_s(server.proc.pid) - cpu0) / n, 3))
                if sched is not None:
                    sched1 = threads_cpu_s(sched, groups)
                    w["scheduler_cpu_ms_per_request"] = {k: round(1e3 * (v - sched0.get(k, 0.0)) / n, 3)
                                                         for k, v in sorted(sched1.items())}
                if spy is not None:
                    spy["proc"].wait()
                    w["py_spy"] = summarize_py_spy(spy["out"]) if os.path.exists(spy["out"]) else None
                first += w["requests"]
                res["windows"].append(w)
                print(json.dumps(w), flush=True)
    finally:
        stop_server(server)
    per = {k: [w["http_cpu_ms_per_request"] for w in res["windows"] if w["kind"] == k] for k in KINDS}
    res["summary"] = {k: {"http_cpu_ms_per_request_median": statistics.median(v),
                          "over_plain_ms": round(statistics.median(v) - statistics.median(per["plain"]), 3)}
                      for k, v in per.items()}
    for k in KINDS:  # the scheduler process, per thread group: the median window of each kind
        by_group = [w.get("scheduler_cpu_ms_per_request", {}) for w in res["windows"] if w["kind"] == k]
        names = sorted({g for d in by_group for g in d})
        res["summary"][k]["scheduler_cpu_ms_per_request_median"] = {
            g: statistics.median(d.get(g, 0.0) for d in by_group) for g in names}
    print(json.dumps(res["summary"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
