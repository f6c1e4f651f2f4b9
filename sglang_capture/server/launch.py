"""``python -m sglang_capture.launch [--capture-* options] <sglang.launch_server args>``.

Validates the capture options against the model and the installed SGLang *before* anything
is started (each problem is one line and a non-zero exit), publishes the configuration in the
environment, switches on SGLang's ``--enable-return-hidden-states`` and runs SGLang's normal
HTTP server. The scheduler processes pick the configuration up through the plugin entry point.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import click

from sglang_capture.core.capture_dir import prepare_capture_dir
from sglang_capture.core.config import (
    ENV_VAR,
    CaptureConfig,
    ConfigError,
    check_writer_cpus,
    click_options,
    config_from_options,
)
from sglang_capture.core.final_state import PRE_NORM, kept_states
from sglang_capture.core.layers import (
    LayerError,
    draft_capture_layers,
    layers_from_eagle3_ids,
    read_draft_eagle3_ids,
    resolve_layers,
)
from sglang_capture.core.protocol import capture_info_body
from sglang_capture.core.selection import effective_policy, who_captures
from sglang_capture.patches.version_gate import UnsupportedSGLang, check_seam, seams_for_installed
from sglang_capture.server.capture_info import add_route
from sglang_capture.server.instrumentor import INSTRUMENTOR
from sglang_capture.server.pd_prefill import is_pd_prefill
from sglang_capture.server.peers import needs_shared_dir

SPECULATIVE_ALGORITHMS = ("EAGLE3",)  # whose target keeps aux layers that this package can capture


def check_interpreter() -> None:
    """Refuse ``python -O`` (or ``PYTHONOPTIMIZE``): it strips ``assert`` statements, and SGLang 0.5.17-0.5.19
    check the count of captured layers with one only (``AuxHiddenStatePacker.finalize``), so a miscount
    would hand the files a buffer with layers missing, silently."""
    if sys.flags.optimize:
        raise ConfigError("python -O (or PYTHONOPTIMIZE) strips the asserts with which SGLang checks the count of "
                          "captured layers (AuxHiddenStatePacker.finalize), so a miscount would go into the files "
                          "unnoticed; start the launcher without -O and with PYTHONOPTIMIZE unset")


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


def check_transfer_engine(backend: str) -> None:
    """A PD prefill server whose transfer engine cannot load would fail in its scheduler, after start."""
    if backend not in ("mooncake", "mooncake_tcp"):
        return
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"--disaggregation-transfer-backend mooncake (or mooncake_tcp) needs Mooncake's transfer "
                          f"engine, which does not load ({e}); pip install mooncake-transfer-engine (or -non-cuda on a "
                          f"CPU host)") from None


def refuse_sglang_aux_capture(server_args, num_layers: int, architecture: str) -> None:
    """SGLang 0.5.23's own aux capture (``--enable-return-aux-hidden-states``, with
    ``--return-aux-hidden-state-layer-ids``) sets the layers through the same setter as capture and
    returns aux rows in place of plain requests' hidden states: refused in one line naming the
    ``--capture-layers`` that capture exactly those layers (EAGLE-3 convention)."""
    if not getattr(server_args, "enable_return_aux_hidden_states", False):
        return
    # what --speculative-algorithm names under the flag (resolved into aux_hidden_state_capture when the server starts)
    convention = str(getattr(server_args, "aux_hidden_state_capture", None)
                     or getattr(server_args, "speculative_algorithm", None) or "").lower()
    ids = getattr(server_args, "return_aux_hidden_state_layer_ids", None)
    given = "--return-aux-hidden-state-layer-ids " + ",".join(map(str, ids)) if ids else "SGLang's default ids"
    instead = "choose them with --capture-layers"
    if convention == "eagle3":
        try:
            layers = layers_from_eagle3_ids(ids, num_layers, architecture, "--return-aux-hidden-state-layer-ids")
            instead = f"--capture-layers {','.join(map(str, layers))} captures the layers of {given} on this {architecture}"
        except LayerError:
            pass
    raise ConfigError(f"capture sets the layers SGLang keeps itself: drop --enable-return-aux-hidden-states (and "
                      f"--return-aux-hidden-state-layer-ids); {instead}")


def check_server_args(server_args) -> None:
    """Reject SGLang settings under which captured rows would be wrong or incomplete."""
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm and str(algorithm).upper() not in SPECULATIVE_ALGORITHMS:
        raise ConfigError(f"capture on a server that speculates supports --speculative-algorithm EAGLE3 (its target "
                          f"keeps the aux layers the draft reads), not {algorithm}; use EAGLE3 or drop it")
    if algorithm and getattr(server_args, "enable_multi_layer_eagle", False):
        raise ConfigError("capture does not support --enable-multi-layer-eagle (its tree verify keeps rejected rows "
                          "in place); drop it")
    if algorithm and is_pd_prefill(server_args):
        raise ConfigError("capture on a PD prefill server that speculates is untested; drop --speculative-algorithm "
                          "there (the prefill server's prompt rows do not depend on the draft)")
    if getattr(server_args, "pp_size", 1) > 1:
        raise ConfigError("capture needs --pp-size 1 (aux layers must all live on one pipeline stage)")
    if getattr(server_args, "enable_two_batch_overlap", False):
        raise ConfigError("capture does not support --enable-two-batch-overlap (it skips the aux capture)")
    # 0.5.17 resolves an unset mode to "full" when parsing; 0.5.23 leaves it None until resolution
    if getattr(server_args, "return_hidden_states_mode", None) not in (None, "full"):
        raise ConfigError("capture needs --return-hidden-states-mode full (or leave it unset)")
    if getattr(server_args, "disaggregation_mode", "null") == "decode":
        raise ConfigError("a PD decode server computes no prompt rows (it receives the prompt's KV cache): start it "
                          "with python -m sglang.launch_server and capture on the prefill servers "
                          "(--disaggregation-mode prefill through sglang_capture.launch)")
    if is_pd_prefill(server_args):
        check_transfer_engine(server_args.disaggregation_transfer_backend)
    if needs_shared_dir(server_args) and not getattr(server_args, "enable_dp_attention", False):
        raise ConfigError("capture supports --dp > 1 across several nodes only with --enable-dp-attention (data-parallel "
                          "replicas across nodes are untested); use --nnodes 1, or --enable-dp-attention")
    if os.environ.get("SGLANG_USE_PICKLE_IPC", "1") == "0":
        raise ConfigError("capture needs SGLang's default pickle IPC; unset SGLANG_USE_PICKLE_IPC")


def resolve_capture_layers(config: CaptureConfig, num_layers: int, architecture: str) -> List[int]:
    """The layers this server captures (package convention), or a one-line ConfigError.

    With ``--capture-layers-from-draft`` they are the layers SGLang itself would capture when
    serving that drafter on this model (core/layers.py applies SGLang's rule to the drafter's
    ``eagle_config.eagle_aux_hidden_state_layer_ids``, or SGLang's default without ids): the
    drafter is then trained further on exactly the features the server will give it.
    """
    option = "--capture-layers-from-draft"
    try:
        if config.layers_from_draft is not None:
            draft = read_draft_eagle3_ids(config.layers_from_draft, option)
            return resolve_layers(draft_capture_layers(draft, num_layers, architecture, option), num_layers, architecture)
        return resolve_layers(config.layers, num_layers, architecture)
    except LayerError as e:
        raise ConfigError(str(e)) from None


def draft_config(server_args: Any) -> str:
    """The served draft's config.json: in its local directory, or fetched from the Hugging Face hub
    at ``--speculative-draft-model-revision`` as SGLang will fetch the draft."""
    path = getattr(server_args, "speculative_draft_model_path", None)
    if not path:
        raise ConfigError("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path (the EAGLE-3 draft)")
    if os.path.exists(str(path)):
        return str(path)
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(str(path), "config.json", revision=getattr(server_args, "speculative_draft_model_revision", None))
    except Exception as e:  # many failure types: no network, unknown repo, gated repo
        raise ConfigError(f"--speculative-draft-model-path {path}: no such directory, and its config.json could not be "
                          f"fetched from the Hugging Face hub ({type(e).__name__}); give the draft's local directory") from None


def speculative_layers(server_args: Any, config: CaptureConfig, num_layers: int, architecture: str) -> Optional[List[int]]:
    """On a server that speculates with EAGLE-3, the layers its served draft makes SGLang capture
    (the only ones the target computes), or None on a server that does not speculate.

    A server that speculates captures those layers and no others: other ``--capture-layers`` or
    ``--capture-layers-from-draft`` would need a second set of aux layers in every forward, so
    they are refused in one line rather than silently replaced."""
    if not getattr(server_args, "speculative_algorithm", None):
        return None
    option = "--speculative-draft-model-path"
    try:
        served = read_draft_eagle3_ids(draft_config(server_args), option)
        if not served.use_aux_hidden_state:
            raise LayerError(f"{option} {served.path} sets eagle_config.use_aux_hidden_state false: its target captures "
                             "no aux layers, so there is nothing to capture; serve an EAGLE-3 draft that reads them")
        layers = draft_capture_layers(served, num_layers, architecture, option)
        asked = resolve_capture_layers(config, num_layers, architecture) if (
            config.layers is not None or config.layers_from_draft is not None) else layers
    except LayerError as e:
        raise ConfigError(str(e)) from None
    if asked != layers:
        given = "--capture-layers" if config.layers is not None else "--capture-layers-from-draft"
        raise ConfigError(f"{given} asks for layers {','.join(map(str, asked))}, but the served draft makes this server "
                          f"capture layers {','.join(map(str, layers))}; a server that speculates captures its draft's "
                          f"layers: drop {given}")
    return layers


def resolve_clients(clients: Optional[str], server_args: Any) -> str:
    """``--capture-clients`` as the server applies it: unset means admin when SGLang has an admin key."""
    admin_key = getattr(server_args, "admin_api_key", None)
    if clients == "admin" and not admin_key:
        raise ConfigError("--capture-clients admin lets only requests with SGLang's admin API key ask for capture, "
                          "and none is set: add --admin-api-key KEY")
    return effective_policy(clients, admin_key)


def check_final_state(config: CaptureConfig, server_args: Any) -> None:
    """``--capture-final pre-norm|both`` keeps the final norm's input with a hook that a prefill
    CUDA graph's replay does not run (server/pre_norm.py): refuse it unless prefill graphs are off."""
    if PRE_NORM not in kept_states(config.final) or str(getattr(server_args, "device", "")) == "cpu":
        return  # a CPU server has no prefill graphs (0.5.23's CPU graph, under --enable-torch-compile, is decode only)
    prefill = getattr(getattr(server_args, "cuda_graph_config", None), "prefill", None)
    backend = getattr(prefill, "backend", None)
    backend = str(getattr(backend, "value", backend)) if backend is not None else None
    off = backend == "disabled" or (backend is None and (getattr(server_args, "disable_cuda_graph", False)
                                                         or getattr(server_args, "disable_prefill_cuda_graph", False)))
    if not off:
        raise ConfigError(f"--capture-final {config.final} needs eager prefill: SGLang's prefill CUDA graphs "
                          f"({backend or 'on'}) replay the model's final norm without the hook that keeps its input; "
                          "add --disable-prefill-cuda-graph (decode CUDA graphs are fine)")


def prepare(config: CaptureConfig, sglang_args: Sequence[str]) -> Tuple[Any, CaptureConfig, Dict[str, Any]]:
    """Validate everything, publish the configuration, and return SGLang's parsed server args, the
    configuration as published (a drafter's layers resolved) and the body of ``/capture_info``."""
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

    try:
        server_args = prepare_server_args(argv)
        # 0.5.23 checks and resolves its arguments only when the server starts (0.5.17 while
        # parsing); resolving now makes its refusals one line here, not a traceback after start.
        # It is done once per record: the server's own call then returns at once.
        if hasattr(server_args, "resolve_once"):
            server_args.resolve_once()
    except (AssertionError, ValueError) as e:  # SGLang's own checks of its arguments
        raise ConfigError(f"SGLang refused its arguments: {e}") from None
    arch, num_layers = read_model_shape(server_args.model_path, server_args.trust_remote_code)
    refuse_sglang_aux_capture(server_args, num_layers, arch)  # first: under it --speculative-algorithm names no draft
    check_server_args(server_args)
    check_final_state(config, server_args)
    served = speculative_layers(server_args, config, num_layers, arch)
    layers = served if served is not None else resolve_capture_layers(config, num_layers, arch)
    if served is not None:
        source = f"sglang_capture: the server speculates with {server_args.speculative_draft_model_path}: capturing its layers"
    elif config.layers_from_draft is not None:
        source = f"--capture-layers-from-draft {config.layers_from_draft}: capturing layers"
    else:
        source = ""
    if source:
        click.echo(f"{source} {','.join(map(str, layers))} of {arch}", err=True)
        # the schedulers resolve config.layers themselves: hand them a drafter's layers, not its path
        config = replace(config, layers=layers, layers_from_draft=None)
    config = replace(config, clients=resolve_clients(config.clients, server_args))
    said, warning = who_captures(config.fraction, config.hidden_states_requests, str(server_args.host),
                                 bool(server_args.api_key), config.clients, by_session=config.sharing)
    click.echo(f"sglang_capture: {said}", err=True)
    if warning:
        click.echo(f"sglang_capture: warning: {warning}", err=True)
    os.environ[ENV_VAR] = config.to_env()
    spec = {"algorithm": str(server_args.speculative_algorithm),
            "draft": str(server_args.speculative_draft_model_path)} if served is not None else None
    return server_args, config, capture_info_body(config, str(server_args.model_path), arch, layers, said, spec)


REMOVED_OPTIONS = {
    "--capture-gc-freeze": "no full garbage collection runs under traffic once the server is up (bench/RESULTS.md, "
                           "r69-r72); drop the option",
    "--capture-no-gc-freeze": "it is the behaviour now; drop the option",
}


def check_no_unknown_capture_options(sglang_args: Tuple[str, ...]) -> None:
    """SGLang has no ``--capture-*`` option: one among the arguments passed on is a typo or a removed
    option, which SGLang's own parser would refuse only after a screen of its usage."""
    for arg in sglang_args:
        name = arg.split("=", 1)[0]
        if name in REMOVED_OPTIONS:
            raise ConfigError(f"{name} was removed: {REMOVED_OPTIONS[name]}")
        if name.startswith("--capture-"):
            raise ConfigError(f"no such option {name}; `python -m sglang_capture.launch --help` lists the --capture-* options")


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True, "max_content_width": 100},
    epilog="Every other argument is passed to sglang.launch_server unchanged.",
)
@click_options
@click.argument("sglang_args", nargs=-1, type=click.UNPROCESSED)
def main(sglang_args: Tuple[str, ...], **options: Any) -> None:
    """Start an SGLang server that writes captured hidden states to CAPTURE_DIR."""
    try:
        check_interpreter()
        check_no_unknown_capture_options(sglang_args)
        config = config_from_options(options)
        check_capture_dir(config.capture_dir)
        check_writer_cpus(config.writer_cpus)
        if not sglang_args:
            raise ConfigError("no SGLang arguments given; add at least --model-path PATH")
        from sglang.srt.plugins import load_plugins

        load_plugins()
        server_args, config, info = prepare(config, sglang_args)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    # before SGLang's HTTP server is imported: its OpenAI modules bind the patched
    # process_hidden_states_from_ret by name when they are imported (add_route imports them)
    INSTRUMENTOR.instrument(config)
    add_route(info)
    unbound = INSTRUMENTOR.unbound_copies()
    if unbound:
        raise click.ClickException(f"{unbound[0]} was imported before the capture patches were installed (a plugin "
                                   "loaded first?): OpenAI responses would carry no capture reference")
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
