"""``python -m sglang_capture.launch [--capture-* options] <sglang.launch_server args>``.

Validates the capture options against the model and the installed SGLang *before* anything
is started (each problem is one line and a non-zero exit), publishes the configuration in the
environment, switches on SGLang's ``--enable-return-hidden-states`` and runs SGLang's normal
HTTP server. The scheduler processes pick the configuration up through the plugin entry point.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import List, Optional, Sequence, Tuple

import click

from sglang_capture.config import ENV_VAR, CaptureConfig, ConfigError, check_writer_cpus, parse_cpu_list, parse_layers
from sglang_capture.durability import DURABILITY_MODES
from sglang_capture.format import CODECS
from sglang_capture.instrumentor import INSTRUMENTOR, UnsupportedSGLang, check_seam, seams_for_installed
from sglang_capture.layers import LayerError, resolve_layers
from sglang_capture.server_info import add_route, describe
from sglang_capture.publish import prepare_capture_dir

if __name__ == "__mp_main__":  # spawn re-runs the launcher module in every child: patch there too
    from sglang_capture.plugin import register

    register()


def check_capture_dir(path: str) -> str:
    """An existing, writable directory, or a one-line ConfigError."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"--capture-dir {path} does not exist; create it first (mkdir -p {path})")
    if not os.path.isdir(path):
        raise ConfigError(f"--capture-dir {path} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".sglang-capture-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--capture-dir {path} is not writable ({e.strerror})") from None
    try:
        prepare_capture_dir(path)
    except OSError as e:
        raise ConfigError(f"--capture-dir: {e}") from None
    return path


def read_model_shape(model_path: str, trust_remote_code: bool) -> Tuple[str, int]:
    """(architecture, number of decoder layers) from the model's config, text part for VLMs."""
    cfg_file = os.path.join(model_path, "config.json")
    try:
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                cfg = json.load(f)
        else:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).to_dict()
        arch = (cfg.get("architectures") or ["<unknown>"])[0]
        text = cfg.get("text_config") or cfg
        return arch, int(text["num_hidden_layers"])
    except Exception as e:  # many unrelated failure types: missing files, hub access, bad JSON
        raise ConfigError(f"cannot read the model config of {model_path} to check the capture layers: {e}") from None


def check_server_args(server_args) -> None:
    """Reject SGLang settings under which captured rows would be wrong or incomplete."""
    if getattr(server_args, "speculative_algorithm", None):
        raise ConfigError("capture does not support speculative decoding; drop --speculative-algorithm")
    if getattr(server_args, "pp_size", 1) > 1:
        raise ConfigError("capture needs --pp-size 1 (aux layers must all live on one pipeline stage)")
    if getattr(server_args, "enable_two_batch_overlap", False):
        raise ConfigError("capture does not support --enable-two-batch-overlap (it skips the aux capture)")
    # 0.5.17 resolves an unset mode to "full" when parsing; 0.5.23 leaves it None until resolution
    if getattr(server_args, "return_hidden_states_mode", None) not in (None, "full"):
        raise ConfigError("capture needs --return-hidden-states-mode full (or leave it unset)")
    if getattr(server_args, "disaggregation_mode", "null") not in (None, "null"):
        raise ConfigError("capture does not support --disaggregation-mode yet: a prefill server's results bypass "
                          "the seams that take the rows, so every capture would fail; capture on a server without it")
    if getattr(server_args, "nnodes", 1) > 1 and getattr(server_args, "dp_size", 1) > 1:
        raise ConfigError("capture does not support --dp > 1 across several nodes yet: a DP group on another node "
                          "writes to that node's disk while node 0 answers; use --nnodes 1, or --dp 1 across nodes")
    if os.environ.get("SGLANG_USE_PICKLE_IPC", "1") == "0":
        raise ConfigError("capture needs SGLang's default pickle IPC; unset SGLANG_USE_PICKLE_IPC")


def prepare(config: CaptureConfig, sglang_args: Sequence[str]):
    """Validate everything, publish the configuration, and return SGLang's parsed server args."""
    try:
        seams = seams_for_installed()
    except UnsupportedSGLang as e:
        raise ConfigError(str(e)) from None
    problems = [p for p in (check_seam(s) for s in seams) if p]
    if problems:
        raise ConfigError(f"the installed SGLang differs from the supported release: {problems[0]}")
    argv: List[str] = list(sglang_args)
    if "--enable-return-hidden-states" not in argv:
        argv.append("--enable-return-hidden-states")
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)
    check_server_args(server_args)
    arch, num_layers = read_model_shape(server_args.model_path, server_args.trust_remote_code)
    try:
        layers = resolve_layers(config.layers, num_layers, arch)
    except LayerError as e:
        raise ConfigError(str(e)) from None
    os.environ[ENV_VAR] = config.to_env()
    add_route(describe(config, str(server_args.model_path), arch, layers))
    return server_args


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True, "max_content_width": 100},
    epilog="Every other argument is passed to sglang.launch_server unchanged.",
)
@click.option("--capture-dir", required=True, type=click.Path(file_okay=False), help="Existing directory for capture files.")
@click.option("--capture-layers", default=None, help="Comma-separated layer ids (input of layer i = HF hidden_states[i]). Default: EAGLE-3's, 3,31,59 for a 61-layer model.")
@click.option("--capture-keep-last/--capture-no-keep-last", default=True, show_default=True, help="Also keep the final post-norm hidden state.")
@click.option("--capture-codec", type=click.Choice(CODECS), default="zstd", show_default=True)
@click.option("--capture-level", type=int, default=None, help="zstd level. Default: entropy-first settings tuned for activations (2-3x faster than level 1, same ratio).")
@click.option("--capture-shuffle/--capture-no-shuffle", default=True, show_default=True, help="Byte-shuffle before zstd (better ratio on bf16).")
@click.option("--capture-writers", "--capture-writer-threads", "capture_writer_threads", type=int, default=0, show_default=True,
              help="Writer processes per node, split among its writer ranks (0 = 3/4 of the cores, 2..16). "
                   "--capture-writer-threads is the old name.")
@click.option("--capture-writer-nice", type=int, default=0, show_default=True,
              help="How much lower the writer processes' CPU priority is than the server's (0-19), for hosts short of cores.")
@click.option("--capture-writer-cpus", default=None, help="CPUs the writer processes run on, as a list such as 8-15 "
              "(default: the server's): keeps their compression off the cores SGLang's scheduler runs on.")
@click.option("--capture-compress-threads", type=int, default=0, show_default=True, help="zstd threads per file (0 = in the writer process, -1 = all cores).")
@click.option("--capture-switch-interval-ms", type=float, default=1.0, show_default=True, help="GIL switch interval of the scheduler process once writers run (0 = leave Python's 5 ms).")
@click.option("--capture-durability", type=click.Choice(DURABILITY_MODES), default="file", show_default=True, help="How files reach the disk before a response says ok: file (fsync each file and its name), group (one shared syncfs(2) per batch of files), none (no flush: a power loss can lose the last files).")
@click.option("--capture-keep-page-cache", is_flag=True, default=False, help="Leave written files in the page cache (by default their pages are dropped once flushed).")
@click.option("--capture-gather-in-forward/--capture-gather-after-forward", default=True, show_default=True,
              help="Where a shared batch's captured rows are picked out: in an eager forward (only they are concatenated) "
                   "or after it, from the whole batch's concat (the earlier behaviour, kept for comparison).")
@click.option("--capture-max-pending-mb", type=int, default=8192, show_default=True, help="Host memory per node for pending writes, split among its writer ranks, allocated (on a GPU: pinned) once at "
                   "start-up; a rank waits beyond its share.")
@click.option("--capture-wait-timeout", type=float, default=600.0, show_default=True, help="Seconds a response waits for its file.")
@click.argument("sglang_args", nargs=-1, type=click.UNPROCESSED)
def main(capture_dir: str, capture_layers: Optional[str], capture_keep_last: bool, capture_codec: str,
         capture_level: Optional[int], capture_shuffle: bool, capture_writer_threads: int, capture_writer_nice: int, capture_writer_cpus: Optional[str], capture_compress_threads: int,
         capture_switch_interval_ms: float, capture_durability: str, capture_keep_page_cache: bool, capture_gather_in_forward: bool, capture_max_pending_mb: int, capture_wait_timeout: float, sglang_args: Tuple[str, ...]) -> None:
    """Start an SGLang server that writes captured hidden states to CAPTURE_DIR."""
    try:
        config = CaptureConfig(
            capture_dir=check_capture_dir(capture_dir),
            layers=parse_layers(capture_layers) if capture_layers is not None else None,
            keep_last_hidden=capture_keep_last,
            codec=capture_codec,
            level=capture_level,
            shuffle=capture_shuffle,
            writer_threads=capture_writer_threads,
            writer_nice=capture_writer_nice,
            writer_cpus=parse_cpu_list(capture_writer_cpus) if capture_writer_cpus is not None else None,
            compress_threads=capture_compress_threads,
            switch_interval_ms=capture_switch_interval_ms,
            durability=capture_durability,
            keep_page_cache=capture_keep_page_cache,
            gather_in_forward=capture_gather_in_forward,
            max_pending_mb=capture_max_pending_mb,
            wait_timeout_s=capture_wait_timeout,
        )
        check_writer_cpus(config.writer_cpus)
        if not sglang_args:
            raise ConfigError("no SGLang arguments given; add at least --model-path PATH")
        from sglang.srt.plugins import load_plugins

        load_plugins()
        server_args = prepare(config, sglang_args)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    INSTRUMENTOR.instrument()
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(prog_name="python -m sglang_capture.launch")
