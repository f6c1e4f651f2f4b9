"""Capture options: one table, validated once, carried to SGLang's spawned processes by env.

Each option is declared once, as a ``CaptureConfig`` field whose metadata (``option``) names
its command-line flag, help, and how its text is parsed; the launcher builds its click options
from this table (``click_options``), so adding an option touches this file only.

The launcher validates the options and stores them as JSON in ``SGLANG_CAPTURE_CONFIG``; every
process SGLang spawns inherits the environment, and the plugin entry point reads it back. The
variable's presence is what switches capture on: without it, installing the package changes
nothing in a plain ``python -m sglang.launch_server``.
"""
from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Sequence

from sglang_capture.core.checksum import CHECKSUMS, DEFAULT_CHECKSUM
from sglang_capture.core.final_state import FINAL_CHOICES, POST_NORM
from sglang_capture.core.format import CODECS, Codec
from sglang_capture.core.fp8 import CAPTURE_DTYPES
from sglang_capture.core.selection import CLIENT_POLICIES

ENV_VAR = "SGLANG_CAPTURE_CONFIG"
DURABILITY_MODES = ("file", "none")
SHARING_MODES = ("on", "off")


class ConfigError(ValueError):
    """A capture option that cannot work; the message is one actionable line."""


def option(flag: str, help: str, *, type: Any = None, choices: Sequence[str] = (),
           parse: Optional[Callable[[str], Any]] = None, default: Any = MISSING,
           unset: Optional[str] = None) -> Dict[str, Any]:
    """A field of ``CaptureConfig`` that is also a launcher option (``--capture-x/--capture-no-x``
    for a boolean); ``parse`` turns the option's text into the field's value. ``unset`` says what
    the option means when it is not given (its default is None): the launcher's help and
    ``doctor`` both show that text, so it is written once, here."""
    if default is None and not unset:
        raise TypeError(f"{flag}: an option whose default is None needs `unset`, what leaving it out means")
    meta = {"flag": flag, "help": help, "type": type, "choices": tuple(choices), "parse": parse, "unset": unset}
    return field(default=default, metadata={"option": meta})


def shown_value(name: str, value: Any) -> str:
    """An option's value as the launcher's help and ``doctor`` show it: what it means when unset."""
    if value is None:
        return next(f.metadata["option"]["unset"] for f in fields(CaptureConfig) if f.name == name)
    return str(value)


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


@dataclass(frozen=True)
class CaptureConfig:
    """Everything the patched server needs to know about capture.

    ``layers`` uses the package's single convention: i is the residual stream entering decoder
    layer i (= transformers' ``output_hidden_states[i]``); ``None`` means the model default,
    resolved by ``layers.resolve_layers`` once the model's depth is known. ``layers_from_draft``
    (a drafter config) is resolved into ``layers`` by the launcher, which also needs the model,
    and the configuration it publishes carries the layers, not the path.
    """

    capture_dir: str = option("--capture-dir", "Existing directory for capture files.")
    layers: Optional[List[int]] = option(
        "--capture-layers", "Comma-separated layer ids (input of layer i = HF hidden_states[i]).",
        parse=parse_layers, default=None, unset="the model's EAGLE-3 layers (3,31,59 for a 61-layer model)")
    layers_from_draft: Optional[str] = option(
        "--capture-layers-from-draft", "An EAGLE-3 drafter's config.json (or its directory): capture the layers "
        "SGLang captures when serving that drafter on this model (its eagle_aux_hidden_state_layer_ids by the "
        "model's rule, e.g. [1,29,57] -> 2,30,58 on Kimi-K2.5), to train it further. Excludes --capture-layers.",
        default=None, unset="none (the layers are --capture-layers')")
    keep_last_hidden: bool = option("--capture-keep-last/--capture-no-keep-last",
                                    "Also keep the final hidden state (which one: --capture-final).", default=True)
    final: str = option("--capture-final", "Which final hidden state to keep: post-norm (the lm_head's input, what "
                        "SpecForge trains on), pre-norm (before the model's final norm, what vLLM's speculators "
                        "trains on), or both.", choices=FINAL_CHOICES, default=POST_NORM)
    capture_dtype: str = option("--capture-dtype", "How hidden states are stored: in the model's serving dtype, "
                                "or fp8 (e4m3 with one scale per token and hidden-state vector, quantized on the GPU: "
                                "half the bytes, rows within cos 0.999; files say schema v2).",
                                choices=CAPTURE_DTYPES, default="model")
    codec: str = option("--capture-codec", "Compression of the hidden states on disk.", choices=CODECS, default="zstd")
    level: Optional[int] = option("--capture-level", "zstd level.", type=int, default=None,
                                  unset="entropy-first zstd settings tuned for activations (2-3x faster than level 1, "
                                        "same ratio)")
    shuffle: bool = option("--capture-shuffle/--capture-no-shuffle", "Byte-shuffle before zstd (better ratio on bf16).",
                           default=True)
    writers: int = option("--capture-writers", "Writer processes per node, split among its writer ranks "
                          "(0 = 3/4 of the cores, 2..16).", type=int, default=0)
    writer_nice: int = option("--capture-writer-nice", "How much lower the writer processes' CPU priority is than "
                              "the server's (0-19), for hosts short of cores.", type=int, default=0)
    writer_cpus: Optional[List[int]] = option(
        "--capture-writer-cpus", "CPUs the writer processes run on, as a list such as 8-15: keeps their "
        "compression off the cores SGLang's scheduler runs on.", parse=parse_cpu_list, default=None,
        unset="the CPUs the server may use")
    compress_threads: int = option("--capture-compress-threads", "zstd threads per file (0 = in the writer "
                                   "process, -1 = all cores).", type=int, default=0)
    switch_interval_ms: float = option("--capture-switch-interval-ms", "GIL switch interval of the scheduler "
                                       "process once writers run (0 = leave Python's 5 ms).", type=float, default=1.0)
    durability: str = option("--capture-durability", "How files reach the disk before a response says ok: file "
                             "(fsync each file and its name), none (no flush: a power loss can lose the last files).",
                             choices=DURABILITY_MODES, default="file")
    checksum: str = option("--capture-checksum", "Checksum of each file, in its reference and outcome: xxh3_128 "
                           "(fast, against accidental damage) or sha256 (cryptographic, about a third of the "
                           "writers' CPU at Kimi width).", choices=CHECKSUMS, default=DEFAULT_CHECKSUM)
    keep_page_cache: bool = option("--capture-keep-page-cache/--capture-drop-page-cache", "Leave written files in "
                                   "the page cache (by default their pages are dropped once flushed).", default=False)
    max_pending_mb: int = option("--capture-max-pending-mb", "Host memory per node for pending writes, split among "
                                 "its writer ranks, allocated (on a GPU: pinned) once at start-up; a rank waits "
                                 "beyond its share.", type=int, default=8192)
    wait_timeout_s: float = option("--capture-wait-timeout", "Seconds a response waits for its file.", type=float,
                                   default=600.0)
    index_retention_s: float = option("--capture-index-retention", "Seconds each request's outcome record is "
                                      "kept in CAPTURE_DIR/.index/ (longer than --capture-wait-timeout: a response "
                                      "waits on it), then swept.", type=float, default=3600.0)
    writer_stall_s: float = option("--capture-writer-stall-timeout", "Seconds a writer process may make no progress "
                                   "(a hung disk or network mount) before its file fails with status error and "
                                   "the process is killed and replaced.", type=float, default=120.0)

    hidden_states_requests: bool = option(
        "--capture-return-hidden-states/--capture-no-return-hidden-states",
        "Also capture every request that sets SGLang's return_hidden_states (its file replaces SGLang's JSON "
        "lists; custom_params.capture=false still gets the lists): the one capture flag the SGLang router "
        "forwards on /generate and /v1/chat/completions, which drop custom_params.", default=False)
    clients: Optional[str] = option(
        "--capture-clients", "Which clients may ask for hidden states, as a capture (custom_params.capture, or "
        "return_hidden_states with --capture-return-hidden-states) or as SGLang's JSON lists (return_hidden_states): "
        "any that may send the request, admin (only requests carrying SGLang's --admin-api-key as their bearer "
        "token), none (only --capture-fraction captures). Others get HTTP 400.",
        choices=CLIENT_POLICIES, default=None, unset="admin when SGLang's --admin-api-key is set, else any")
    fraction: float = option("--capture-fraction", "Capture this share (0-1) of all requests, chosen by a hash "
                             "of the request id (the same answer on every replica and retry), on every endpoint, "
                             "without any client asking; files are named by request id.", type=float, default=0.0)
    prefix_sharing: str = option(
        "--capture-prefix-sharing", "on: capture requests keep radix-cache hits where the hit's rows are stored, and "
        "each token's rows are stored once, in blocks under CAPTURE_DIR/.blocks that files reference (schema v3; "
        "load() and the tools put them together). off: every capture computes and stores its whole sequence in a "
        "self-contained file.", choices=SHARING_MODES, default="on")

    def __post_init__(self) -> None:
        if not os.path.isabs(self.capture_dir):
            object.__setattr__(self, "capture_dir", os.path.abspath(self.capture_dir))
        if self.codec not in CODECS:
            raise ConfigError(f"--capture-codec must be one of {', '.join(CODECS)}, got {self.codec!r}")
        if self.capture_dtype not in CAPTURE_DTYPES:
            raise ConfigError(f"--capture-dtype must be one of {', '.join(CAPTURE_DTYPES)}, got {self.capture_dtype!r}")
        if self.final not in FINAL_CHOICES:
            raise ConfigError(f"--capture-final must be one of {', '.join(FINAL_CHOICES)}, got {self.final!r}")
        if self.final != POST_NORM and not self.keep_last_hidden:
            raise ConfigError(f"--capture-final {self.final} keeps a final hidden state and --capture-no-keep-last "
                              "drops it: give one of the two")
        try:
            self.codec_spec()
        except ValueError as e:
            raise ConfigError(f"--capture-level: {e}") from None
        if self.checksum not in CHECKSUMS:
            raise ConfigError(f"--capture-checksum must be one of {', '.join(CHECKSUMS)}, got {self.checksum!r}")
        if self.durability not in DURABILITY_MODES:
            raise ConfigError(f"--capture-durability must be one of {', '.join(DURABILITY_MODES)}, got {self.durability!r}")
        if self.writers < 0:
            raise ConfigError(f"--capture-writers must be 0 (auto) or a positive count, got {self.writers}")
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
        if not self.index_retention_s > self.wait_timeout_s:
            raise ConfigError(f"--capture-index-retention ({self.index_retention_s:g} s) must be longer than "
                              f"--capture-wait-timeout ({self.wait_timeout_s:g} s): a response waits on its record")
        if self.clients is not None and self.clients not in CLIENT_POLICIES:
            raise ConfigError(f"--capture-clients must be one of {', '.join(CLIENT_POLICIES)}, got {self.clients!r}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigError(f"--capture-fraction must be between 0 and 1 (a share of requests), got {self.fraction:g}")
        if self.prefix_sharing not in SHARING_MODES:
            raise ConfigError(f"--capture-prefix-sharing must be on or off, got {self.prefix_sharing!r}")
        if not self.writer_stall_s > 0:
            raise ConfigError(f"--capture-writer-stall-timeout must be a positive number of seconds, got {self.writer_stall_s}")
        if self.layers_from_draft is not None:
            if self.layers is not None:
                raise ConfigError("--capture-layers and --capture-layers-from-draft exclude each other; give one")
            if not self.layers_from_draft:
                raise ConfigError("--capture-layers-from-draft is empty; give a drafter's config.json or its directory")
            object.__setattr__(self, "layers_from_draft", os.path.abspath(self.layers_from_draft))
        if self.layers is not None:
            if not self.layers:
                raise ConfigError("--capture-layers is empty; give comma-separated layer ids such as 3,31,59")
            if len(set(self.layers)) != len(self.layers):
                raise ConfigError(f"--capture-layers has duplicates: {self.layers}")
            object.__setattr__(self, "layers", sorted(self.layers))

    def writer_processes(self) -> int:
        """Writer processes to run: the configured count, or for 0 three quarters of the cores this
        process may use (of ``writer_cpus`` when set), between 2 and 16 (on the 16-core H200 host
        16 writers used ~8 cores at full capture, bench/RESULTS.md; beyond that the disk, not the
        CPU, bounds the writer)."""
        if self.writers:
            return self.writers
        try:
            cores = len(self.writer_cpus or os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 2
        return max(2, min(16, 3 * cores // 4))

    def codec_spec(self) -> Codec:
        """The on-disk codec these options select."""
        return Codec(name=self.codec, level=self.level, shuffle=self.shuffle, threads=self.compress_threads)

    @property
    def sharing(self) -> bool:
        """Whether capture requests share stored rows (``--capture-prefix-sharing on``)."""
        return self.prefix_sharing == "on"

    @property
    def max_pending_bytes(self) -> int:
        return self.max_pending_mb * (1 << 20)

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: Optional[dict] = None) -> Optional[CaptureConfig]:
        """The configuration the launcher published, or None when capture is not switched on."""
        raw = (os.environ if environ is None else environ).get(ENV_VAR)
        if not raw:
            return None
        try:
            return cls.from_json(raw)
        except (TypeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{ENV_VAR} is not a valid capture configuration: {e}") from None

    @classmethod
    def from_json(cls, raw: str) -> CaptureConfig:
        """The inverse of ``to_env`` (raises TypeError or JSONDecodeError on a bad document)."""
        return cls(**json.loads(raw))


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


def click_options(command: Callable) -> Callable:
    """Decorate a click command with one option per ``CaptureConfig`` field, in table order; the
    command then receives each as a keyword named after its field (``config_from_options``)."""
    import click

    for f in reversed(fields(CaptureConfig)):
        meta = f.metadata["option"]
        kwargs: Dict[str, Any] = {"help": meta["help"]}
        if meta["choices"]:
            kwargs["type"] = click.Choice(meta["choices"])
        elif meta["type"] is not None:
            kwargs["type"] = meta["type"]
        if f.default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default if meta["parse"] is None else None
            kwargs["show_default"] = True if f.default is not None else meta["unset"]
        command = click.option(meta["flag"], f.name, **kwargs)(command)
    return command


def config_from_options(values: Dict[str, Any]) -> CaptureConfig:
    """The configuration from ``click_options``' keywords (raises ConfigError)."""
    kwargs = {}
    for f in fields(CaptureConfig):
        value, parse = values[f.name], f.metadata["option"]["parse"]
        kwargs[f.name] = parse(value) if parse is not None and value is not None else value
    return CaptureConfig(**kwargs)
