"""CPU test bed only: what real SGLang needs to serve tiny models on a CPU.

- DeepSeek MLA on ``torch_native`` must use the absorbed path. DeepSeek's attention registry
  has no ``torch_native`` handler and falls back to the triton one, which picks MHA for a fresh
  prefill; the torch_native backend then reads the latent MLA cache and fails on the head size.
- DP attention pads each rank's forward batch to the size the ranks agreed on, asking the
  attention backend for the sequence length of a padding slot; ``torch_native`` does not say
  (base class: ``NotImplementedError``; 0.5.23 asks ``get_cpu_graph_seq_len_fill_value`` on a
  CPU). 1 is what SGLang's CUDA backends answer. It then pins
  the ranks' token counts (``torch.tensor(..., pin_memory=True)``), which needs a CUDA driver:
  on a CPU the module sees a ``torch`` whose ``tensor`` leaves memory unpinned. The ranks'
  hidden states are then gathered with a Triton copy kernel, which has no CPU driver: the
  same copy in torch replaces it, and the all-gather goes through a custom op registered for
  CUDA only: on CPU tensors the group's own gather (gloo) runs directly, and a reduce-scatter
  (which gloo lacks) is an all-reduce of which each rank keeps its slice.

Applied by ``site/sitecustomize.py`` in the processes of test-bed servers only (``server_env``
puts it on their ``PYTHONPATH``); a user's install never loads this module.
"""
from __future__ import annotations

import types

import torch


def _unpinned_torch() -> types.ModuleType:
    """``torch`` as a module that builds tensors without pinning (nothing to pin for on a CPU)."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)

    def tensor(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return torch.tensor(*args, **kwargs)

    proxy.tensor = tensor
    return proxy


def _memcpy_rows(dst: torch.Tensor, src: torch.Tensor, dim: int, offset: torch.Tensor, sz: torch.Tensor,
                 offset_src: bool) -> None:
    """``memcpy_triton`` in torch: ``sz`` rows, read at row ``offset`` of ``src`` or written there in ``dst``."""
    assert dim == 0
    start, n = int(offset), int(sz)
    if offset_src:
        dst[:n].copy_(src[start:start + n])
    else:
        dst[start:start + n].copy_(src[:n])


def _cpu_all_gather(original):
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if input.is_cpu:
            return self._all_gather_into_tensor(output, input)
        return original(self, output, input)
    return all_gather_into_tensor


def _cpu_reduce_scatter(original):
    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if not input.is_cpu:
            return original(self, output, input)
        summed = input.clone()
        torch.distributed.all_reduce(summed, group=self.device_group)
        output.copy_(summed.chunk(self.world_size)[self.rank_in_group])
    return reduce_scatter_tensor


def apply() -> None:
    """Patch SGLang for a CPU (in a scheduler process, once SGLang's model runner is imported)."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.layers import dp_attention
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor import forward_batch_info
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: _dispatch_mla_subtype(attn, forward_batch))
    TorchNativeAttnBackend.get_cuda_graph_seq_len_fill_value = lambda self: 1
    TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1
    forward_batch_info.torch = _unpinned_torch()
    dp_attention.memcpy_triton = _memcpy_rows
    GroupCoordinator.all_gather_into_tensor = _cpu_all_gather(GroupCoordinator.all_gather_into_tensor)
    GroupCoordinator.reduce_scatter_tensor = _cpu_reduce_scatter(GroupCoordinator.reduce_scatter_tensor)
