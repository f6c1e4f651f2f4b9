"""Summarize py-spy samples of an SGLang scheduler process: where its main thread spends wall time.

The seam clock (sglang_capture/server/seam_clock.py) times the patched seams only; it cannot say whether
a slower seam ran more Python, waited for the GPU, or waited for the GIL that a hand-off thread
held. py-spy can: ``bench/e2e.py --py-spy-seconds S`` records the scheduler process twice at
once, with ``--idle`` (every sample: wall time) and without (only samples where a thread was on
a CPU; a thread waiting for the GIL or a CUDA event is idle). Per key frame of the scheduler's
main thread this gives the share of wall time spent under it, and how much of that was on CPU.
Other threads of the process (the package's hand-off threads, SGLang's own) are reported by
their on-CPU share: what they take of the GIL the scheduler thread needs.

    python bench/pyspy_summary.py ACTIVE.txt ALL.txt SECONDS RATE    # the JSON summary
    python bench/pyspy_summary.py diff A.all.txt A_BATCHES_PER_S B.all.txt B_BATCHES_PER_S [TOP]   # us per batch, A against B
"""
from __future__ import annotations

import collections
import json
import re
import sys
from typing import Counter, Dict, List, Tuple

# Frames of the scheduler's main thread whose inclusive time is reported (function names; the
# package's own frames are matched by file instead).
KEY_FRAMES = ("event_loop_overlap", "recv_requests", "process_input_requests", "get_next_batch_to_run", "run_batch",
              "forward_batch_generation", "copy_to_cpu", "process_batch_result", "process_batch_result_prefill",
              "process_batch_result_decode", "_stream_output_generation", "synchronize")
PACKAGE = "/sglang_capture/"  # in a frame's file path: this package (installed or editable)
# A wait for the GPU that the seam clock makes for SGLang (``result_wait`` times a batch's copy-done event,
# ``SeamClock.timed`` calling its ``synchronize``): not the package's own work, though no SGLang frame is
# between. The package's own waits (a job's copies, before it is described) stay its own.
CLOCK, WAITS = "SeamClock.timed", ("synchronize",)


def _hands_back(func: str, path: str, caller: str) -> bool:
    """Whether this frame runs SGLang's work again, not the package's: SGLang's code, or its GPU wait
    called by the seam clock."""
    return path.startswith("sglang/") or (caller == CLOCK and func.rsplit(".", 1)[-1] in WAITS)
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")

Stacks = Dict[str, Counter[Tuple[str, ...]]]


def load(path: str) -> Stacks:
    """py-spy ``--format raw --threads`` output: per thread name, sample counts per stack."""
    out: Stacks = collections.defaultdict(collections.Counter)
    with open(path, errors="replace") as f:  # py-spy writes frame names as it reads them, bytes not always UTF-8
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            thread = re.sub(r"\d+$", "*", frames[0].split(": ", 1)[-1])  # numbered threads grouped
            out[thread][tuple(frames[1:])] += int(count)
    return out


def _short(frame: str) -> Tuple[str, str]:
    """(function, file) with the file cut to its package path (what follows site-packages/)."""
    m = _FRAME.match(frame)
    if not m:
        return frame, ""
    path = m.group("file")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return m.group("func"), path.split(marker, 1)[1]
    if "/sglang/" in path:  # SGLang unpacked outside site-packages (the device kit)
        path = "sglang/" + path.split("/sglang/", 1)[1]
    return m.group("func"), path


def _inclusive(stacks: Counter[Tuple[str, ...]]) -> Counter[str]:
    """Samples under each key frame, and in this package's own code, counted once per stack."""
    out: Counter[str] = collections.Counter()
    for stack, n in stacks.items():
        seen = set()
        own = False  # in this package's code (and what it calls), not back in SGLang through a wrapper
        caller = ""
        for frame in stack:
            func, path = _short(frame)
            name = func.rsplit(".", 1)[-1]  # py-spy names methods Class.method
            if name in KEY_FRAMES:
                seen.add(name)
            if PACKAGE in "/" + path:
                own = True
            elif _hands_back(func, path, caller):
                own = False
            caller = func
        if own:
            seen.add("[sglang_capture]")
        for key in seen:
            out[key] += n
    return out


def _own_seam(stack: Tuple[str, ...]) -> str:
    """The package hook a sample of its own code runs in (the package frame SGLang called last), or ''."""
    own, seam, caller = False, "", ""
    for frame in stack:
        func, path = _short(frame)
        if PACKAGE in "/" + path:
            if not own:
                seam = func
            own = True
        elif _hands_back(func, path, caller):
            own = False
        caller = func
    return seam if own else ""


def per_batch(stacks: Counter[Tuple[str, ...]], batches_per_s: float) -> Tuple[Counter[str], Counter[str]]:
    """Microseconds of wall time per batch (from the ``--idle`` recording of one window): each
    function's inclusive time, and the package's own code by the hook it runs under."""
    total = max(sum(stacks.values()), 1)
    us = 1e6 / total / batches_per_s
    frames: Counter[str] = collections.Counter()
    seams: Counter[str] = collections.Counter()
    for stack, n in stacks.items():
        for name in {"{} ({})".format(*_short(f)) for f in stack}:
            frames[name] += n * us
        seam = _own_seam(stack)
        if seam:
            seams[seam] += n * us
    return frames, seams


def diff(a: Stacks, a_batches_per_s: float, b: Stacks, b_batches_per_s: float, top: int = 40,
         main: str = "MainThread") -> Dict:
    """Where one server's batch takes longer than another's (a capture window against a none
    window, each sampled with ``--idle``): per function, microseconds per batch in each and the
    difference, largest first; and the package's own code per batch by hook (bench/RESULTS.md,
    r104). ``*_batches_per_s``: batches the scheduler ran per second in that window (the seam
    clock's calls of ``run_batch/*`` over the window's seconds)."""
    fa, sa = per_batch(a.get(main, collections.Counter()), a_batches_per_s)
    fb, sb = per_batch(b.get(main, collections.Counter()), b_batches_per_s)
    rows = sorted(set(fa) | set(fb), key=lambda k: -abs(fa[k] - fb[k]))[:top]
    return {"us_per_batch": [round(1e6 / a_batches_per_s), round(1e6 / b_batches_per_s)],  # a batch's wall time
            "own_by_hook": {k: [round(sa[k]), round(sb[k])] for k in sorted(set(sa) | set(sb), key=lambda k: -sa[k])},
            "frames": [{"frame": k, "us": [round(fa[k]), round(fb[k])], "delta": round(fa[k] - fb[k])} for k in rows]}


def _leaves(stacks: Counter[Tuple[str, ...]]) -> Counter[str]:
    out: Counter[str] = collections.Counter()
    for stack, n in stacks.items():
        if stack:
            func, path = _short(stack[-1])
            out[f"{func} ({path})"] += n
    return out


def summarize(active: Stacks, every: Stacks, seconds: float, rate: float, main: str = "MainThread") -> Dict:
    """Percent of wall time (``seconds`` x ``rate`` samples) per key frame and per leaf of the
    main thread, in all and on CPU; on-CPU percent of every other thread, and of its top leaves. The two recordings sample
    independently, so a frame's on-CPU share can exceed its wall share by the sampling noise."""
    wall = max(sum(every.get(main, {}).values()), 1)
    inc_all, inc_cpu = _inclusive(every.get(main, collections.Counter())), _inclusive(active.get(main, collections.Counter()))
    leaf_all, leaf_cpu = _leaves(every.get(main, collections.Counter())), _leaves(active.get(main, collections.Counter()))
    pct = lambda n: round(100.0 * n / wall, 1)
    expected = seconds * rate
    return {
        "samples": wall,
        "sampled_pct_of_expected": round(100.0 * wall / expected, 1) if expected else None,
        "main_on_cpu_pct": pct(sum(active.get(main, {}).values())),
        "frames": {k: {"wall_pct": pct(inc_all[k]), "cpu_pct": pct(inc_cpu[k])}
                   for k in sorted(inc_all, key=lambda k: -inc_all[k])},
        "leaves_top": [{"leaf": k, "wall_pct": pct(n), "cpu_pct": pct(leaf_cpu[k])} for k, n in leaf_all.most_common(15)],
        "other_threads_cpu_pct": {t: pct(sum(c.values())) for t, c in sorted(active.items()) if t != main},
        # where each other thread's CPU goes (% of a core per leaf): a hand-off thread spinning in a CUDA
        # event's synchronize holds no GIL, one in msgpack or file I/O does
        "other_threads_top": {t: [{"leaf": k, "cpu_pct": pct(n)} for k, n in _leaves(c).most_common(8)]
                              for t, c in sorted(active.items()) if t != main},
    }


def rows(summaries: Dict[str, Dict]) -> List[str]:
    """Markdown: the main thread's share of wall time per key frame (on CPU in brackets), per server."""
    if not summaries:
        return []
    ok = {name: s for name, s in summaries.items() if "frames" in s}
    keys = sorted({k for s in ok.values() for k in s["frames"]}, key=lambda k: (k not in ("event_loop_overlap",), k))
    out = ["", "| main thread (of the scheduler; *-http: of the HTTP process), % of wall (on CPU) | on CPU | "
           + " | ".join(keys) + " | other threads on CPU |",
           "|---" * (len(keys) + 3) + "|"]
    for name, s in summaries.items():
        if name not in ok:
            out.append(f"| {name} | {s.get('error', 'no samples')} |" + " |" * (len(keys) + 1))
            continue
        cells = [f"{s['frames'][k]['wall_pct']} ({s['frames'][k]['cpu_pct']})" if k in s["frames"] else "—" for k in keys]
        others = ", ".join(f"{t} {p}" for t, p in s["other_threads_cpu_pct"].items() if p >= 0.5)
        out.append(f"| {name} | {s['main_on_cpu_pct']} | " + " | ".join(cells) + f" | {others} |")
    return out


if __name__ == "__main__":
    if sys.argv[1] == "diff":  # diff A.all.txt A_BATCHES_PER_S B.all.txt B_BATCHES_PER_S [TOP]
        print(json.dumps(diff(load(sys.argv[2]), float(sys.argv[3]), load(sys.argv[4]), float(sys.argv[5]),
                              *(int(x) for x in sys.argv[6:7])), indent=1))
    else:
        print(json.dumps(summarize(load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])), indent=1))
