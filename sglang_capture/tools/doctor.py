"""``sglang-capture doctor``: can capture run here, and with which settings?

Checks, without starting a server: the installed SGLang is a supported release, every SGLang
function the seam table patches still has its recorded fingerprint, the plugin entry point that
reaches SGLang's spawned processes is installed, and shows the capture configuration a server
started from this environment would use. Any failed check makes the exit code 1.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import asdict
from importlib.metadata import entry_points
from typing import List, Optional, Sequence, Tuple

from sglang_capture.core.config import ENV_VAR, CaptureConfig, ConfigError, shown_value
from sglang_capture.patches.version_gate import (
    UnsupportedSGLang,
    check_seam,
    installed_sglang_version,
    seams_for_installed,
)

PLUGIN_GROUP = "sglang.srt.plugins"


def diagnose(seams: Optional[Sequence] = None) -> Tuple[List[str], bool]:
    """Report lines and whether everything needed for capture is in order."""
    from sglang_capture import __version__
    from sglang_capture.patches import BASE_RELEASES, table_path
    from sglang_capture.patches import supported_versions as supported

    lines = [f"sglang_capture {__version__}; supported SGLang: {', '.join(supported())}"]
    ok = True
    try:
        version = installed_sglang_version()
        lines.append(f"installed SGLang: {version}")
        table = list(seams) if seams is not None else seams_for_installed()
    except UnsupportedSGLang as e:
        return lines + [f"FAIL {e}"], False
    if seams is None:
        noted = sum(bool(s.differs) for s in table)
        lines.append(f"seam table: {table_path(version)}" + (
            f" ({noted} of its {len(table)} functions differ from SGLang {' and '.join(BASE_RELEASES)}'s, each read against "
            "its hook: see their differs)" if noted else ""))
    for seam in table:
        with warnings.catch_warnings():  # importing SGLang modules on a CPU warns about kernels
            warnings.simplefilter("ignore")
            problem = check_seam(seam)
        ok &= problem is None
        lines.append(f"{'ok  ' if problem is None else 'FAIL'} {seam.seam}: {seam.module}.{seam.target}"
                     + (f": {problem}" if problem else " matches its fingerprint"))
    plugins = {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP)}
    if "sglang_capture" in plugins:
        lines.append(f"ok   plugin entry point {PLUGIN_GROUP}: sglang_capture = {plugins['sglang_capture']}")
    else:
        ok = False
        lines.append(f"FAIL plugin entry point {PLUGIN_GROUP}:sglang_capture is not installed; reinstall the package")
    try:
        config = CaptureConfig.from_env()
    except ConfigError as e:
        return lines + [f"FAIL {e}"], False
    if config is None:
        lines.append(f"{ENV_VAR} is not set: plain SGLang servers here are unpatched; "
                     "python -m sglang_capture.launch would use (defaults):")
        config = CaptureConfig(capture_dir=os.getcwd())
        shown = {k: v for k, v in asdict(config).items() if k != "capture_dir"}
    else:
        lines.append(f"{ENV_VAR} is set (capture is on in servers started from this environment):")
        shown = asdict(config)
    if not config.writers:
        shown["writers"] = f"auto ({config.writer_processes()} here)"
    for key, value in shown.items():
        lines.append(f"  {key} = {shown_value(key, value)}")
    return lines, ok


def server_report(url: str, api_key: Optional[str] = None) -> Tuple[List[str], bool]:
    """What a running capture server at ``url`` (or each capture worker of an SGLang router there)
    says about itself: capture dir, model, layers, and who makes its requests capture."""
    from sglang_capture.tools.client import ServerError, discover_servers

    lines: List[str] = []
    try:
        servers = discover_servers([url], api_key=api_key, say=lines.append)
    except ServerError as e:
        return lines + [f"FAIL {e}"], False
    for server in servers:
        body = server.info
        lines.append(f"ok   {server.url}: capture server (sglang_capture {body.get('sglang_capture')}), model "
                     f"{body.get('model_path')}, layers {body.get('layers')}, final state {body.get('final', 'post-norm') or 'none'}, "
                     f"files in {body.get('capture_dir')}")
        lines.append(f"     {body.get('who_captures') or 'who captures: not said (an older sglang_capture)'}")
        sharing = body.get("prefix_sharing")
        lines.append("     prefix sharing: " + {"on": "on (cached prefixes reused where their rows are stored; files "
                                                      "reference rows stored once under the capture dir's .blocks)",
                                                "off": "off (every file holds its whole sequence)"}.get(
            sharing, "not said (an older sglang_capture: off)"))
        spec = body.get("speculative")
        if spec:
            lines.append(f"     speculates with {spec.get('algorithm')} (draft {spec.get('draft')}): its draft fixes the "
                         f"layers captured, {body.get('layers')}; captures hold prompt rows and accepted output rows")
    return lines, True
