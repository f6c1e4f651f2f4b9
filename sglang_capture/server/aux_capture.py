"""The model's aux-layer capture: switched on at load, and off for batches that capture nothing.

With aux capture on, every forward copies the residual stream at each captured layer into a
[tokens, layers x hidden] buffer, whether or not a request in the batch captures. On the
Kimi-width 4-layer test model that was most of the gap between the idle capture server and plain
SGLang (bench/RESULTS.md); on a 61-layer model it is smaller, but it is never useful work.

So for an extend (prefill) batch without a capture request, both switches SGLang's models read
during the forward (``capture_aux_hidden_states`` on the causal-LM, ``layers_to_capture`` on its
inner model) are turned off for that batch's forward and back on right after. That is only safe
where the forward runs the model's Python code, so the switch is used only when:

- no prefill CUDA graph runner exists: a graph captured with aux on replays it, and a breakable
  graph would replay segments that disagree with the switched attributes;
- decode batches are left alone (decode CUDA graphs were captured with aux on; eager decode
  batches are small);
- the inner model keeps its layers in ``layers_to_capture`` (Qwen-MoE also flags each layer);
- DP attention is off (ranks run different batches; the capture gathers across them).

The decision for a batch must be the same on every tensor-parallel rank (the capture may gather
across ranks), so it reads a marker that every rank sets on a capture request (``AUX_ATTR``),
not the writer rank's per-request state. SGLang's own ``return_hidden_states`` requests do not
need the aux layers: they are answered with the final hidden state either way (results.py), except
on a server that speculates, where the switch is never used (its draft reads the aux layers).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, List, Optional, Sequence

logger = logging.getLogger(__name__)

AUX_ATTR = "_sglang_capture_aux"  # True on a capture request's Req, on every rank
_SWITCHED_MODES = ("EXTEND", "MIXED")  # forward modes that run the model's Python code when no prefill graph exists


def batch_captures(batch: Any) -> bool:
    """Whether a request in ``batch`` captures (the same answer on every rank)."""
    return any(getattr(req, AUX_ATTR, False) for req in batch.reqs)


class AuxCapture:
    """Aux-layer capture on one target model (one per scheduler process)."""

    def __init__(self, runner: Any, layers: Sequence[int]) -> None:
        model = runner.model
        self.runner = runner
        self.lm = getattr(model, "language_model", None) or model  # Kimi-K2.5 wraps a DeepseekV3ForCausalLM
        self.inner = self.lm.model
        self.layers: List[int] = list(layers)
        # an EAGLE-3 server: SGLang sets the draft's layers itself, and the draft reads every batch's
        self.speculative = bool(getattr(runner.server_args, "speculative_algorithm", None))
        self.logits_processor = getattr(self.lm, "logits_processor", None)
        self.per_batch: Optional[bool] = None  # decided at the first batch, after the CUDA graphs exist
        self.counts = {"extend_batches_with_aux": 0, "extend_batches_without_aux": 0}

    def enable(self) -> None:
        """Capture ``layers`` in every forward (before CUDA graphs are captured: they bake it in)."""
        self.lm.capture_aux_hidden_states = True
        if self._inner_has_setter():
            self.inner.set_eagle3_layers_to_capture(list(self.layers))  # inner-model setters take final ids (Qwen-MoE)
        else:
            self.inner.layers_to_capture = list(self.layers)

    def check_served_layers(self) -> None:
        """After SGLang configured the model: on a server that speculates, it set the layers its
        draft reads (the launcher resolved the same ones by SGLang's rule); anything else would
        put other layers in the files than their metadata names."""
        served = sorted(getattr(self.inner, "layers_to_capture", None) or [])
        if self.speculative and (served != sorted(self.layers) or not self.lm.capture_aux_hidden_states):
            raise RuntimeError(f"sglang_capture: the served draft makes SGLang capture layers {served}, not the "
                               f"layers {self.layers} the launcher resolved from its config (SGLang's layer rule for "
                               f"{type(self.lm).__name__} changed?): capture would mislabel them; serve this draft "
                               "without sglang_capture.launch, and report it with the draft's config.json")

    def _inner_has_setter(self) -> bool:
        return hasattr(type(self.inner), "set_eagle3_layers_to_capture")

    def why_not_per_batch(self) -> Optional[str]:
        """Why aux capture must stay on for every batch, or None when it can follow the batch."""
        if self.speculative:
            return "the server speculates: its draft reads the aux layers of every batch"
        if self._inner_has_setter():
            return f"{type(self.inner).__name__} flags each captured layer"
        if getattr(self.runner.server_args, "enable_dp_attention", False):
            return "DP attention is on"
        graphs = getattr(self.runner, "prefill_cuda_graph_runner", None)
        if graphs is not None:
            try:
                from sglang.srt.model_executor.runner.eager_runner import EagerRunner
            except ImportError:
                return "prefill CUDA graphs may be in use"
            if not isinstance(graphs, EagerRunner):
                return f"prefill CUDA graphs are in use ({type(graphs).__name__})"
        return None

    def _decide(self) -> bool:
        reason = self.why_not_per_batch()
        self.per_batch = reason is None
        if reason is None:
            logger.info("sglang_capture: aux layers computed only for prefill batches with a capture request")
        else:
            logger.info("sglang_capture: aux layers computed in every forward (%s)", reason)
        return self.per_batch

    @contextlib.contextmanager
    def for_batch(self, batch: Any, captures: Optional[bool] = None) -> Iterator[None]:
        """Around one batch's forward (scheduler thread): aux capture off when nothing in it captures
        (``captures``: ``batch_captures(batch)`` when the caller has it already)."""
        if batch.forward_mode.name not in _SWITCHED_MODES:
            yield
            return
        per_batch = self.per_batch if self.per_batch is not None else self._decide()
        if not per_batch or (batch_captures(batch) if captures is None else captures):
            self.counts["extend_batches_with_aux"] += 1
            yield
            return
        self.counts["extend_batches_without_aux"] += 1
        self.lm.capture_aux_hidden_states = False
        self.inner.layers_to_capture = []
        try:
            yield
        finally:
            self.lm.capture_aux_hidden_states = True
            self.inner.layers_to_capture = list(self.layers)

    def stats(self) -> dict:
        return {"per_batch": self.per_batch, **self.counts}
