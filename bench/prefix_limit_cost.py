"""What prefix sharing's cap on the radix hit costs the scheduler thread per scheduling pass.

    python bench/prefix_limit_cost.py [--policy fcfs|lpm] [--conversations 2400] [--waiting N] [--admit 8] [--rev REV ...]
    python bench/prefix_limit_cost.py --load chats [--chats 40] [--turns 8] [--repeat 5] [--rev REV ...]

SGLang asks a request's prefix limit (``Req._compute_max_prefix_len``, capped by ``SharedRows.limit``)
at every scheduling pass: under ``fcfs`` (its default) of the waiting requests it tries to admit,
under ``lpm`` of every waiting request (while at most 128 wait; beyond, lpm schedules as fcfs). This
replays an ``extract``-like load on the scheduler's own index, without a server: ``--waiting``
capture requests wait (default 256 under fcfs, 128 under lpm; conversations of a 120-token system
prompt and 300-1,200 tokens of their own), each pass asks the caps the policy asks (fcfs: the
``--admit`` requests admitted and the next one), then those ``--admit`` finish and store their
blocks as a server does (the rows from where their stored prefix ended: behind the shared system
prompt once it is stored), and as many new ones arrive. Prints the mean time of a pass, for the working tree's
``server/block_index.py`` and ``server/shared_rows.py`` and for each ``--rev`` (the same two files
as of that git revision, loaded in their place).

``--load chats``: issue 50's closed-loop chats instead (``--chats`` chats of ``--turns`` turns behind a
shared 1,024-token system prompt, 128-token user turns, 64-token answers, each turn's rows in flight
when the next turn comes, as ``SharedRows.in_flight`` posts them): the mean time of one capture's cap,
paid once per turn when it is admitted, between a wave of turns and its prefills (best of ``--repeat``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from types import ModuleType
from typing import List, Optional, Tuple

import numpy

from sglang_capture.core.blocks import layout_root, plan_blocks
from sglang_capture.server.shared_rows import MIN_REUSE_ROWS

ROOT = layout_root({"model": "bench"})
FILES = ("sglang_capture/server/block_index.py", "sglang_capture/server/shared_rows.py")


def _load(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def modules(rev: Optional[str]) -> Tuple[ModuleType, ModuleType]:
    """(block_index, shared_rows): the working tree's, or ``rev``'s loaded in their place."""
    if rev is None:
        from sglang_capture.server import block_index, shared_rows

        return block_index, shared_rows
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
    out = tempfile.mkdtemp(prefix="prefix-limit-")
    paths = []
    for f in FILES:
        path = os.path.join(out, os.path.basename(f))
        shown = subprocess.run(["git", "-C", root, "show", f"{rev}:{f}"], capture_output=True, text=True)
        if shown.returncode != 0:
            raise SystemExit(f"--rev {rev}: git has no {f} there ({shown.stderr.strip().splitlines()[-1]})")
        with open(path, "w") as fh:
            fh.write(shown.stdout)
        paths.append(path)
    # shared_rows imports block_index by its package name: the revision's copy answers to it meanwhile
    name = "sglang_capture.server.block_index"
    import sglang_capture.server.block_index as current

    try:
        block_index = _load(name, paths[0])
        shared_rows = _load(f"prefix_limit_shared_rows_{rev}", paths[1])
    finally:
        sys.modules[name] = current
    return block_index, shared_rows


def one_run(block_index: ModuleType, shared_rows: ModuleType, convs: List[numpy.ndarray], waiting_n: int,
            admit: int, every: bool) -> Tuple[float, int]:
    """Mean seconds of a scheduling pass, and the blocks indexed at the end."""
    index = block_index.BlockIndex()
    shares = [shared_rows.RequestShare(ROOT) for _ in convs]
    waiting, arrived = list(range(waiting_n)), waiting_n
    spent, passes = 0.0, 0
    while arrived + admit <= len(convs):
        t0 = time.perf_counter()
        for i in waiting if every else waiting[:admit + 1]:
            shares[i].cap(index, convs[i], len(convs[i]) - 1)
        spent += time.perf_counter() - t0
        passes += 1
        for i in waiting[:admit]:
            ids = convs[i]
            reach = shares[i].coverage.reach
            first = reach if reach >= MIN_REUSE_ROWS else 0  # the rows it computed, as its file's job stores them
            stored = [[b.name, b.slot_hash.hex(), b.start, b.end, 1] for b in plan_blocks(ids, first, len(ids) - 1, ROOT)]
            index.add(block_index.blocks_of(stored, ids))  # as a writer's report of them reaches every rank
        waiting = waiting[admit:] + list(range(arrived, arrived + admit))
        arrived += admit
    return spent / max(passes, 1), len(index)


def chat_run(block_index: ModuleType, shared_rows: ModuleType, chats: int, turns: int) -> Tuple[float, int]:
    """Mean seconds of a capture's cap on closed-loop chats, and the blocks indexed at the end."""
    rng = numpy.random.default_rng(1)
    system = rng.integers(0, 100000, 1024)
    index = block_index.BlockIndex()
    history = [system.copy() for _ in range(chats)]
    spent, caps, job = 0.0, 0, 0
    for _ in range(turns):
        shares = []
        for s in range(chats):
            history[s] = numpy.concatenate([history[s], rng.integers(0, 100000, 128)])
            share = shared_rows.RequestShare(ROOT)
            t0 = time.perf_counter()
            share.cap(index, history[s], len(history[s]) - 1)
            spent += time.perf_counter() - t0
            caps += 1
            shares.append(share)
        for s, share in enumerate(shares):  # each answered: its file's job queued, its blocks in flight
            reach = share.coverage.reach
            history[s] = numpy.concatenate([history[s], rng.integers(0, 100000, 64)])
            first = reach if reach >= MIN_REUSE_ROWS else 0
            job += 1
            stored = [[b.name, b.slot_hash.hex(), b.start, b.end, block_index.IN_FLIGHT]
                      for b in plan_blocks(history[s], first, len(history[s]) - 1, ROOT, share.hashes)]
            index.add_in_flight(job, block_index.blocks_of(stored, history[s]))
    return spent / caps, len(index)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=2400)
    ap.add_argument("--policy", choices=("fcfs", "lpm"), default="fcfs")
    ap.add_argument("--waiting", type=int, default=None, help="default 256 (fcfs), 128 (lpm)")
    ap.add_argument("--admit", type=int, default=8, help="requests that finish (and store their blocks) per pass")
    ap.add_argument("--rev", action="append", default=[], help="also a git revision's index (repeatable)")
    ap.add_argument("--load", choices=("extract", "chats"), default="extract")
    ap.add_argument("--chats", type=int, default=40)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    if a.load == "chats":
        for rev in [None, *a.rev]:
            mods = modules(rev)
            runs = [chat_run(*mods, a.chats, a.turns) for _ in range(a.repeat)]
            print(f"{rev or 'working tree'}, chats: {1e6 * min(r[0] for r in runs):.1f} us a capture's cap, best of "
                  f"{a.repeat} ({a.chats} chats x {a.turns} turns, {runs[0][1]} blocks indexed at the end)", flush=True)
        return
    rng = numpy.random.default_rng(0)
    system = rng.integers(0, 100000, 120)
    convs = [numpy.concatenate([system, rng.integers(0, 100000, int(rng.integers(300, 1200)))])
             for _ in range(a.conversations)]
    waiting = a.waiting or (256 if a.policy == "fcfs" else 128)
    for rev in [None, *a.rev]:
        per_pass, blocks = one_run(*modules(rev), convs, waiting, a.admit, a.policy == "lpm")
        print(f"{rev or 'working tree'}, {a.policy}: {1e3 * per_pass:.3f} ms per scheduling pass, {waiting} waiting "
              f"({a.conversations} conversations, {blocks} blocks indexed at the end)", flush=True)


if __name__ == "__main__":
    main()
