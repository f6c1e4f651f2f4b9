"""Capture options: one dataclass, validated once, carried to SGLang's spawned processes by env.

The launcher validates the options and stores them as JSON in ``SGLANG_CAPTURE_CONFIG``; every
process SGLang spawns inherits the environment, and the plugin entry point reads it back. The
variable's presence is what switches capture on: without it, installing the package changes
nothing in a plain ``python -m sglang.launch_server``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from sglang_capture.durability import DURABILITY_MODES
from sglang_capture.format import CODECS, Codec

ENV_VAR = "SGLANG_CAPTURE_CONFIG"


class ConfigError(ValueError):
    """A capture option that cannot work; the message is one actionable line."""


@dataclass(frozen=True)
class CaptureConfig:
    """Everything the patched server needs to know about capture.

    ``layers`` uses the package's single convention: i is the residual stream entering decoder
    layer i (= transformers' ``output_hidden_states[i]``); ``None`` means the model default,
    resolved by ``layers.resolve_layers`` once the model's depth is known.
    """

    capture_dir: str
    layers: Optional[List[int]] = None
    keep_last_hidden: bool = True
    codec: str = "zstd"
    level: Optional[int] = None
    shuffle: bool = True
    writer_threads: int = 0  # writer processes (the name predates them); 0 = auto, see threads_for_writing
    compress_threads: int = 0
    writer_nice: int = 0
    writer_cpus: Optional[List[int]] = None  # CPUs the writer processes run on; None = the server's
    switch_interval_ms: float = 1.0
    durability: str = "file"
    keep_page_cache: bool = False
    gather_in_forward: bool = True
    max_pending_mb: int = 8192
    wait_timeout_s: float = 600.0
    model_layers: Optional[int] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not os.path.isabs(self.capture_dir):
            object.__setattr__(self, "capture_dir", os.path.abspath(self.capture_dir))
        if self.codec not in CODECS:
            raise ConfigError(f"--capture-codec must be one of {', '.join(CODECS)}, got {self.codec!r}")
        try:
            self.codec_spec()
        except ValueError as e:
            raise ConfigError(f"--capture-level: {e}") from None
        if self.durability not in DURABILITY_MODES:
            raise ConfigError(f"--capture-durability must be one of {', '.join(DURABILITY_MODES)}, got {self.durability!r}")
        if self.writer_threads < 0:
            raise ConfigError(f"--capture-writers must be 0 (auto) or a positive count, got {self.writer_threads}")
        if not 0 <= self.writer_nice <= 19:
            raise ConfigError(f"--capture-writer-nice must be 0 (the server's priority) to 19 (the lowest), got {self.writer_nice}")
        if self.writer_cpus is not None:
            if not self.writer_cpus or min(self.writer_cpus) < 0:
                raise ConfigError(f"--capture-writer-cpus must name CPUs such as 8-15, got {self.writer_cpus}")
            object.__setattr__(self, "writer_cpus", sorted(set(self.writer_cpus)))
        if self.compress_threads < -1:
            raise ConfigError("--capture-compress-threads must be -1 (all cores), 0 (inline) or a positive count")
        if self.switch_interval_ms < 0:
            raise ConfigError("--capture-switch-interval-ms must be zero (leave Python's) or positive")
        if self.max_pending_mb < 1:
            raise ConfigError(f"--capture-max-pending-mb must be at least 1, got {self.max_pending_mb}")
        if self.wait_timeout_s < 0:
            raise ConfigError("--capture-wait-timeout must be zero or positive")
        if self.layers is not None:
            if not self.layers:
                raise ConfigError("--capture-layers is empty; give comma-separated layer ids such as 3,31,59")
            if len(set(self.layers)) != len(self.layers):
                raise ConfigError(f"--capture-layers has duplicates: {self.layers}")
            object.__setattr__(self, "layers", sorted(self.layers))

    def threads_for_writing(self) -> int:
        """Writer processes to run: the configured count, or for 0 three quarters of the cores this
        process may use (of ``writer_cpus`` when set), between 2 and 16 (on the 16-core H200 host
        16 writers used ~8 cores at full capture, bench/RESULTS.md; beyond that the disk, not the
        CPU, bounds the writer)."""
        if self.writer_threads:
            return self.writer_threads
        try:
            cores = len(self.writer_cpus or os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 2
        return max(2, min(16, 3 * cores // 4))

    def codec_spec(self) -> Codec:
        """The on-disk codec these options select."""
        return Codec(name=self.codec, level=self.level, shuffle=self.shuffle, threads=self.compress_threads)

    @property
    def max_pending_bytes(self) -> int:
        return self.max_pending_mb * (1 << 20)

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: Optional[dict] = None) -> Optional["CaptureConfig"]:
        """The configuration the launcher published, or None when capture is not switched on."""
        raw = (os.environ if environ is None else environ).get(ENV_VAR)
        if not raw:
            return None
        try:
            return cls.from_json(raw)
        except (TypeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{ENV_VAR} is not a valid capture configuration: {e}") from None

    @classmethod
    def from_json(cls, raw: str) -> "CaptureConfig":
        """The inverse of ``to_env`` (raises TypeError or JSONDecodeError on a bad document)."""
        return cls(**json.loads(raw))


def parse_layers(text: str) -> List[int]:
    """Parse ``--capture-layers`` ("3,31,59") with a one-line error for anything else."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--capture-layers must be comma-separated integers such as 3,31,59, got {text!r}") from None
    if not ids:
        raise ConfigError("--capture-layers is empty; give comma-separated layer ids such as 3,31,59")
    return ids


def parse_cpu_list(text: str) -> List[int]:
    """Parse ``--capture-writer-cpus`` in the kernel's cpulist form ("8-15", "2,4-6") with a one-line error."""
    cpus: List[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            first, _, last = part.partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 0 or hi < lo:
                raise ValueError
            cpus.extend(range(lo, hi + 1))
    except ValueError:
        raise ConfigError(f"--capture-writer-cpus must be a CPU list such as 8-15 or 2,4-6, got {text!r}") from None
    return cpus


def check_writer_cpus(cpus: Optional[List[int]], allowed: Optional[set] = None) -> None:
    """The writer CPUs must be ones the server may run on: any other is a typo or another host's numbering,
    and the writers would quietly run on the server's CPUs instead."""
    if cpus is None:
        return
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    missing = sorted(set(cpus) - set(allowed))
    if missing:
        raise ConfigError(f"--capture-writer-cpus names CPUs {_ranges(missing)} that this server may not use; "
                          f"it may use {_ranges(sorted(allowed))}")


def _ranges(cpus: List[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the form the option takes)."""
    runs: List[List[int]] = []
    for cpu in cpus:
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)
