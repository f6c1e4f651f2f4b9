"""``PreNormCapture`` on a stand-in model whose final norm behaves as SGLang's RMSNorm: called with
the last layer's output and its residual it returns (normalized, output + residual)."""
from __future__ import annotations

import pytest
import torch

from sglang_capture.server.pre_norm import PreNormCapture


class _Norm(torch.nn.Module):
    def forward(self, x, residual=None):
        if residual is None:
            return x / x.norm(dim=-1, keepdim=True)
        x = x + residual
        return x / x.norm(dim=-1, keepdim=True), x


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _Norm()

    def forward(self, x, residual, skip_norm=False):
        return x if skip_norm else self.norm(x, residual)[0]


def test_the_hook_keeps_what_the_final_norm_read_with_and_without_a_residual():
    inner = _Inner()
    pre = PreNormCapture(inner)
    x, r = torch.randn(5, 8), torch.randn(5, 8)
    out, _ = inner.norm(x, r)
    assert torch.equal(pre.take(out), x + r)
    out = inner.norm(x)
    assert torch.equal(pre.take(out), x)
    assert pre.rows is None  # taken once: the next forward's rows are never confused with these


def test_a_forward_whose_norm_did_not_run_on_its_rows_fails_loudly_and_an_empty_one_passes():
    inner = _Inner()
    pre = PreNormCapture(inner)
    with pytest.raises(RuntimeError, match="final norm saw no call in this forward.*use --capture-final post-norm"):
        pre.take(torch.randn(3, 8))
    inner.norm(torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=r"saw rows of shape \(4, 8\) in this forward, not the \(3, 8\) rows"):
        pre.take(torch.randn(3, 8))
    assert pre.take(torch.empty(0, 8)).shape == (0, 8)  # no rows, no norm call
    # an idle DP-attention forward: a padded dummy row, the final norm skipped; zeros, never a stale forward's rows
    inner.norm(torch.randn(1, 8), torch.randn(1, 8))
    assert torch.equal(pre.take(torch.randn(1, 8), idle=True), torch.zeros(1, 8)) and pre.rows is None


def test_forget_and_remove():
    inner = _Inner()
    pre = PreNormCapture(inner)
    inner.norm(torch.randn(2, 8), torch.randn(2, 8))
    pre.forget()
    assert pre.rows is None
    pre.remove()
    inner.norm(torch.randn(2, 8), torch.randn(2, 8))
    assert pre.rows is None  # uninstrumented: the hook is gone


def test_a_model_without_a_final_norm_is_refused_in_one_line():
    with pytest.raises(RuntimeError, match="has no `norm` module; capture the post-norm state"):
        PreNormCapture(torch.nn.Module())


def test_a_forward_without_its_pre_norm_state_fails_the_batchs_captures_and_the_server_goes_on():
    import types

    from sglang_capture.server.hooks.model import _finals
    from sglang_capture.server.request_capture import CAPTURE_ATTR

    failed = []
    capture = types.SimpleNamespace(fail=failed.append)
    req = types.SimpleNamespace(**{CAPTURE_ATTR: capture})
    state = types.SimpleNamespace(pre_norm=PreNormCapture(_Inner()),
                                  launching=types.SimpleNamespace(batch=types.SimpleNamespace(reqs=[req, object()])))
    meta = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_idle=lambda: False))
    final = torch.randn(3, 8)
    post, pre = _finals(state, final, meta)  # the final norm never ran
    assert post is final and pre.isnan().all() and pre.shape == final.shape
    assert len(failed) == 1 and "final norm saw no call" in failed[0]


def test_each_forward_starts_without_rows_so_a_norm_that_did_not_run_is_never_answered_by_an_older_forward():
    inner = _Inner()
    pre = PreNormCapture(inner)
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    inner(x, r)  # a forward whose rows nobody took (a warm-up, a scoring request)
    assert pre.rows is not None
    out = inner(x, r, skip_norm=True)  # same shape, but its final norm never ran
    with pytest.raises(RuntimeError, match="final norm saw no call"):
        pre.take(out)
