"""Which layers are captured, in the one convention this package uses everywhere, and how they
map to the EAGLE-3 drafter config that makes SGLang capture the same ones.

Convention: layer id i is the residual stream *entering* decoder layer i, which is
transformers' ``output_hidden_states[i]`` (0 = the embeddings). It is exactly SGLang's
``layers_to_capture`` value (its decoder loops append ``hidden_states + residual`` *before*
running layer i, and in ascending layer order). SGLang's own ``set_eagle3_layers_to_capture``
setters disagree (Llama/Qwen add 1 to every id, DeepSeek adds 1 only when the first id is 1),
so this package never calls them with user ids; it writes ``layers_to_capture`` itself.

The drafter side of that mapping lives here and only here (``sglang_layers_to_capture``,
``layers_from_eagle3_ids``, ``eagle3_config_layer_ids``, ``read_draft_eagle3_ids``): the export
tool and the launcher both go through it, and ``tests/test_layers_sglang_rule.py`` checks it
against SGLang's own setters.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

LAYER_CONVENTION = (
    "id i = residual stream entering decoder layer i = transformers output_hidden_states[i] "
    "(0 = embeddings); columns in ascending id order"
)

# Architectures whose SGLang model class supports aux hidden-state capture, by family.
_DEEPSEEK = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"}
_LLAMA_LIKE = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(sorted(_DEEPSEEK | _LLAMA_LIKE))

# Where SGLang (0.5.17, model_runner_components/spec_aux_hidden_state.py) reads the drafter's ids:
# draft config.json -> "eagle_config" -> this key. A top-level key of the same name only sizes
# the drafter's fc layer; it does not choose the target's capture layers.
EAGLE3_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


class LayerError(ValueError):
    """Layer ids that the model cannot capture; the message is one actionable line."""


def min_layer(architecture: str) -> int:
    """Llama-family models have no residual entering layer 0 (SGLang's capture would crash)."""
    return 0 if architecture in _DEEPSEEK else 1


def default_layers(num_layers: int, architecture: str) -> List[int]:
    """EAGLE-3's default aux layers (outputs of layers 2, L//2, L-3) in this package's convention.

    For a 61-layer DeepSeek-V3 / Kimi-K2.5 that is [3, 31, 59]. Shallow test models that cannot
    hold three distinct ids get the distinct ones that fit. This is *not* what SGLang captures
    for a drafter config without ids (``sglang_default_layers``: one lower); a published drafter
    trained on SGLang's layers is matched with ``--capture-layers-from-draft``.
    """
    lo, hi = min_layer(architecture), num_layers - 1
    ids = [min(max(i, lo), hi) for i in (3, num_layers // 2 + 1, num_layers - 2)]
    return sorted(set(ids))


def _check_architecture(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise LayerError(
            f"model architecture {architecture} has no aux hidden-state capture in SGLang; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def resolve_layers(requested: Optional[Sequence[int]], num_layers: int, architecture: str) -> List[int]:
    """Validate user layer ids (or pick the default) for a model; raises LayerError."""
    _check_architecture(architecture)
    if requested is None:
        return default_layers(num_layers, architecture)
    lo, hi = min_layer(architecture), num_layers - 1
    bad = [i for i in requested if not lo <= i <= hi]
    if bad:
        raise LayerError(
            f"--capture-layers {','.join(map(str, bad))} out of range: {architecture} with {num_layers} layers "
            f"accepts ids {lo}..{hi} (id i = input of decoder layer i)"
        )
    return sorted(set(requested))


# --- SGLang's drafter rule, both directions -------------------------------------------------


def sglang_default_layers(num_layers: int) -> List[int]:
    """What SGLang captures for an EAGLE-3 drafter whose config has no ids: every supported
    target's setter stores ``[2, L//2, L-3]`` directly in ``layers_to_capture`` (no +1), i.e.
    entering layers 2, L//2, L-3 in this package's convention ([2, 30, 58] for 61 layers)."""
    return [2, num_layers // 2, num_layers - 3]


def sglang_layers_to_capture(ids: Optional[Sequence[int]], num_layers: int, architecture: str) -> List[int]:
    """Exactly the ``layers_to_capture`` list SGLang (0.5.17) stores when it serves an EAGLE-3
    drafter whose ``eagle_config.eagle_aux_hidden_state_layer_ids`` is ``ids`` (None = absent),
    in SGLang's order, unchecked. Mirrors the target class's ``set_eagle3_layers_to_capture``:

    * no ids: ``[2, L//2, L-3]`` (all families);
    * Llama / Qwen2 / Qwen3 (+MoE): ``id + 1`` for every id (models/llama.py);
    * DeepSeek-V2/V3, Kimi-K2.5 (delegates to its DeepSeek-V3 language model): ``id + 1`` for
      every id when the *first* id is 1, else the ids unchanged (models/deepseek_v2.py).
    """
    _check_architecture(architecture)
    if ids is None:
        return sglang_default_layers(num_layers)
    ids = list(ids)
    if architecture in _DEEPSEEK and not (ids and ids[0] == 1):
        return ids
    return [i + 1 for i in ids]


def _fmt(xs: Optional[Sequence[int]]) -> str:
    return "absent" if xs is None else "[" + ", ".join(map(str, xs)) + "]"


def layers_from_eagle3_ids(ids: Optional[Sequence[int]], num_layers: int, architecture: str,
                           source: str = "the drafter config") -> List[int]:
    """The layers (this package's convention, ascending) SGLang captures for a drafter config's
    ids, or a one-line LayerError when SGLang would not capture one layer per id.

    SGLang captures in ascending layer order whatever order the ids have; a stored layer
    outside the target's decoder loop, a duplicate, or a Llama-family layer 0 (no residual yet)
    either fails inside the server or silently leaves the drafter's fc fewer aux states,
    depending on the model: all three are refused here instead.
    """
    stored = sglang_layers_to_capture(ids, num_layers, architecture)
    lo, hi = min_layer(architecture), num_layers - 1
    bad = [i for i in stored if not lo <= i <= hi]
    rule = f"{architecture}'s rule with {num_layers} layers"
    if bad:
        raise LayerError(
            f"{source}: {EAGLE3_IDS_KEY} {_fmt(ids)} make SGLang capture layers {_fmt(stored)} "
            f"({rule}), but only {lo}..{hi} exist (id i = input of decoder layer i); is it a drafter for this model?"
        )
    if len(set(stored)) != len(stored):
        raise LayerError(f"{source}: {EAGLE3_IDS_KEY} {_fmt(ids)} make SGLang capture layers {_fmt(stored)} "
                         f"({rule}) with a duplicate; each id must name a different layer")
    return sorted(stored)


def eagle3_config_layer_ids(layers: Sequence[int], architecture: str) -> List[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` a drafter config needs so that SGLang (0.5.17)
    serving it captures exactly ``layers`` (this package's convention); the inverse of
    ``sglang_layers_to_capture``, checked against it before it is returned.

    Llama/Qwen: ``layer - 1`` (layer 0 has no id: SGLang cannot capture it). DeepSeek/Kimi: the
    layers unchanged, except that ids starting with 1 would be shifted: layers starting at 1
    are written with the second layer first ([1, 30, 58] -> ids [30, 1, 58]), which SGLang
    stores unchanged and captures in ascending order; a single layer 1 has no ids.
    """
    _check_architecture(architecture)
    layers = sorted(layers)
    if architecture in _DEEPSEEK:
        ids = list(layers)
        if ids and ids[0] == 1:
            if len(ids) == 1:
                raise LayerError(f"{architecture}: no {EAGLE3_IDS_KEY} make SGLang capture layer 1 alone "
                                 "(ids starting with 1 are shifted by one); capture other layers")
            ids[0], ids[1] = ids[1], ids[0]
    else:
        if layers and layers[0] < 1:
            raise LayerError(f"{architecture}: SGLang cannot capture layer {layers[0]} for a drafter "
                             "(no residual enters layer 0); capture layers 1 and above")
        ids = [i - 1 for i in layers]
    # the check that makes it correct by construction: SGLang's rule must give the layers back
    num_layers = (layers[-1] + 1) if layers else 0
    if sorted(sglang_layers_to_capture(ids, num_layers, architecture)) != layers:  # pragma: no cover
        raise LayerError(f"{architecture}: no {EAGLE3_IDS_KEY} make SGLang capture layers {_fmt(layers)}")
    return ids


def needs_reordered_ids(ids: Sequence[int], architecture: str) -> bool:
    """True when ``eagle3_config_layer_ids`` had to put a layer other than 1 first (DeepSeek
    layers starting at 1): worth a note, since the ids are then unsorted on purpose."""
    return architecture in _DEEPSEEK and list(ids) != sorted(ids)


@dataclass(frozen=True)
class DraftEagle3Ids:
    """What SGLang reads from a drafter config to choose the target's capture layers."""

    path: str
    config: dict
    ids: Optional[List[int]]  # None = absent: SGLang captures its default layers
    use_aux_hidden_state: bool


def draft_config_path(path: str) -> str:
    """A drafter's config.json, given the file or its model directory (as SGLang's
    ``--speculative-draft-model-path`` is)."""
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def read_draft_eagle3_ids(path: str, option: str = "draft config") -> DraftEagle3Ids:
    """Read ``eagle_config.eagle_aux_hidden_state_layer_ids`` the way SGLang 0.5.17 does
    (``_resolve_eagle_aux_hidden_state``): a missing ``eagle_config`` or key, or null, means
    "absent" (SGLang then captures ``sglang_default_layers``). One-line LayerError for a file
    that is not a JSON object, has neither ``eagle_config`` nor an Eagle3 architecture (the
    target's config given by mistake), or has ids that are not a list of integers."""
    cfg_path = draft_config_path(path)
    try:
        with open(cfg_path) as f:
            cfg: Any = json.load(f)
    except FileNotFoundError:
        raise LayerError(f"{option} {cfg_path} does not exist; give the drafter's config.json or its directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LayerError(f"{option} {cfg_path} is not a readable JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise LayerError(f"{option} {cfg_path} is not a JSON object (a drafter config.json)")
    eagle = cfg.get("eagle_config")
    archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    if not isinstance(eagle, dict) and not any("eagle3" in str(a).lower() for a in archs):
        # SGLang would serve it with its default layers, but this is far more likely the target's
        # config (or another drafter's) given by mistake than an EAGLE-3 drafter without eagle_config
        raise LayerError(f"{option} {cfg_path} is not an EAGLE-3 drafter config (no eagle_config, architectures "
                         f"{json.dumps(archs)}); give the drafter's config.json, e.g. LlamaForCausalLMEagle3")
    eagle = eagle if isinstance(eagle, dict) else {}
    use_aux = bool(eagle.get("use_aux_hidden_state", True))  # SGLang tests it for truth
    ids = eagle.get(EAGLE3_IDS_KEY)
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise LayerError(f"{option} {cfg_path}: eagle_config.{EAGLE3_IDS_KEY} must be a non-empty list of "
                             f"integers such as [1, 29, 57], got {json.dumps(ids)}")
        ids = list(ids)
    return DraftEagle3Ids(path=cfg_path, config=cfg, ids=ids, use_aux_hidden_state=use_aux)


def draft_capture_layers(draft: DraftEagle3Ids, num_layers: int, architecture: str,
                         option: str = "draft config") -> List[int]:
    """The layers (this package's convention) SGLang captures on this target when serving
    ``draft``: its ids through ``layers_from_eagle3_ids``, or SGLang's default without ids."""
    source = f"{option} {draft.path}"
    if not draft.use_aux_hidden_state:
        raise LayerError(f"{source} sets eagle_config.use_aux_hidden_state false: SGLang captures no aux layers "
                         "for it; set it true (EAGLE-3 drafters need aux layers) or pick layers with --capture-layers")
    return layers_from_eagle3_ids(draft.ids, num_layers, architecture, source)
