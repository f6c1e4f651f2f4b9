"""Split the host's physical cores in two for one experiment: the capture writers on one half, every
other Python process (the servers, the HTTP processes, the clients, py-spy) on the other.

Question it answers (issue 51, r104): is SGLang's own code ~1.7 ms a batch slower under capture
because the writers' compression shares the scheduler thread's cores (or their hyperthread
siblings)? ``plan`` prints the two halves, whole cores each; ``loop S W`` moves, once a second, every
Python process whose affinity is neither half onto S (the writers set their own, W, through
``--capture-writer-cpus``). Used on the device:

    read S W < <(python bench/pin_split.py plan)
    python bench/pin_split.py loop "$S" "$W" > $OUT/pin.log 2>&1 &
    SPEC_ARGS="... --launcher-args=--capture-writer-cpus=$W" bash bench/gpu_deploy.sh spec $OUT
"""
from __future__ import annotations

import glob
import os
import sys
import time
from typing import List, Set


def halves() -> List[List[int]]:
    """The CPUs this process may use, grouped by physical core, split into two lists of whole cores."""
    cores: dict = {}
    for p in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list"):
        cores.setdefault(open(p).read().strip(), []).append(int(p.split("/")[5][3:]))
    allowed = os.sched_getaffinity(0)
    groups = [g for g in sorted((sorted(c for c in v if c in allowed) for v in cores.values()), key=min) if g]
    h = len(groups) // 2
    return [[c for g in groups[:h] for c in g], [c for g in groups[h:] for c in g]]


def loop(s: Set[int], w: Set[int], seconds: float = 900.0) -> None:
    me, end = os.getpid(), time.time() + seconds
    while time.time() < end:
        for d in glob.glob("/proc/[0-9]*"):
            pid = int(d[6:])
            if pid == me:
                continue
            try:
                cmd = open(d + "/cmdline", "rb").read()
                if not any(k in cmd for k in (b"python", b"sglang", b"py-spy")):
                    continue
                if os.sched_getaffinity(pid) in (s, w):
                    continue
                for tid in os.listdir(d + "/task"):
                    os.sched_setaffinity(int(tid), s)
                print(time.strftime("%T"), pid, cmd[:120].replace(b"\0", b" ").decode(errors="replace"), flush=True)
            except (OSError, ValueError):
                pass  # gone meanwhile
        time.sleep(1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["plan"]:
        print(*(",".join(map(str, half)) for half in halves()))
    elif sys.argv[1:2] == ["loop"] and len(sys.argv) == 4:
        loop({int(x) for x in sys.argv[2].split(",")}, {int(x) for x in sys.argv[3].split(",")})
    else:
        raise SystemExit("usage: python bench/pin_split.py plan | loop S W")
