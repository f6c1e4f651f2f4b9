"""vLLM's speculators (0.9.0) reading an export: its own dataset, dataloader and EAGLE-3 model.

``train_one_step`` is the check a data dir written by ``export --format speculators`` must pass:
speculators' ``create_train_val_loaders`` loads it, the trainer's own targets for a sample
(``verifier_lm_head(verifier_norm(final state))``, the verifier's norm and head loaded from the
target checkpoint) equal transformers' logits for the same tokens, and one optimizer step of
``Eagle3DraftModel`` runs on a batch and moves its weights. A post-norm final state in place of
the pre-norm one is normalized twice by that trainer, and fails the targets; a wrong shape fails
in speculators' collate or model.
"""
from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from tests.reference import min_row_cosine

MIN_TARGET_COS = 0.999


def _loaders(data_dir: str, target: str, hidden: int, layers: Sequence[int], seq_len: int):
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import create_train_val_loaders

    return create_train_val_loaders(
        data_path=data_dir, total_seq_len=seq_len, hidden_states_dtype=torch.float32, transfer=None,
        vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path=target,
        request_timeout=None, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=hidden, num_target_layers=len(layers), num_workers=0, prefetch_factor=None,
        preprocess=shift_batch, train_data_ratio=0.5)


def train_one_step(data_dir: str, target: str, layers: Sequence[int], seq_len: int = 512,
                   min_target_cos: float = MIN_TARGET_COS) -> Dict[str, Any]:
    """Raise unless speculators trains on ``data_dir`` as it would on its own data; returns the
    lowest row cosine of its targets against transformers' logits per sample (``target_cos``, by
    file index, over both of its splits) and the step's loss."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from transformers import AutoConfig

    from tests.reference import _model

    cfg = AutoConfig.from_pretrained(target)
    train, val = _loaders(data_dir, target, cfg.hidden_size, layers, seq_len)
    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(
        cfg, verifier_name_or_path=target, target_layer_ids=list(layers), draft_vocab_size=cfg.vocab_size,
        norm_before_residual=True, ttt_steps=2, draft_attn_impl="eager").float()

    target_cos = {}
    for split in (train.dataset, val.dataset):
        for k in range(len(split)):
            sample = split[k]
            with torch.no_grad():
                targets = model.verifier_lm_head(model.verifier_norm(sample["verifier_last_hidden_states"].float()))
                logits = _model(target, torch.float32)(sample["input_ids"].unsqueeze(0)).logits[0]
            target_cos[split.start_file_idx + k] = min_row_cosine(targets, logits)
    worst = min(target_cos.values())
    if worst < min_target_cos:
        raise AssertionError(f"speculators' targets differ from the target model's logits: lowest row cosine "
                             f"{worst:.4f} < {min_target_cos} (is the final state the pre-norm one?)")

    batch = next(iter(train))
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3)
    # the trainer's own call (get_trainer_kwargs), its loss's eager implementation (the fused one is Triton, GPU only)
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(ttt_steps=2, ttt_step_loss_decay=1.0, loss_fn="kl_div",
                                                          loss_implementation="eager")
    _, loss, _ = model(**{k: batch[k] for k in ("hidden_states", "input_ids", "document_ids", "loss_mask",
                                                 "position_ids", "verifier_last_hidden_states")}, **train_kwargs)
    if not torch.isfinite(loss) or loss.item() <= 0:
        raise AssertionError(f"speculators' loss on the export is {loss.item()}")
    loss.backward()
    opt.step()
    if not any(not torch.equal(b, p.detach()) for b, p in zip(before, params)):
        raise AssertionError("one optimizer step left every trainable weight unchanged")
    return {"target_cos": target_cos, "loss": loss.item()}
