"""What bench/e2e.py samples during a window besides the load's own numbers: GPU clocks and
utilisation, the server tree's memory and cores, py-spy of the scheduler, host memory reclaim."""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import psutil
import pyspy_summary

from sglang_capture.testbed.server import Server

T = TypeVar("T")


class GpuSampler:
    """GPU utilisation, SM clock, power and temperature over a window, from ``nvidia-smi -lms``:
    whether two windows of the same server differ because the GPU ran slower (clocks, power
    cap, heat) or because it was given less work. Reports nothing where there is no nvidia-smi."""

    FIELDS = ("utilization.gpu", "clocks.sm", "power.draw", "temperature.gpu")

    def __init__(self, interval_ms: int = 250) -> None:
        self.rows: List[List[float]] = []
        try:
            self.proc: Optional[subprocess.Popen] = subprocess.Popen(
                ["nvidia-smi", "--id=0", f"--query-gpu={','.join(self.FIELDS)}", "--format=csv,noheader,nounits",
                 f"-lms={interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.rows.append([float(x) for x in line.split(",")])
            except ValueError:  # "[N/A]" fields
                continue

    def stop(self) -> Optional[Dict[str, float]]:
        if self.proc is None:
            return None
        self.proc.terminate()
        self.proc.wait()
        if not self.rows:
            return None
        cols = list(zip(*self.rows, strict=False))
        return {"util_pct": round(statistics.mean(cols[0]), 1), "sm_mhz_mean": round(statistics.mean(cols[1])),
                "sm_mhz_min": min(cols[1]), "power_w": round(statistics.mean(cols[2]), 1), "temp_c_max": max(cols[3]),
                "samples": len(self.rows)}


def timed_with_gpu(run: Callable[[], T]) -> Tuple[T, float, Optional[Dict[str, float]]]:
    """``run()``'s result, its wall seconds and the GPU's figures over it (``GpuSampler``). The
    seconds end when ``run`` returns: nvidia-smi ends only at its next sample, up to 250 ms after it
    is told to, and a pass timed through its reaping read 0.25 s steps (6.53, 6.78, 7.03 s)."""
    gpu = GpuSampler()
    t0 = time.monotonic()
    try:
        result = run()
        seconds = time.monotonic() - t0
    finally:
        busy = gpu.stop()
    return result, seconds, busy


class RssSampler(threading.Thread):
    """Peak resident memory of a server's whole process tree, sampled every 0.2 s, plus the CPU
    the tree and the whole host used over the window (which stage is starved of cores)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.peak = 0
        self.stop_event = threading.Event()
        self.cpu_first: Dict[int, float] = {}
        self.cpu_last: Dict[int, float] = {}
        self.sched_first: Dict[int, float] = {}
        self.sched_last: Dict[int, float] = {}
        self.writer_pids: Dict[int, bool] = {}  # pid -> is it one of the package's writer processes (or their supervisor)
        psutil.cpu_percent(None)
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs if p.is_running()))
                for p in procs:
                    t = p.cpu_times()
                    self.cpu_first.setdefault(p.pid, t.user + t.system)
                    self.cpu_last[p.pid] = t.user + t.system
                    if p.pid not in self.writer_pids:
                        command = " ".join(p.cmdline())
                        self.writer_pids[p.pid] = any(m in command for m in WRITER_MODULES)
                    if "scheduler" in p.name():  # SGLang names it sglang::scheduler
                        for th in p.threads():
                            self.sched_first.setdefault(th.id, th.user_time + th.system_time)
                            self.sched_last[th.id] = th.user_time + th.system_time
            except psutil.Error:
                pass
            time.sleep(0.2)

    def cpu(self) -> Dict[str, float]:
        """Cores busy on average: the server's process tree, and the whole host."""
        wall = max(time.monotonic() - self.t0, 1e-9)
        used = sum(last - self.cpu_first[pid] for pid, last in self.cpu_last.items())
        threads = sorted((last - self.sched_first[tid] for tid, last in self.sched_last.items()), reverse=True)
        writers = sum(last - self.cpu_first[pid] for pid, last in self.cpu_last.items() if self.writer_pids.get(pid))
        return {"server_cores": round(used / wall, 2), "host_busy_pct": psutil.cpu_percent(None),
                "writer_processes_cores": round(writers / wall, 2),
                # the busiest threads of the scheduler process (the first is usually SGLang's own)
                "scheduler_top_threads_cores": [round(t / wall, 2) for t in threads[:4]],
                "scheduler_threads_cores": round(sum(threads) / wall, 2)}


WRITER_MODULES = ("sglang_capture.writer.process", "sglang_capture.writer.supervisor")
PY_SPY_RATE = 200  # samples/s: enough for ms-scale seams over a 10 s window, little load on the host


def _py_spy() -> Optional[str]:
    """The py-spy executable: on PATH, beside this Python, or in a bin/ beside an installed package (pip --target)."""
    found = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")  # a venv not on PATH
    if os.path.exists(found):
        return found
    return next((p for p in (os.path.join(d, "bin", "py-spy") for d in sys.path if d) if os.path.exists(p)), None)


def py_spy_window(server: Server, name: str, seconds: float, out_dir: str, res: Dict, http: bool = False) -> threading.Thread:
    """Sample ``server``'s scheduler process (``http``: its HTTP process, where the tokenizer manager and
    the response hooks run) for ``seconds``, 2 s from now, with and without idle samples at once
    (``pyspy_summary`` says why both); the summary goes to ``res['pyspy'][name]``. A third recording
    samples only the thread holding the GIL (``--gil``; raw file only, ``gil_error`` when it failed):
    how much of it each thread of the process takes (in a scheduler process, the others from the
    scheduler thread).
    ``--nonblocking``: the process is never paused, so the window's throughput is not disturbed."""
    def record() -> None:
        summaries = res.setdefault("pyspy", {})
        exe = _py_spy()
        sched = [server.proc.pid] if http else \
            [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True) if "scheduler" in p.name()]
        if exe is None or not sched:
            summaries[name] = {"error": "no py-spy executable" if exe is None else "no scheduler process found"}
            return
        time.sleep(2.0)
        os.makedirs(out_dir, exist_ok=True)
        paths = {kind: os.path.join(out_dir, f"{name}.{kind}.txt") for kind in ("active", "all", "gil")}
        flags = {"active": [], "all": ["--idle"], "gil": ["--gil"]}
        procs = [subprocess.Popen([exe, "record", "--pid", str(sched[0]), "--duration", f"{seconds:g}", "--rate",
                                   str(PY_SPY_RATE), "--nonblocking", "--threads", "--full-filenames", "--format", "raw",
                                   "-o", path, *flags[kind]],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for kind, path in paths.items()]
        errors = {kind: p.communicate(timeout=seconds + 60)[1].strip() for kind, p in zip(paths, procs)}

        def why(kinds: Tuple[str, ...]) -> str:
            return " | ".join(errors[k].splitlines()[-1] for k in kinds if errors[k]) or "no output"

        if not all(os.path.exists(paths[k]) for k in ("active", "all")):
            summaries[name] = {"error": why(tuple(paths))}
            return
        summaries[name] = pyspy_summary.summarize(pyspy_summary.load(paths["active"]), pyspy_summary.load(paths["all"]),
                                                  seconds, PY_SPY_RATE)
        if not os.path.exists(paths["gil"]):
            summaries[name]["gil_error"] = why(("gil",))
        print(f"py-spy {name}: " + json.dumps({k: v for k, v in summaries[name].items() if k != "leaves_top"}),
              file=sys.stderr, flush=True)

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    return thread


_VM_KEYS = ("allocstall", "pgscan_direct", "pgscan_kswapd", "pgsteal_direct", "pgsteal_kswapd")


def scheduler_clock(docs: Dict[str, Dict]) -> Dict[str, List[Optional[float]]]:
    """The scheduler thread's time in the patched seams (server/seam_clock.py) and in garbage
    collections (``gc/gen0..2``, server/gc_pauses.py), summed over the ranks' stats files ``docs``:
    per account, [calls, seconds, the thread's CPU seconds]: a collection's are its seconds; a seam's
    None where a rank's stats predate the CPU clock (never read as "no waiting")."""
    out: Dict[str, List[Optional[float]]] = {}
    for doc in docs.values():
        accounts = [(k, v, v.get("cpu_s")) for k, v in (doc.get("scheduler_thread") or {}).items()]
        accounts += [(f"gc/{k}", v, v.get("s", 0.0)) for k, v in (doc.get("gc_pauses") or {}).items()]
        for k, v, cpu in accounts:
            acc = out.setdefault(k, [0, 0.0, 0.0])
            acc[0] += v.get("calls", 0)
            acc[1] += v.get("s", 0.0)
            acc[2] = None if cpu is None or acc[2] is None else acc[2] + cpu
    return out


def clock_deltas(before: Dict[str, List[Optional[float]]], after: Dict[str, List[Optional[float]]]
                 ) -> Dict[str, List[Optional[float]]]:
    """Per account of ``scheduler_clock`` called in between: [calls, microseconds a call, of which the
    thread's CPU]: a seam whose wall time is much above its CPU time waited (for the GIL or the GPU)."""
    out: Dict[str, List[Optional[float]]] = {}
    for k, (n, sec, cpu) in sorted(after.items()):
        n0, sec0, cpu0 = before.get(k, (0, 0.0, 0.0))
        if n > n0:
            out[k] = [int(n - n0), round(1e6 * (sec - sec0) / (n - n0), 1),
                      None if cpu is None or cpu0 is None else round(1e6 * (cpu - cpu0) / (n - n0), 1)]
    return out


def vmstat() -> Dict[str, int]:
    """The host's memory-reclaim counters (summed over zones/kinds), where /proc has them."""
    out = dict.fromkeys(_VM_KEYS, 0)
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                key, value = line.split()
                for k in _VM_KEYS:
                    if key == k or key.startswith(k + "_"):
                        out[k] += int(value)
    except OSError:
        pass
    return out


def vm_window(before: Dict[str, int]) -> Dict[str, float]:
    """Reclaim over a window (direct reclaim stalls whoever allocates, the server included) and
    the page cache at its end, in GB."""
    after = vmstat()
    out: Dict[str, float] = {k: after[k] - before[k] for k in _VM_KEYS}
    try:
        mem = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        for k in ("MemFree", "Cached", "Dirty"):
            out[k + "_GB"] = round(int(mem[k].split()[0]) / 1e6, 1)
    except (OSError, KeyError, ValueError):
        pass
    return out


def client_cpu_s() -> float:
    """CPU seconds of this load generator and its finished client processes."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


_PREFILL = re.compile(r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+),.*?"
                      r"input throughput \(token/s\): ([\d.]+)")


def log_offset(server: Server) -> int:
    """Where the server's log ends now: a window's prefill batches are the lines written after it."""
    return os.path.getsize(server.log_path)


def prefill_batches(server: Server, since: int, tokens: int) -> Dict[str, float]:
    """The prefill batches a window ran, from SGLang's own "Prefill batch" log lines (written when a
    batch is scheduled; SGLang's --log-level info): how many took tokens from the radix cache, and
    how many were whole prompts only ("clean": every request's full ``tokens`` computed, none
    cached, none cut by the chunk budget). A clean batch runs DeepSeek-V3's MHA prefill; a cached
    token, or a request continuing from its last chunk, moves the whole batch to absorbed MLA
    (sglang/srt/models/deepseek_common/attention_backend_handler.py); a batch whose only cut
    request is a first chunk still runs MHA but counts as not clean. The premise of the prefill
    windows is that every batch is clean (with page size 1: with larger pages SGLang counts whole
    pages, and prompts not a page multiple never look clean). The median "input throughput" of each
    kind is SGLang's: a batch's tokens over the time since the previous batch was scheduled, so it
    measures the batch before, and only means a batch's speed in windows of one kind of batch."""
    with open(server.log_path, errors="replace") as f:
        f.seek(since)
        rows = [tuple(float(x) for x in m.groups()) for m in map(_PREFILL.search, f) if m]
    whole = [r[2] == 0 and r[1] == r[0] * tokens for r in rows]
    clean = [r for r, w in zip(rows, whole, strict=True) if w]
    other = [r for r, w in zip(rows, whole, strict=True) if not w]
    median = lambda rs: round(statistics.median(r[3] for r in rs)) if rs else None  # noqa: E731
    return {"batches": len(rows), "clean_batches": len(clean), "batches_with_cached": sum(r[2] > 0 for r in rows),
            "cached_tokens": int(sum(r[2] for r in rows)), "new_tokens": int(sum(r[1] for r in rows)),
            "clean_batch_tok_per_s": median(clean), "other_batch_tok_per_s": median(other)}
