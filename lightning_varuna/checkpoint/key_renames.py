"""Key renamings that Hugging Face transformers applies when it loads a checkpoint, applied to ``initial_weights``.

transformers 5 renames some modules and keeps the old names in the files it writes: ``save_pretrained`` of a
ViT writes ``vit.encoder.layer.0.attention.attention.query.weight`` for the module's
``vit.layers.0.attention.q_proj.weight``, a GPT-NeoX ``embed_out.weight`` for ``lm_head.weight``, and the hub's
folders have those names too. ``from_pretrained`` renames them as it loads; :func:`key_renamer` gives the same
renaming for a model held inside the LightningModule, so a folder loads under the strategy as it loads in
transformers. Conversions that merge or split tensors (fused projections, stacked experts) are not renamings and
are refused with the keys they concern.

The functions used (``transformers.conversion_mapping.get_model_conversion_mapping``,
``transformers.core_model_loading.rename_source_key``) are those PEFT uses for the same purpose; the tests run
them with transformers 5.x.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

from lightning_varuna.checkpoint.state import CheckpointError

__all__ = ["key_renamer"]


def key_renamer(module: nn.Module, prefix: str) -> Callable[[str], str] | None:
    """How transformers would rename a file key for the model at ``prefix`` in ``module`` (None: no renaming).

    Args:
        module: The LightningModule (or any module) holding the pretrained model.
        prefix: ``initial_weights_prefix``: the pretrained model's path in ``module`` followed by a dot, or ``""``.
    """
    transformers = sys.modules.get("transformers")  # a model of transformers means it is imported
    if transformers is None:
        return None
    try:
        model = module.get_submodule(prefix.rstrip(".")) if prefix else module
    except AttributeError:
        return None
    if not isinstance(model, transformers.PreTrainedModel):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]  # the only other kind of transform
    if not renamings and not converters:
        return None

    def rename(key: str) -> str:
        renamed, converted_by = rename_source_key(key, renamings, converters)
        if converted_by is not None:
            raise CheckpointError(
                f"initial_weights: the key {key} is converted (merged or split with others, pattern"
                f" {converted_by!r}) when transformers loads {type(model).__name__}, which initial_weights does not do."
                " Save the model with this transformers version (save_pretrained of a model loaded with"
                " from_pretrained), or load a plain state_dict of the model."
            )
        return renamed

    return rename
