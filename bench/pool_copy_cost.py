"""The scheduler thread's cost of one batch's copy to the host: the capture's ``HostPool.take``
against SGLang's own ``_async_d2h`` (a pinned buffer from torch's caching host allocator), their
parts (a CUDA event, a pool block), with the GPU idle or busy ahead of the copy, and with three
Python threads taking the GIL ~5% of the time each (as the scheduler process's link, its replies
and the row copier do). Needs a GPU; issue 51 (r80: a capture batch's copy seam ~230 us above a
plain batch's on the EAGLE-3 pair, whose verify pass copies 256 rows of 4 x 2048 columns).

    source .devkit/env.sh; pip install --no-deps --target /tmp/scw dist/sglang_capture-*.whl
    cd /tmp && PYTHONPATH=/tmp/scw:$PYTHONPATH python $REPO/bench/pool_copy_cost.py
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable

import torch

from sglang_capture.server.host_pool import HostPool


def d2h(t: torch.Tensor) -> torch.Tensor:
    """SGLang 0.5.17's ``_async_d2h`` (managers/utils.py)."""
    c = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    c.copy_(t, non_blocking=True)
    t.record_stream(torch.cuda.current_stream(t.device))
    return c


def timed(name: str, f: Callable[[], Any], n: int = 2000, busy_gpu: bool = False) -> None:
    """Print the call's wall time per call (p50, p90, mean) over ``n`` calls; ``busy_gpu``: matrix
    products queued ahead of every eighth call, so copies wait for the GPU as under a forward."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ts = []
    for i in range(n):
        if busy_gpu and i % 8 == 0:
            for _ in range(4):
                a @ a
        t0 = time.perf_counter()
        r = f()
        ts.append(time.perf_counter() - t0)
        del r
        if i % 64 == 63:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    ts.sort()
    print(f"{name:48s} p50 {1e6 * ts[len(ts) // 2]:7.1f} us  p90 {1e6 * ts[int(.9 * len(ts))]:7.1f}  "
          f"mean {1e6 * statistics.mean(ts):7.1f}", flush=True)


def spinner(stop: threading.Event) -> None:
    """Hold the GIL 50 us, sleep 1 ms, until ``stop``."""
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 50e-6:
            pass
        time.sleep(0.001)


def main() -> None:
    pool = HostPool(1 << 30, pin=True)
    x = torch.randn(256, 8192, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (64,), device="cuda")
    copy_stream = torch.cuda.Stream()
    for busy in (False, True):
        print(f"--- GPU busy ahead of the copy: {busy}")
        with torch.cuda.stream(copy_stream):
            timed("pool.take 256 x 8192 bf16 (4 MiB)", lambda: pool.take(x), busy_gpu=busy)
            timed("_async_d2h 256 x 8192 bf16", lambda: d2h(x), busy_gpu=busy)
            timed("_async_d2h of 64 token ids", lambda: d2h(ids), busy_gpu=busy)
            timed("torch.cuda.Event() + record", lambda: torch.cuda.Event().record(), busy_gpu=busy)
            timed("pool.alloc 32 x 8192 bf16 (a run)", lambda: pool.alloc((32, 8192), torch.bfloat16), busy_gpu=busy)
    stop = threading.Event()
    threads = [threading.Thread(target=spinner, args=(stop,), daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    print("--- with 3 Python threads each holding the GIL ~5% of the time")
    with torch.cuda.stream(copy_stream):
        timed("pool.take 256 x 8192 bf16 (4 MiB)", lambda: pool.take(x), busy_gpu=True)
        timed("_async_d2h 256 x 8192 bf16", lambda: d2h(x), busy_gpu=True)
        timed("_async_d2h of 64 token ids", lambda: d2h(ids), busy_gpu=True)
        timed("pure Python: 200 dict ops", lambda: [{}.get(i) for i in range(200)])
    stop.set()
    print("--- without them")
    timed("pure Python: 200 dict ops", lambda: [{}.get(i) for i in range(200)])
    pool.close()


if __name__ == "__main__":
    main()
