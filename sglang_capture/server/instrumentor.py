"""Turning the seam table into live wrapt patches, idempotently (the version gate that decides
whether to: patches/version_gate.py).

Modelled on OpenTelemetry's ``BaseInstrumentor`` (declared supported versions, idempotent
``instrument()``/``uninstrument()``) and ddtrace's ``patch()``/``unpatch()`` with post-import
hooks: a seam is wrapped as soon as its SGLang module is imported, in whichever process that is.

State passes explicitly: each hook is bound to its process's state when it is installed (the
``CaptureConfig`` for seams of the HTTP process, the process's one ``SchedulerCapture`` for the
scheduler's), so no hook looks anything up in a module global.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import wrapt

from sglang_capture.patches import Seam
from sglang_capture.patches.version_gate import UnsupportedSGLang, check_seam, resolve, seams_for_installed

if TYPE_CHECKING:
    from sglang_capture.core.config import CaptureConfig
    from sglang_capture.server.scheduler_capture import SchedulerCapture

logger = logging.getLogger(__name__)


def _load_hook(seam: Seam) -> Callable:
    mod, _, name = seam.hook.partition(":")
    return getattr(importlib.import_module(mod), name)


class CaptureInstrumentor:
    """Installs the capture hooks of one process; calling ``instrument`` twice is a no-op."""

    def __init__(self) -> None:
        self._originals: Dict[str, Tuple[object, str, object]] = {}
        self._rebound: List[Tuple[object, str, object]] = []  # modules that had bound a patched function by name
        self._instrumented = False
        self._config: Optional[CaptureConfig] = None
        self._scheduler: Optional[SchedulerCapture] = None

    def instrument(self, config: CaptureConfig, processes: Tuple[str, ...] = ("http", "scheduler")) -> None:
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
        parent, attribute, original = resolve(seam)
        self._originals[seam.seam] = (parent, attribute, original)
        wrapt.wrap_function_wrapper(parent, attribute, functools.partial(_load_hook(seam), self._state_for(seam)))
        if inspect.ismodule(parent):
            self._rebind(parent, attribute, original)
        logger.debug("sglang_capture: patched %s.%s", seam.module, seam.target)

    def _rebind(self, parent: object, attribute: str, original: object) -> None:
        """Modules already imported that bound the module-level function ``attribute`` by name
        (``from m import f``) get the patched one too: the launcher's fingerprint check imports the
        modules of every seam before the patches go in, so import order cannot decide it."""
        patched = getattr(parent, attribute)
        for name, module in list(sys.modules.items()):
            if name.startswith("sglang.") and module is not parent and getattr(module, attribute, None) is original:
                setattr(module, attribute, patched)
                self._rebound.append((module, attribute, original))

    def _state_for(self, seam: Seam) -> Any:
        """What the seam's hook is bound to: the config in the HTTP process, else the scheduler state."""
        if seam.process == "http":
            return self._config
        if self._scheduler is None:
            from sglang_capture.server.scheduler_capture import SchedulerCapture

            self._scheduler = SchedulerCapture(self._config)
        return self._scheduler

    def unbound_copies(self) -> List[str]:
        """Modules that imported a patched module-level function by name before it was patched, and so
        still call the original (SGLang's OpenAI modules import ``process_hidden_states_from_ret``)."""
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
        for parent, attribute, original in [*self._originals.values(), *self._rebound]:
            setattr(parent, attribute, original)
        self._originals.clear()
        self._rebound.clear()
        self._instrumented = False
        if self._scheduler is not None:
            self._scheduler.stop()
        self._config = self._scheduler = None


INSTRUMENTOR = CaptureInstrumentor()
