"""What handing finished requests to the writers costs the scheduler process (issue 51), without a GPU.

    python bench/handoff_cost.py [--jobs 2000] [--rows 64] [--width 4096] [--writers 4] [--every 2] [--split-cpus]

A stand-in for SGLang's scheduler thread runs pure Python work (the host-bound step) and, every
``--every`` work units (a fraction of a millisecond each), takes a block of a real ``HostPool`` for a
request's rows (not written: on a GPU host the device copies them) and submits it to the package's
``WriterPool``, as the finish seam does; after each unit it pumps the link, as the scheduler's loop
does once per turn (hooks/prefix.py). It reports the work units per second
against the same loop freeing the rows instead of submitting them (the GIL share the hand-off takes
from the scheduler thread), and the CPU seconds per job of every other thread of this process
(what runs in the scheduler process besides its thread; torch runs on this thread alone).
The writer processes (and the supervisor, where there is one) are other processes: not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from typing import Dict

import torch

from sglang_capture.core.config import CaptureConfig
from sglang_capture.server.host_pool import HostPool
from sglang_capture.server.ledger import HostMemoryLedger
from sglang_capture.server.request_capture import RequestCapture
from sglang_capture.server.writer_pool import CaptureJob, WriterPool


def thread_cpu_s() -> Dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def work(units: int) -> None:
    x = 0
    for i in range(units * 7000):
        x += i & 7


def run(a: argparse.Namespace, submit: bool) -> Dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="handoff-cost-") as d:
        ledger = HostMemoryLedger(4 << 30)
        pool = HostPool(1 << 30, pin=False)
        pool._base.fill_(0)  # its pages faulted in now, as pinning does on a server (not counted below)
        cpus = sorted(os.sched_getaffinity(0))
        if a.split_cpus:  # the scheduler process on the first CPU, capture's other processes on the rest
            os.sched_setaffinity(0, cpus[:1])
        writer = WriterPool(CaptureConfig(capture_dir=d, writers=a.writers, codec="none", durability="none",
                                          writer_cpus=cpus[1:] if a.split_cpus else None), ledger)
        writer.start(pool)
        shape = (a.rows, a.width)
        meta = {"layers": [1], "layer_convention": "c", "hidden_size": a.width // 2, "model": "m",
                "sglang_version": "0.5.17", "schema": "sglang_capture/v1"}
        stored = {"aux_hidden_states": (0, a.width // 2), "last_hidden_states": (a.width // 2, a.width)}
        time.sleep(1.0)  # the writers are up
        main = threading.get_native_id()
        cpu0, t0, units, jobs = thread_cpu_s(), time.monotonic(), 0, []
        made = 0
        while made < a.jobs if submit else time.monotonic() - t0 < a.seconds:
            work(1)
            units += 1
            if submit:
                writer.pump()
            if units % a.every == 0:
                cap = RequestCapture(rid=f"r{made}", name=f"r{made}", ledger=ledger, pool=pool)
                # a prefill's rows: a block of the pool, not written here (on a GPU host the device copies
                # them, not the scheduler thread; a CPU copy into cold pool memory would be most of the loop)
                cap.add(0, pool.alloc(shape, torch.bfloat16))
                cap.seal()
                made += 1
                if not submit:
                    cap.release()
                    continue
                job = CaptureJob(cap, a.rows, stored, list(range(a.rows - 1)), [1], {**meta, "rid": cap.rid})
                writer.submit(job)
                jobs.append(job)
        busy_s = time.monotonic() - t0
        for job in jobs:
            job.done.wait(120)
        cpu1 = thread_cpu_s()
        names = {t.native_id: t.name for t in threading.enumerate()}
        by_name: Dict[str, float] = {}
        for tid, v in cpu1.items():
            if tid != main:
                name = names.get(tid, "other (torch, SGLang)").rstrip("0123456789-")
                by_name[name] = round(by_name.get(name, 0.0) + v - cpu0.get(tid, 0.0), 3)
        writer.close()
        os.sched_setaffinity(0, cpus)
        others = sum(v - cpu0.get(tid, 0.0) for tid, v in cpu1.items() if tid != main)
        failed = sum(1 for j in jobs if not j.outcome or j.outcome["status"] != "ok")
        return {"units_per_s": units / busy_s, "seconds": busy_s, "jobs": len(jobs), "failed": failed,
                "other_threads_cpu_s": others, "other_threads_cpu_ms_per_job": 1000 * others / max(len(jobs), 1),
                "other_threads_cpu_s_by_name": by_name}


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--width", type=int, default=4096, help="columns of a row (bf16)")
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--every", type=int, default=2, help="work units (~1 ms of Python each) per job")
    ap.add_argument("--split-cpus", action="store_true", help="this process on one CPU, the writers on the others "
                    "(--capture-writer-cpus): on a small machine, GIL turns apart from CPU contention")
    a = ap.parse_args()
    with_jobs = run(a, True)
    a.seconds = with_jobs["seconds"]
    alone = run(a, False)
    print(json.dumps({"args": vars(a), "submitting": with_jobs, "alone": alone,
                      "units_ratio": round(with_jobs["units_per_s"] / alone["units_per_s"], 4)}, indent=1))


if __name__ == "__main__":
    main()
