"""The per-batch aux-layer switch (server/aux_capture.py)."""
from __future__ import annotations

import types

import pytest


def test_aux_layers_are_switched_off_only_for_eager_prefill_batches_that_capture_nothing():
    import enum

    from sglang_capture.server.aux_capture import AUX_ATTR, AuxCapture

    Mode = enum.Enum("ForwardMode", "EXTEND MIXED DECODE IDLE")

    class Inner:  # a model keeping its captured layers in layers_to_capture (Llama, DeepSeek)
        layers_to_capture: list = []

    class InnerWithSetter(Inner):  # Qwen-MoE also flags each layer
        def set_eagle3_layers_to_capture(self, ids):
            self.layers_to_capture = ids

    def runner(inner=None, prefill_graphs=None, dp_attention=False):
        lm = types.SimpleNamespace(model=inner or Inner(), capture_aux_hidden_states=False)
        return types.SimpleNamespace(model=lm, prefill_cuda_graph_runner=prefill_graphs,
                                     server_args=types.SimpleNamespace(enable_dp_attention=dp_attention))

    def batch(mode, *capturing):
        reqs = [types.SimpleNamespace() for _ in capturing]
        for r, c in zip(reqs, capturing, strict=False):
            if c:
                setattr(r, AUX_ATTR, True)
        return types.SimpleNamespace(forward_mode=Mode[mode], reqs=reqs)

    def during(aux, b):
        with aux.for_batch(b):
            return aux.lm.capture_aux_hidden_states, list(aux.inner.layers_to_capture)

    on, off = (True, [1, 3]), (False, [])
    aux = AuxCapture(runner(), [1, 3])
    aux.enable()
    assert (aux.lm.capture_aux_hidden_states, aux.inner.layers_to_capture) == on
    assert during(aux, batch("EXTEND", False, False)) == off
    assert during(aux, batch("MIXED", False)) == off
    assert during(aux, batch("EXTEND", False, True)) == on  # one capture request: the whole batch computes them
    assert during(aux, batch("DECODE", False)) == on  # decode CUDA graphs were captured with aux on
    assert during(aux, batch("IDLE")) == on
    with pytest.raises(RuntimeError):
        with aux.for_batch(batch("EXTEND", False)):
            raise RuntimeError("forward failed")
    assert (aux.lm.capture_aux_hidden_states, aux.inner.layers_to_capture) == on  # restored all the same
    assert aux.stats() == {"per_batch": True, "extend_batches_with_aux": 1, "extend_batches_without_aux": 3}

    for r, why in [(runner(prefill_graphs=object()), "prefill CUDA graphs are in use"),
                   (runner(inner=InnerWithSetter()), "flags each captured layer"),
                   (runner(dp_attention=True), "DP attention")]:
        aux = AuxCapture(r, [1, 3])
        aux.enable()
        assert why in aux.why_not_per_batch()
        assert during(aux, batch("EXTEND", False)) == on
        assert aux.stats()["per_batch"] is False
