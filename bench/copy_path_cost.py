"""What one decode step's copy to the host costs the scheduler thread, the whole hook and its parts.

    python bench/copy_path_cost.py [--rows 40] [--width 16384] [--steps 2000] [--device cuda|cpu]

r97 (bench/RESULTS.md) measured ``copy_to_cpu`` at ~410 us a capturing decode step on an H100 host
against ~200 us for plain SGLang's own copy: this times, on one host and outside a server, the
package's hook (``hooks/transfer.py``: ``copy_hidden_to_pool`` on a batch of ``--rows`` capture
requests, ``--width`` columns of bf16 rows, SGLang's copy of the token ids after it) against that
copy alone, and each CUDA call the hook makes, so that a step's cost can be assigned before
anything is changed. Prints one line per part, microseconds a call (best of 3 runs of ``--steps``).
"""
from __future__ import annotations

import argparse
import time
import types
import weakref
from typing import Any, Callable, Dict, List

import torch

from sglang_capture.server.batch_rows import BatchRows, capture_rows, fp8_readers
from sglang_capture.server.copy_counts import CopyCounts
from sglang_capture.server.hooks.transfer import copy_hidden_to_pool
from sglang_capture.server.host_pool import HostPool, read_on_current_stream
from sglang_capture.server.request_capture import CAPTURE_ATTR
from sglang_capture.server.seam_clock import SeamClock


class _Decode:
    name = "DECODE"

    def is_decode(self) -> bool:
        return True

    def is_extend(self) -> bool:
        return False

    def is_mixed(self) -> bool:
        return False


SYNC_EVERY = 8  # calls between untimed syncs: the device never falls behind, so the host's time is what is timed


def best_us(fn: Callable[[], Any], steps: int, sync: Callable[[], None]) -> float:
    """Microseconds a call of ``fn``: the best of three runs of ``steps`` calls. The device is
    synchronized every ``SYNC_EVERY`` calls outside the timed spans: a copy slower than its launch
    would otherwise fill the launch queue, and the host would then time the copies, not itself."""
    for _ in range(min(steps, 50)):
        fn()
    sync()
    best = float("inf")
    for _ in range(3):
        spent = 0.0
        for done in range(0, steps, SYNC_EVERY):
            t0 = time.perf_counter()
            for _ in range(min(SYNC_EVERY, steps - done)):
                fn()
            spent += time.perf_counter() - t0
            sync()
        best = min(best, spent)
    return 1e6 * best / steps


def measure(rows: int, width: int, steps: int, device: str) -> Dict[str, float]:
    """Each part's microseconds a call on ``device``."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    hidden = torch.randn(rows, width, device=device).to(torch.bfloat16)
    ids = torch.zeros(rows, dtype=torch.int64, device=device)
    capture = types.SimpleNamespace(is_fp8=False, fp8_block=None)
    reqs = []
    for _ in range(rows):
        req = types.SimpleNamespace(return_hidden_states=True)
        setattr(req, CAPTURE_ATTR, capture)
        reqs.append(req)
    batch = types.SimpleNamespace(reqs=reqs, forward_mode=_Decode(), spec_algorithm=None)
    state = types.SimpleNamespace(pool=HostPool(1 << 30, pin=cuda), model=types.SimpleNamespace(hidden_size=width // 4),
                                  copies=CopyCounts(), launching=None, clock=SeamClock())
    kept: List[Any] = []

    def keep(x: Any) -> None:
        kept.append(x)
        del kept[:-16]  # the last steps' host rows stay referenced, as the runs hold them

    def d2h(t: torch.Tensor) -> torch.Tensor:  # SGLang's _async_d2h
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
        out.copy_(t, non_blocking=True)
        return out

    def result() -> Any:
        return types.SimpleNamespace(logits_output=types.SimpleNamespace(hidden_states=hidden), next_token_ids=ids)

    def sglang_copy(instance: Any) -> Callable[..., None]:
        def copy(return_logprob: bool, return_hidden_states: bool = True) -> None:
            if return_hidden_states:
                instance.logits_output.hidden_states = d2h(instance.logits_output.hidden_states)
            instance.next_token_ids = d2h(instance.next_token_ids)
        return copy

    def plain_step() -> None:
        instance = result()
        sglang_copy(instance)(False, return_hidden_states=False)
        keep(instance)

    def hook_step() -> None:
        instance = result()
        state.launching = BatchRows(batch, True)
        copy_hidden_to_pool(state, sglang_copy(instance), instance, (False,), {"return_hidden_states": True})
        keep(instance)

    def event() -> None:
        e = torch.cuda.Event()
        e.record()
        keep(e)

    def finalize() -> None:
        weakref.finalize(torch.empty(0), len, ()).atexit = False

    parts: Dict[str, Callable[[], None]] = {
        "plain step (SGLang's copy of the ids)": plain_step,
        "capture step (the hook, SGLang's copy after it)": hook_step,
        "HostPool.take (the rows)": lambda: keep(state.pool.take(hidden)),
        "SGLang's pinned copy of the rows instead": lambda: keep(d2h(hidden)),
        "capture_rows (every request capturing)": lambda: capture_rows(batch, rows),
        "fp8_readers": lambda: fp8_readers(batch),
        "BatchRows()": lambda: BatchRows(batch, True),
        "weakref.finalize": finalize,
    }
    if cuda:
        parts.update({"record_stream": lambda: read_on_current_stream(hidden), "Event + record": event})
    stream = torch.cuda.Stream() if cuda else None
    out = {}
    for name, fn in parts.items():
        if stream is not None:
            with torch.cuda.stream(stream):  # SGLang copies results on its copy stream
                out[name] = best_us(fn, steps, sync)
        else:
            out[name] = best_us(fn, steps, sync)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--width", type=int, default=16384, help="columns of a row: the aux layers' and the final state's")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    for name, us in measure(a.rows, a.width, a.steps, a.device).items():
        print(f"{name}: {us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
