"""The pre-norm final hidden state: the residual stream the model's final norm reads.

SGLang's models hand the logits processor only the normalized final state. A forward hook on the
inner model's final norm (``model.norm``) keeps what that norm read, for ``append_final_hidden``
(hooks/model.py) to put beside the post-norm state. The norm is called with the last layer's
output and its residual and returns (normalized, output + residual): the second is the pre-norm
state, in the serving dtype, as the aux layers' ``hidden_states + residual`` are. Called without
a residual, its input is the pre-norm state. The hook keeps a reference, never a copy; in a decode
CUDA graph the hook and the logits processor are captured together, so the graph's replay keeps
the state too. A prefill CUDA graph replays the model's body without running Python hooks (the
breakable and full backends also leave the logits processor out of the graph), so the launcher
refuses pre-norm capture under prefill graphs (server/launch.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class PreNormMissing(RuntimeError):
    """The final norm did not run on a forward's rows (its captures fail; the server goes on)."""


class PreNormCapture:
    """Keeps the input of one model's final norm from its latest forward (one per scheduler process)."""

    def __init__(self, inner: Any) -> None:
        norm = getattr(inner, "norm", None)
        if not isinstance(norm, torch.nn.Module):
            raise RuntimeError(f"sglang_capture: --capture-final pre-norm needs the model's final norm, and "
                               f"{type(inner).__name__} has no `norm` module; capture the post-norm state "
                               "(--capture-final post-norm) on this model")
        self.rows: Optional[torch.Tensor] = None
        # every forward starts with no rows: a norm that did not run is then known, never a stale tensor
        self._handles = [inner.register_forward_pre_hook(self._start),
                         norm.register_forward_hook(self._keep, with_kwargs=True)]

    def _start(self, module: Any, args: tuple) -> None:
        self.rows = None

    def _keep(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if isinstance(output, tuple) and len(output) == 2:
            self.rows = output[1]  # output + residual
        else:
            self.rows = args[0] if args else kwargs.get("x")

    def take(self, final: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """The pre-norm rows of the forward whose post-norm rows are ``final`` (and forget them).
        An ``idle`` forward (DP attention: a rank without requests runs a padded dummy batch, and
        the model skips its final norm) gets zeros: none of its rows is anyone's."""
        rows, self.rows = self.rows, None
        if idle or final.shape[0] == 0:
            return torch.zeros_like(final)
        if rows is not None and rows.shape == final.shape:
            return rows
        got = "no call" if rows is None else f"rows of shape {tuple(rows.shape)}"
        raise PreNormMissing(f"the model's final norm saw {got} in this forward, not the {tuple(final.shape)} rows "
                             "it normalized, so no pre-norm state was kept; use --capture-final post-norm with "
                             "this model or parallel mode")

    def forget(self) -> None:
        """Drop the rows of a forward that captures nothing (they would be held until the next one)."""
        self.rows = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.rows = None
