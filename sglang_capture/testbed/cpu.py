"""Environment for serving SGLang on a CPU-only machine (no NVIDIA driver)."""
from __future__ import annotations

import functools
import glob
import importlib.util
import os
import subprocess
from typing import Dict, Optional

from sglang_capture.testbed.once import build_once

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")  # sitecustomize.py: cpu_mla.py's patches

# The driver symbols the CUDA-built sgl_kernel wheel links against; each returns
# CUDA_ERROR_STUB_LIBRARY (34), so torch sees no GPU and SGLang uses its native CPU ops.
_STUB_SYMBOLS = (
    "cuPointerGetAttribute cuCtxFromGreenCtx cuCtxPopCurrent_v2 cuCtxPushCurrent_v2 cuDevResourceGenerateDesc "
    "cuDevSmResourceSplitByCount cuDeviceGetDevResource cuDriverGetVersion cuGetErrorString cuGetProcAddress_v2 "
    "cuGreenCtxCreate cuGreenCtxDestroy cuGreenCtxGetDevResource cuStreamCreate cuInit cuDeviceGetCount"
).split()


@functools.lru_cache(maxsize=None)
def _system_has_lib(soname: str) -> bool:
    """Whether the dynamic linker's cache lists ``soname`` (asked once per process and name)."""
    return f"{soname} " in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout


def has_nvidia_driver() -> bool:
    return _system_has_lib("libcuda.so.1")


def build_cuda_stub(stub_dir: str) -> str:
    """Compile (once, safe when servers start together) a stub libcuda.so.1 into ``stub_dir``; returns it."""
    def build(tmp: str) -> None:
        src = os.path.join(tmp, "stub.c")
        with open(src, "w") as f:
            f.writelines(f"int {s}(void) {{ return 34; }}\n" for s in _STUB_SYMBOLS)
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", os.path.join(tmp, "libcuda.so.1"),
                        src], check=True)

    return build_once(stub_dir, build, stamp=" ".join(_STUB_SYMBOLS))


def build_ibverbs_shim(shim_dir: str) -> Optional[str]:
    """A folder holding ``libibverbs.so.1`` for mooncake's CPU wheel (PD disaggregation's transfer
    engine), or None without the ``pyverbs`` wheel. mooncake links libibverbs even for its TCP
    transport; this machine has no rdma-core, but pyverbs' wheel carries one (renamed by
    auditwheel, with its libnl), which is what the links here point to."""
    spec = importlib.util.find_spec("pyverbs")
    if spec is None or spec.origin is None:
        return None
    libs = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), "pyverbs.libs")
    verbs = glob.glob(os.path.join(libs, "libibverbs-*.so.*"))
    if not verbs:
        return None

    def build(tmp: str) -> None:
        os.symlink(verbs[0], os.path.join(tmp, "libibverbs.so.1"))
        for lib in glob.glob(os.path.join(libs, "libnl*.so*")):
            os.symlink(lib, os.path.join(tmp, os.path.basename(lib)))

    return build_once(shim_dir, build, stamp=verbs[0])


def server_env(cache_dir: str, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for a server subprocess: unchanged (offline) with a GPU, the CPU recipe without."""
    env = dict(os.environ if base is None else base)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if has_nvidia_driver():
        return env
    stub = build_cuda_stub(os.path.join(cache_dir, "cudastub"))
    libs = [stub]
    if not _system_has_lib("libibverbs.so.1"):
        libs += [d for d in [build_ibverbs_shim(os.path.join(cache_dir, "ibverbs"))] if d]
    env["LD_LIBRARY_PATH"] = ":".join(libs + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        TORCHDYNAMO_DISABLE="1",  # else inductor compiles MoE top-k for ~40 s on the first request
        SGLANG_CAPTURE_CPU_TESTBED="1",
        PYTHONPATH=os.pathsep.join(p for p in (SITE_DIR, env.get("PYTHONPATH")) if p),
        # Several ranks (TP, DP attention) talk over gloo on a CPU; a loadable NCCL (the pip wheel
        # torch brings) would make SGLang set up a CUDA communicator and fail on the CPU device.
        SGLANG_NCCL_SO_PATH=os.path.join(stub, "no-nccl-on-cpu"),
        # A PD prefill server under overlap scheduling records a CUDA event before it sends a
        # cached prefix's KV early; on a CPU that raises. The send then waits for the last chunk.
        SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX="false",
    )
    return env


# Server flags every CPU launch needs; without --max-total-tokens the KV pool takes most of RAM.
# --sleep-on-idle: an idle scheduler otherwise spins a core, and the suite keeps several servers
# up at once on a 2-core machine.
CPU_SERVER_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "4096",
                   "--skip-server-warmup", "--sleep-on-idle"]
