"""Turning the seam table into live wrapt patches: version gate, fingerprints, idempotent (un)install.

Modelled on OpenTelemetry's ``BaseInstrumentor`` (declared supported versions, idempotent
``instrument()``/``uninstrument()``) and ddtrace's ``patch()``/``unpatch()`` with post-import
hooks: a seam is wrapped as soon as its SGLang module is imported, in whichever process that is.

State passes explicitly: each hook is bound to its process's state when it is installed (the
``CaptureConfig`` for seams of the HTTP process, the process's one ``SchedulerCapture`` for the
scheduler's), so no hook looks anything up in a module global.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import textwrap
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import wrapt

from sglang_capture.core.durable import checksum_tag
from sglang_capture.patches import Seam, Watched, load_table, supported_versions

if TYPE_CHECKING:
    from sglang_capture.core.config import CaptureConfig
    from sglang_capture.server.scheduler_capture import SchedulerCapture

logger = logging.getLogger(__name__)


class UnsupportedSGLang(RuntimeError):
    """The installed SGLang is not one the seam table covers, or its code changed under a seam."""


def installed_sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        raise UnsupportedSGLang("SGLang is not installed; install one of: " + ", ".join(supported_versions())) from None


def seams_for_installed() -> List[Seam]:
    """The seam table of the installed SGLang, or a one-line UnsupportedSGLang."""
    ver = installed_sglang_version()
    try:
        return load_table(ver)
    except KeyError:
        raise UnsupportedSGLang(
            f"sglang_capture supports SGLang {', '.join(supported_versions())}; found {ver}. "
            f"Install a supported release (pip install sglang=={supported_versions()[-1]})"
        ) from None


def fingerprint(func: Callable) -> str:
    """sha256 of a function's dedented source: what the seam table pins per SGLang version."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    src = textwrap.dedent(inspect.getsource(func))
    return checksum_tag(hashlib.sha256(src.encode()))


def _resolve(seam: Union[Seam, Watched]) -> Tuple[object, str, object]:
    module = importlib.import_module(seam.module)
    return wrapt.resolve_path(module, seam.target)


def _load_hook(seam: Seam) -> Callable:
    mod, _, name = seam.hook.partition(":")
    return getattr(importlib.import_module(mod), name)


def check_seam(seam: Seam) -> Optional[str]:
    """None when the installed function matches the table, else a one-line reason."""
    try:
        _, _, original = _resolve(seam)
    except (ImportError, AttributeError) as e:
        return f"{seam.module}.{seam.target} is missing ({e})"
    found = fingerprint(getattr(original, "__wrapped__", original))
    if found != seam.fingerprint:
        return f"{seam.module}.{seam.target} changed (fingerprint {found[:19]}, expected {seam.fingerprint[:19]})"
    return None


class CaptureInstrumentor:
    """Installs the capture hooks of one process; calling ``instrument`` twice is a no-op."""

    def __init__(self) -> None:
        self._originals: Dict[str, Tuple[object, str, object]] = {}
        self._instrumented = False
        self._config: Optional[CaptureConfig] = None
        self._scheduler: Optional[SchedulerCapture] = None

    def instrument(self, config: CaptureConfig, processes: Tuple[str, ...] = ("main", "scheduler")) -> None:
        """Wrap every seam for ``processes`` once its module is imported (now, if it already is),
        with hooks bound to the state ``config`` sets up."""
        if self._instrumented:
            return
        seams = [s for s in seams_for_installed() if s.process in processes]
        self._config = config
        self._instrumented = True
        for seam in seams:
            wrapt.when_imported(seam.module)(lambda _module, seam=seam: self._patch(seam))

    def _patch(self, seam: Seam) -> None:
        if not self._instrumented or seam.seam in self._originals:
            return
        problem = check_seam(seam)
        if problem:
            raise UnsupportedSGLang(f"refusing to patch: {problem}; this SGLang build is not the one the seam table was made for")
        parent, attribute, original = _resolve(seam)
        self._originals[seam.seam] = (parent, attribute, original)
        wrapt.wrap_function_wrapper(parent, attribute, functools.partial(_load_hook(seam), self._state_for(seam)))
        logger.debug("sglang_capture: patched %s.%s", seam.module, seam.target)

    def _state_for(self, seam: Seam) -> Any:
        """What the seam's hook is bound to: the config in the HTTP process, else the scheduler state."""
        if seam.process == "main":
            return self._config
        if self._scheduler is None:
            from sglang_capture.server.scheduler_capture import SchedulerCapture

            self._scheduler = SchedulerCapture(self._config)
        return self._scheduler

    def unbound_copies(self) -> List[str]:
        """Modules that imported a patched module-level function by name before it was patched, and so
        still call the original (SGLang's OpenAI modules import ``process_hidden_states_from_ret``)."""
        import sys

        stale = []
        for parent, attribute, original in self._originals.values():
            if not inspect.ismodule(parent):
                continue
            for name, module in list(sys.modules.items()):
                if name.startswith("sglang.") and getattr(module, attribute, None) is original:
                    stale.append(f"{name}.{attribute}")
        return stale

    def uninstrument(self) -> None:
        """Put every original function back; later imports are not patched either."""
        for parent, attribute, original in self._originals.values():
            setattr(parent, attribute, original)
        self._originals.clear()
        self._instrumented = False
        self._config = self._scheduler = None


INSTRUMENTOR = CaptureInstrumentor()
