"""The test bed's stand-ins for the sgl_kernel CPU ops of SGLang's EAGLE-3 path
(``testbed/spec_kernels.py``), against hand-worked trees and PyTorch's attention. The servers that
run them (chain and tree drafting, greedy tokens equal the target's) are in test_speculative.py."""
from __future__ import annotations

import torch


def test_tree_stand_ins_build_and_verify_a_two_level_tree():
    """topk 2, 2 steps, 4 draft tokens: root, its children a (node 1) and b (node 2), and a's child c
    (node 3), as SGLang lays them out (``selected_index`` into the draft tokens, parents by top-k block)."""
    from sglang_capture.testbed import spec_kernels as sk

    D = 4
    mask, pos = torch.zeros(D * D, dtype=torch.bool), torch.zeros(D, dtype=torch.int64)
    ri, rnt, rns = (torch.full((1, D), -1) for _ in range(3))
    sk.build_tree_kernel_efficient_cpu(torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]), torch.tensor([10]),
                                       mask, pos, ri, rnt, rns, 2, 2, D, 1)
    assert mask.view(D, D).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert pos.tolist() == [10, 11, 11, 12] and ri.tolist() == [[0, 1, 2, 3]]
    assert rnt.tolist() == [[1, 3, -1, -1]] and rns.tolist() == [[-1, 2, -1, -1]]
    candidates = torch.tensor([[5, 7, 8, 9]])  # root, a, b, c
    for target, accepted, predicts in (([[8, 0, 4, 0]], [0, 2, -1], [8, 0, 4, 0]),  # b (a sibling), then stop
                                       ([[7, 9, 0, 1]], [0, 1, 3], [7, 9, 0, 1])):  # a, then c
        out, index, count = torch.zeros(D, dtype=torch.int32), torch.full((1, 3), -1, dtype=torch.int32), \
            torch.zeros(1, dtype=torch.int32)
        sk.verify_tree_greedy_cpu(out, index, count, candidates, ri, rnt, rns, torch.tensor(target))
        assert index.tolist() == [accepted] and count.tolist() == [sum(i > 0 for i in accepted)]
        assert out.tolist() == predicts


def test_attention_stand_ins_match_sdpa():
    from sglang_capture.testbed import spec_kernels as sk

    torch.manual_seed(0)
    heads, heads_kv, d = 4, 2, 8
    k_buf, v_buf = torch.randn(64, heads_kv, d), torch.randn(64, heads_kv, d)
    req_to_token = torch.randperm(64).to(torch.int32).view(4, 16)

    def sdpa(q, k, v, causal, new_mask=None):
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(k.shape[0] - q.shape[0]) if causal else None
        if new_mask is not None:  # the cached prefix stays visible, the new tokens see what new_mask marks
            mask[:, k.shape[0] - q.shape[0]:] = new_mask
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.3).transpose(0, 1)

    q, new_k, new_v = torch.randn(2, heads, d), torch.randn(2, heads_kv, d), torch.randn(2, heads_kv, d)
    rpi, lens = torch.tensor([3, 1]), torch.tensor([5, 9])
    loc = torch.stack([req_to_token[3, 4], req_to_token[1, 8]]).long()
    out = torch.empty(2, heads, d)
    sk.decode_attention_cpu(q, k_buf, v_buf, out, new_k, new_v, loc, torch.zeros(1), req_to_token, rpi, lens, 0.3, 0.0,
                            False, 0, None, None)
    assert torch.equal(k_buf[loc], new_k) and torch.equal(v_buf[loc], new_v)
    for b in range(2):
        slots = req_to_token[rpi[b], :lens[b]].long()
        torch.testing.assert_close(out[b], sdpa(q[b:b + 1], k_buf[slots], v_buf[slots], False)[0])
    # extend: request 0 has 3 cached + 4 new tokens, request 1 5 cached + 4 new; causal, then a draft tree
    q, k, v = torch.randn(8, heads, d), torch.randn(8, heads_kv, d), torch.randn(8, heads_kv, d)
    args = (k_buf, v_buf, req_to_token, torch.tensor([0, 2]), torch.tensor([7, 9]), torch.tensor([4, 4]),
            torch.tensor([0, 4]), 4, 0.3, 0.0, False, 0, None, None)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    for new_mask in (None, tree):
        out = torch.empty(8, heads, d)
        sk.extend_attention_cpu(q, k, v, out, *args, None if new_mask is None else new_mask.flatten().repeat(2))
        for b, (rpi, prefix) in enumerate(((0, 3), (2, 5))):
            slots, new = req_to_token[rpi, :prefix].long(), slice(4 * b, 4 * b + 4)
            torch.testing.assert_close(out[new], sdpa(q[new], torch.cat([k_buf[slots], k[new]]),
                                                      torch.cat([v_buf[slots], v[new]]), True, new_mask))
