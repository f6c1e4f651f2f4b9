"""CPU test bed only: pure-torch stand-ins for the sgl_kernel CPU ops SGLang's EAGLE path calls.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang routes speculative decoding (EAGLE / EAGLE-3) through
sgl_kernel's CPU ops, and its only CPU attention backend with EAGLE support (``intel_amx``) through
sgl_kernel's CPU attention kernels. PyPI's sgl_kernel wheel is built for CUDA only: its Python
wrappers (``sgl_kernel.speculative``, ``sgl_kernel.kvcacheio``) are there, the ``torch.ops.sgl_kernel``
ops they call are not. ``install()`` defines each missing op with the argument order of SGLang
0.5.17's callers and the semantics of sgl-kernel's C++ CPU kernels (``csrc/cpu/spec.cpp``,
``kvcache.cpp``, ``decode.cpp``, ``extend.cpp``), written as plain loops over requests: the test
bed's models are tiny, clarity beats speed. An op that really exists is never replaced.

Applied by ``site/sitecustomize.py`` in the processes of test-bed servers only (when ``sgl_kernel``
is imported); a user's install never loads this module.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Dict, List, Optional, Tuple

import torch

_LIB: Optional[torch.library.Library] = None  # keeps the definitions alive (they go with the object)
INSTALLED: List[str] = []  # the ops this process defined (absent from sgl_kernel before)


# ---------------------------------------------------------------- KV cache, slot bookkeeping


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """``sgl_kernel.copy_all_layer_kv_cache_cpu``: in every K/V buffer b (base address
    ``data_ptrs[b]``, ``strides[b]`` bytes per slot row) copy row ``src_loc[i]`` to row ``tgt_loc[i]``.
    All source rows of a buffer are read before any target row is written (gather, then scatter),
    so overlapping ``src_loc`` / ``tgt_loc`` are safe. The pool hands over raw addresses, hence ctypes."""
    n = tgt_loc.numel()
    if n == 0 or data_ptrs.numel() == 0:
        return
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.view(torch.int64).tolist(), strides.tolist()):
        base &= (1 << 64) - 1
        staged = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, staged):
            ctypes.memmove(base + t * stride, row, stride)


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``sgl_kernel.assign_req_to_token_pool_cpu``: scatter fresh KV slots into the request map,
    ``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[prefix[i]:prefix[i+1]]``
    where ``prefix`` is the running sum of ``end - start``."""
    at = 0
    for rpi, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[rpi, s:e] = out_cache_loc[at:at + e - s].to(req_to_token.dtype)
        at += e - s


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``sgl_kernel.assign_extend_cache_locs_cpu``: the inverse gather, request by request,
    ``out_cache_loc[prefix[i]:prefix[i+1]] = req_to_token[req_pool_indices[i], start[i]:end[i]]``."""
    at = 0
    for rpi, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[at:at + e - s] = req_to_token[rpi, s:e].to(out_cache_loc.dtype)
        at += e - s


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
                                           topk: int, num_steps: int) -> None:
    """``sgl_kernel.assign_draft_cache_locs_contiguous_cpu``: read back the draft KV slots the
    allocator reserved, ``out_cache_loc[b*n:(b+1)*n] = req_to_token[req_pool_indices[b],
    seq_lens[b]:seq_lens[b]+n]`` with ``n = topk * num_steps``."""
    n = topk * num_steps
    for b, (rpi, sl) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[b * n:(b + 1) * n] = req_to_token[rpi, sl:sl + n].to(out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                    seq_lens: torch.Tensor, topk: int, num_steps: int,
                                    pool_len: int) -> torch.Tensor:
    """``sgl_kernel.build_draft_decode_metadata_cpu``: a request map for multi-step draft decode,
    shape ``[num_seqs * topk, pool_len]``. Row ``b*topk + k`` holds request b's committed prefix
    (``seq_lens[b]`` slots) followed by candidate k's ``num_steps`` draft slots, which lie at
    ``seq_lens[b] + k*num_steps`` in request b's row. Entries past that are left zero."""
    out = torch.zeros((req_pool_indices.numel() * topk, pool_len), dtype=req_to_token.dtype,
                      device=req_to_token.device)
    for b, (rpi, sl) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for k in range(topk):
            row = out[b * topk + k]
            row[:sl] = req_to_token[rpi, :sl]
            row[sl:sl + num_steps] = req_to_token[rpi, sl + k * num_steps:sl + (k + 1) * num_steps]
    return out


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """``sgl_kernel.fill_bonus_tokens_cpu``: each request's last accepted token,
    ``bonus_tokens[b] = accept_tokens.flat[accept_stride*b + accept_lens[b] - 1]``."""
    flat = accept_tokens.reshape(-1)
    for b, n in enumerate(accept_lens.tolist()):
        bonus_tokens[b] = flat[accept_stride * b + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """``sgl_kernel.fill_accept_out_cache_loc_cpu``: compact the accepted tokens' KV slots,
    ``out_cache_loc[i]`` for every ``i`` in ``accept_index`` (flat) that is not -1, in order."""
    kept = [i for i in accept_index.reshape(-1).tolist() if i > -1]
    if kept:
        accept_out_cache_loc[:len(kept)] = out_cache_loc[torch.tensor(kept, dtype=torch.long)]


def rotate_input_ids_cpu(input_ids: torch.Tensor, extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor,
                         topk_index: torch.Tensor, select_index: Optional[torch.Tensor] = None) -> None:
    """``sgl_kernel.rotate_input_ids_cpu`` (multi-layer EAGLE): shift each request's extend segment
    of ``input_ids`` left by one and write ``topk_index[b]`` at its end (or at ``select_index[b]``)."""
    selects = select_index.tolist() if select_index is not None else None
    for b, (start, n, new) in enumerate(zip(extend_start_loc.tolist(), extend_seq_lens.tolist(), topk_index.tolist())):
        if n > 1:
            input_ids[start:start + n - 1] = input_ids[start + 1:start + n].clone()
        if n > 0:
            input_ids[selects[b] if selects is not None else start + n - 1] = new


# ---------------------------------------------------------------- draft tree: build and verify


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrive_index: torch.Tensor,
                                    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                                    topk: int, depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """``sgl_kernel.build_tree_kernel_efficient_cpu``: the draft token tree target verify consumes.

    Per request b (``D = draft_token_num``; node 0 is the verified root, node i > 0 the draft token
    ``selected_index[b, i-1]``, whose parent is ``parent_list[b, selected_index[b, i-1] // topk]``
    looked up among the selected tokens): ``retrive_index[b, i] = b*D + i``; children are linked as
    first child (``retrive_next_token``) and next sibling (``retrive_next_sibling``, both pre-filled
    with -1), later nodes first; ``positions[b*D + i] = verified_seq_len[b] + depth of node i``; the
    tree mask lets each node see itself, its ancestors and the root. ``tree_mask_mode`` 1
    (QLEN_ONLY): mask ``[bs, D, D]`` flat; 0 (FULL_MASK): per request ``D`` rows of ``seq_len + D``
    columns, of which only the last D (the draft part) are written here.
    """
    if tree_mask_mode not in (0, 1):
        raise NotImplementedError("build_tree_kernel_efficient_cpu: QLEN_ONLY_BITPACKING is not supported on CPU")
    D = draft_token_num
    bs = parent_list.size(0)
    parents, sels, seq_lens = parent_list.tolist(), selected_index.tolist(), verified_seq_len.tolist()
    ri = retrive_index.view(-1)
    rnt, rns = retrive_next_token.view(-1).tolist(), retrive_next_sibling.view(-1).tolist()
    pos = positions.view(-1)
    mask = tree_mask.view(-1)
    full_offset = 0
    for b in range(bs):
        off, seq_len, sel, parent = b * D, seq_lens[b], sels[b], parents[b]

        def node_of(token_idx: int) -> int:
            """Tree node (1..D-1) of a selected draft token, D when it is not selected."""
            return sel.index(token_idx) + 1 if token_idx in sel else D

        pos[off] = seq_len
        ri[off] = off
        for i in range(D - 1, 0, -1):
            ri[off + i] = off + i
            parent_tb = sel[i - 1] // topk
            parent_node = 0 if parent_tb == 0 else node_of(parent[parent_tb])
            if parent_node == D:
                continue
            if rnt[off + parent_node] != -1:
                rns[off + i] = rnt[off + parent_node]
            rnt[off + parent_node] = i
        for tid in range(D):
            row = [False] * D
            row[0] = True
            depth_of = 0
            if tid > 0:
                node = tid
                while True:
                    depth_of += 1
                    row[node] = True
                    parent_tb = sel[node - 1] // topk
                    if parent_tb == 0:
                        break
                    node = node_of(parent[parent_tb])
                pos[off + tid] = seq_len + depth_of
            if tree_mask_mode == 1:
                start = (off + tid) * D
            else:
                start = full_offset + (seq_len + D) * tid + seq_len
            mask[start:start + D] = torch.tensor(row, dtype=torch.bool)
        full_offset += D * D + seq_len * D
    retrive_next_token.view(-1).copy_(torch.tensor(rnt, dtype=retrive_next_token.dtype))
    retrive_next_sibling.view(-1).copy_(torch.tensor(rns, dtype=retrive_next_sibling.dtype))


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """``sgl_kernel.verify_tree_greedy_cpu``: greedy verification of each request's draft tree.

    From the root, step down one level at a time: among the current node's children (first child,
    then siblings) take the first whose draft token equals the target's argmax at the last accepted
    node; stop when none does or after ``accept_index.size(1) - 1`` levels. Writes the accepted flat
    node indices to ``accept_index[b]`` (root first; the rest is left as the caller filled it),
    the number of accepted drafts (root excluded) to ``accept_token_num[b]``, and
    ``predicts[node] = target_predict.flat[node]`` for every accepted node, so the last accepted
    node carries the bonus token.
    """
    bs, D = candidates.shape
    steps = accept_index.size(1)
    cand, ri = candidates.tolist(), retrive_index.tolist()
    rnt, rns = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    flat_predicts = predicts.view(-1)
    for b in range(bs):
        last = ri[b][0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = rnt[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    flat_predicts[last] = target[last]
                    accepted += 1
                    last = ri[b][cur]
                    accept_index[b, accepted] = last
                    break
                cur = rns[b][cur]
            if cur == -1:
                break
        accept_token_num[b] = accepted
        flat_predicts[last] = target[last]


def reconstruct_indices_from_tree_mask_cpu(tree_mask: torch.Tensor, verified_seq_len: torch.Tensor,
                                           positions: torch.Tensor, retrive_index: torch.Tensor,
                                           retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                                           batch_size: int, draft_token_num: int) -> None:
    """``sgl_kernel.reconstruct_indices_from_tree_mask_cpu`` (NGRAM): recover the tree linkage from
    a ``[bs, D, D]`` QLEN tree mask. Node t's depth is the number of earlier nodes it sees, its
    parent the nearest of them; its first child is the first later node that sees t; its next
    sibling the first later node that sees t's parent and no node between that parent and itself."""
    D = draft_token_num
    m = tree_mask.view(batch_size, D, D).tolist()
    seq_lens = verified_seq_len.tolist()
    pos, ri = positions.view(-1), retrive_index.view(-1)
    rnt, rns = retrive_next_token.view(-1), retrive_next_sibling.view(-1)
    for b in range(batch_size):
        off = b * D
        for t in range(D):
            seen = [i for i in range(t) if m[b][t][i]]
            parent = seen[-1] if seen else -1
            ri[off + t] = off + t
            pos[off + t] = len(seen) + seq_lens[b]
            rnt[off + t] = next((i for i in range(t + 1, D) if m[b][i][t]), -1)
            sibling = -1
            if parent != -1:
                for i in range(t + 1, D):
                    if m[b][i][parent] and not any(m[b][i][parent + 1:i]):
                        sibling = i
                        break
            rns[off + t] = sibling


# ---------------------------------------------------------------- attention (intel_amx backend)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, logit_cap: float,
            visible: Optional[torch.Tensor]) -> torch.Tensor:
    """Softmax attention in float32: q ``[m, H, d]``, k ``[n, Hkv, d]``, v ``[n, Hkv, dv]``, ``visible``
    ``[m, n]`` bool or None (all); query head h reads KV head ``h // (H // Hkv)``. Returns ``[m, H, dv]``."""
    group = q.size(1) // k.size(1)
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * sm_scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if visible is not None:
        scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), v)


def _check_attention_args(name: str, is_cross_attn: bool, sliding_window_size: int,
                          sinks: Optional[torch.Tensor]) -> None:
    if is_cross_attn or sliding_window_size > 0 or sinks is not None:
        raise NotImplementedError(f"{name} stand-in: cross attention, sliding windows and sinks are not needed "
                                  "by the test bed's models and not implemented")


def decode_attention_cpu(query: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, output: torch.Tensor,
                         key: Optional[torch.Tensor], value: Optional[torch.Tensor], loc: torch.Tensor,
                         attn_logits: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, sm_scale: float, logit_cap: float, is_cross_attn: bool,
                         sliding_window_size: int, encoder_lens: Optional[torch.Tensor],
                         sinks: Optional[torch.Tensor]) -> None:
    """``torch.ops.sgl_kernel.decode_attention_cpu``: one query token per sequence.

    First stores the new ``key`` / ``value`` rows (when given) at slots ``loc`` of ``k_buffer`` /
    ``v_buffer``; then sequence b's query ``query[b]`` (``[H, d]``) attends to the slots
    ``req_to_token[req_pool_indices[b], off:off + seq_lens[b]]`` (``off`` = ``encoder_lens[b]``
    when given, else 0), scaled by ``sm_scale``, capped by ``logit_cap * tanh(s / logit_cap)`` when
    ``logit_cap > 0``. Result in ``output[b]``. ``attn_logits`` is the C++ kernel's split-KV scratch
    space; nothing reads it afterwards, so it is left alone. ``sliding_window_size`` (the layer's
    window + 1, so 0 = none), cross attention and sinks are refused.
    """
    _check_attention_args("decode_attention_cpu", is_cross_attn, sliding_window_size, sinks)
    heads_kv = k_buffer.size(1)
    if key is not None and value is not None:
        k_buffer[loc] = key.reshape(-1, heads_kv, k_buffer.size(2)).to(k_buffer.dtype)
        v_buffer[loc] = value.reshape(-1, heads_kv, v_buffer.size(2)).to(v_buffer.dtype)
    offsets = encoder_lens.tolist() if encoder_lens is not None else None
    out = output.view(query.size(0), query.size(1), -1)
    for b, (rpi, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        off = offsets[b] if offsets is not None else 0
        if n == 0:
            out[b] = 0
            continue
        slots = req_to_token[rpi, off:off + n].long()
        out[b] = _attend(query[b:b + 1], k_buffer[slots], v_buffer[slots], sm_scale, logit_cap, None)[0].to(out.dtype)


def extend_attention_cpu(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         extend_seq_lens: torch.Tensor, extend_start_loc: torch.Tensor, max_len_extend: int,
                         sm_scale: float, logit_cap: float, is_cross_attn: bool, sliding_window_size: int,
                         encoder_lens: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                         tree_mask: Optional[torch.Tensor]) -> None:
    """``torch.ops.sgl_kernel.extend_attention_cpu``: prefill / verify / draft-extend attention.

    Sequence b has ``seq_lens[b]`` tokens in all, the last ``e = extend_seq_lens[b]`` of them new:
    their queries, keys and values are rows ``extend_start_loc[b] : + e`` of ``q_extend``,
    ``k_extend``, ``v_extend`` (the keys are already in the cache too; the kernel reads the new ones
    from ``k_extend``). Each new token sees the whole cached prefix (slots
    ``req_to_token[req_pool_indices[b], off:off + seq_lens[b] - e]``) and, among the new tokens,
    itself and the earlier ones (causal), or with ``tree_mask`` (speculative verify of a draft
    tree, QLEN_ONLY layout ``[bs, e, e]`` flat) the ones its row marks. Output rows go to
    ``o_extend``. Scaling and capping as in ``decode_attention_cpu``.
    """
    _check_attention_args("extend_attention_cpu", is_cross_attn, sliding_window_size, sinks)
    heads, heads_kv = q_extend.size(1), k_buffer.size(1)
    k_new = k_extend.reshape(-1, heads_kv, k_buffer.size(2))
    v_new = v_extend.reshape(-1, heads_kv, v_buffer.size(2))
    out = o_extend.view(q_extend.size(0), heads, -1)
    offsets = encoder_lens.tolist() if encoder_lens is not None else None
    mask_at = 0
    for b, (rpi, total, e, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                                   extend_seq_lens.tolist(), extend_start_loc.tolist())):
        prefix = total - e
        if prefix < 0:
            raise RuntimeError(f"extend_attention_cpu: seq_lens[{b}]={total} < extend_seq_lens[{b}]={e}")
        if e == 0:
            continue
        off = offsets[b] if offsets is not None else 0
        slots = req_to_token[rpi, off:off + prefix].long()
        k = torch.cat([k_buffer[slots].to(k_new.dtype), k_new[start:start + e]])
        v = torch.cat([v_buffer[slots].to(v_new.dtype), v_new[start:start + e]])
        if tree_mask is not None:
            new_visible = tree_mask.reshape(-1)[mask_at:mask_at + e * e].view(e, e).bool()
            mask_at += e * e
        else:
            new_visible = torch.ones(e, e, dtype=torch.bool).tril()
        visible = torch.cat([torch.ones(e, prefix, dtype=torch.bool), new_visible], dim=1)
        out[start:start + e] = _attend(q_extend[start:start + e], k, v, sm_scale, logit_cap, visible).to(out.dtype)


# ---------------------------------------------------------------- intel_amx backend: lengths it drops


def _with_seq_lens(method: Callable, lengths: Callable) -> Callable:
    """``method`` called with ``forward_batch.seq_lens`` set, for the call only, to
    ``lengths(backend)`` when that is not None."""
    def call(self, q, k, v, layer, forward_batch, *args, **kwargs):
        seq_lens = lengths(self)
        if seq_lens is None:
            return method(self, q, k, v, layer, forward_batch, *args, **kwargs)
        saved = forward_batch.seq_lens
        forward_batch.seq_lens = seq_lens
        try:
            return method(self, q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            forward_batch.seq_lens = saved

    call.__name__ = method.__name__
    call.__wrapped__ = method
    return call


def patch_intel_amx_backend() -> None:
    """Give SGLang 0.5.17's ``IntelAMXAttnBackend`` the sequence lengths its own metadata computes.

    ``forward_extend`` and ``forward_decode`` unpack the lengths prepared for this pass (target
    verify: committed prefix + draft tokens, from ``_build_extend_metadata``; multi-step draft
    decode: prefix + step + 1 per candidate row, from ``IntelAMXMultiStepDraftBackend``) and then
    overwrite them with ``forward_batch.seq_lens`` (the committed prefix, one entry per request)
    before calling the kernel, which then sees fewer keys than tokens (verify: prefix < 0; draft
    decode: each draft token misses itself, and with topk > 1 only the first ``bs`` of ``bs*topk``
    rows are computed). Here each call sees ``forward_batch.seq_lens`` as those prepared lengths.
    Idempotent."""
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend

    if getattr(IntelAMXAttnBackend.forward_extend, "__wrapped__", None) is None:
        IntelAMXAttnBackend.forward_extend = _with_seq_lens(
            IntelAMXAttnBackend.forward_extend,
            lambda backend: backend.extend_metadata[0] if backend.extend_metadata is not None else None)
    if getattr(IntelAMXAttnBackend.forward_decode, "__wrapped__", None) is None:
        IntelAMXAttnBackend.forward_decode = _with_seq_lens(
            IntelAMXAttnBackend.forward_decode,
            lambda backend: backend.draft_decode_metadata[1] if backend.draft_decode_metadata is not None else None)


# ---------------------------------------------------------------- server flags


def eagle3_server_args(draft_path: str, topk: int = 1, steps: int = 2, draft_tokens: Optional[int] = None) -> List[str]:
    """Flags for SGLang's EAGLE-3 with the draft at ``draft_path`` (``topk`` 1: chain, > 1: tree;
    ``draft_tokens`` defaults to ``steps + 1`` for a chain and ``2 * topk`` for a tree), plus on a
    machine without an NVIDIA driver what routes it through this module: the target verifies and
    the draft runs on ``intel_amx`` (the only CPU attention backend SGLang's EAGLE accepts; named
    per phase because ``--attention-backend intel_amx`` falls back to torch_native without AMX
    kernels), while the target's prefill stays on the test bed's usual ``torch_native``. Float32,
    so greedy tokens compare exactly with transformers."""
    from sglang_capture.testbed.cpu import has_nvidia_driver

    if draft_tokens is None:
        draft_tokens = steps + 1 if topk == 1 else 2 * topk
    args = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft_path,
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(draft_tokens), "--dtype", "float32"]
    if not has_nvidia_driver():
        args += ["--decode-attention-backend", "intel_amx", "--speculative-attention-mode", "decode",
                 "--speculative-draft-attention-backend", "intel_amx"]
    return args


# ---------------------------------------------------------------- registration

# name -> (schema as SGLang 0.5.17's callers use it, implementation, whether sgl_kernel exports a
# Python function of that name for ``from sgl_kernel import ...``)
OPS: Dict[str, Tuple[str, Callable, bool]] = {
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        copy_all_layer_kv_cache_cpu, True),
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()", assign_req_to_token_pool_cpu, True),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()", assign_extend_cache_locs_cpu, True),
    "assign_draft_cache_locs_contiguous_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, Tensor(a!) out_cache_loc, int pool_len, "
        "int topk, int num_steps) -> ()", assign_draft_cache_locs_contiguous_cpu, True),
    "build_draft_decode_metadata_cpu": (
        "(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, int num_steps, int pool_len) "
        "-> Tensor", build_draft_decode_metadata_cpu, True),
    "fill_bonus_tokens_cpu": (
        "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, int accept_stride) -> ()",
        fill_bonus_tokens_cpu, True),
    "fill_accept_out_cache_loc_cpu": (
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()",
        fill_accept_out_cache_loc_cpu, True),
    "rotate_input_ids_cpu": (
        "(Tensor(a!) input_ids, Tensor extend_start_loc, Tensor extend_seq_lens, Tensor topk_index, "
        "Tensor? select_index=None) -> ()", rotate_input_ids_cpu, True),
    "build_tree_kernel_efficient_cpu": (
        "(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, Tensor(a!) tree_mask, "
        "Tensor(b!) positions, Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
        "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, int tree_mask_mode) -> ()",
        build_tree_kernel_efficient_cpu, True),
    "verify_tree_greedy_cpu": (
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, Tensor candidates, "
        "Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, Tensor target_predict) -> ()",
        verify_tree_greedy_cpu, True),
    "reconstruct_indices_from_tree_mask_cpu": (
        "(Tensor tree_mask, Tensor verified_seq_len, Tensor(a!) positions, Tensor(b!) retrive_index, "
        "Tensor(c!) retrive_next_token, Tensor(d!) retrive_next_sibling, int batch_size, int draft_token_num) -> ()",
        reconstruct_indices_from_tree_mask_cpu, False),
    "decode_attention_cpu": (
        "(Tensor query, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor(c!) output, Tensor? key, Tensor? value, "
        "Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, "
        "Tensor? sinks) -> ()", decode_attention_cpu, False),
    "extend_attention_cpu": (
        "(Tensor q_extend, Tensor k_extend, Tensor v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
        "Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, "
        "Tensor extend_start_loc, int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, "
        "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask) -> ()",
        extend_attention_cpu, False),
}


def _op_exists(name: str) -> bool:
    try:
        getattr(torch.ops.sgl_kernel, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _python_wrapper(name: str) -> Callable:
    def call(*args, **kwargs):
        return getattr(torch.ops.sgl_kernel, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``torch.ops.sgl_kernel.{name}`` (test-bed stand-in, see sglang_capture.testbed.spec_kernels)."
    return call


def install() -> List[str]:
    """Define every op of ``OPS`` that ``torch.ops.sgl_kernel`` lacks (CPU dispatch), and give the
    ``sgl_kernel`` module a Python function of that name where SGLang imports one and the module
    has none. Idempotent; an op or function that exists is left as it is. Returns the ops defined
    by this process so far."""
    global _LIB
    import sgl_kernel

    for name, (schema, fn, exported) in OPS.items():
        if not _op_exists(name):
            if _LIB is None:
                _LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
            _LIB.define(name + schema)
            _LIB.impl(name, fn, "CPU")
            INSTALLED.append(name)
        if exported and not hasattr(sgl_kernel, name):
            setattr(sgl_kernel, name, _python_wrapper(name))
    return list(INSTALLED)
