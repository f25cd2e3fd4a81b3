"""The layout transformers saves a Hugging Face model's tensors in, read and written one group
at a time.

transformers 5 keeps some parameters in another layout inside the model than in its files. A
Mixture-of-Experts layer holds its experts as one fused tensor per projection
(`mlp.experts.gate_up_proj`, experts x 2*intermediate x hidden), while `save_pretrained` and the
hub's checkpoints hold one tensor per expert and projection (Mixtral's
`block_sparse_moe.experts.3.w1.weight`, Qwen2-MoE's `mlp.experts.3.gate_proj.weight`); some
names differ too (GPT-NeoX's `embed_out`, GraniteMoE's `input_linear`). Each family's
conversion mapping (`transformers.conversion_mapping`) says how, and this module runs
transformers' own transforms, the way `from_pretrained` and `save_pretrained` do, on one group
of tensors at a time (the experts of one projection of one layer): loading holds one
parameter's source tensors and its result, export one parameter's saved tensors, never a model.

`SavedFormat.read` finds a parameter in files of either layout: under its own names (the
fused layout, what `--format model` exports), else renamed or converted from the tensors the
files hold. `SavedFormat.saved` is what `save_pretrained` would write for a checkpoint's
tensors: the names and shapes come from running the reverse transforms on `meta` tensors, the
values from running them on the unit's master weights as the export streams it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from tierzero.errors import ConfigError
from tierzero.models.weights import WeightFiles


@dataclass(eq=False)
class Converted:
    """The saved tensors of one conversion group: computed from the group's model tensors the
    first time one is asked for, each handed out once (so they are freed as they are written)."""

    model: nn.Module
    sources: list[Any]  # the checkpoint's TensorEntry of each model tensor in the group
    ready: dict[str, torch.Tensor] = field(default_factory=dict)
    done: bool = False

    def take(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        from transformers.core_model_loading import revert_weight_conversion

        if not self.done:
            self.ready = revert_weight_conversion(
                self.model, {s.name: s.values(flat).view(s.shape) for s in self.sources}
            )
            self.done = True
        return self.ready.pop(name).contiguous()


class SavedFormat:
    """A Hugging Face model's conversion mapping, for reading its parameters from files of
    either layout and for writing them as `save_pretrained` does. `model` may be on `meta`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._index: (
            tuple[WeightFiles, dict[str, str], dict[str, tuple[Any, list[tuple[str, str]]]]] | None
        ) = None
        # outputs of a group not yet read (one-to-many)
        self._converted: dict[str, torch.Tensor] = {}
        # now: the engine later detaches parameters
        self._params = dict.fromkeys(model.state_dict())

    # -- loading --------------------------------------------------------------------------------

    def read(
        self, files: WeightFiles, names: tuple[str, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The parameter called `names` (its aliases), fp32, from `files`: under one of its own
        names, or renamed or converted (stacked experts) from what the files hold."""
        own = [n for n in names if files.holds(n)]
        if own:
            return files.load((own[0],), shape)
        _, renamed, groups = self._indexed(files)
        for name in names:
            if name in renamed:
                return files.load((renamed[name],), shape)
        for name in names:
            if name in self._converted or name in groups:
                return self._convert(files, name, groups, shape)
        return files.load(names, shape)  # none: the one-line error naming what is missing

    def _indexed(
        self, files: WeightFiles
    ) -> tuple[WeightFiles, dict[str, str], dict[str, tuple[Any, list]]]:
        """Every file tensor's model name, as `from_pretrained` renames it (`rename_source_key`):
        renamed ones by model name; converted ones grouped under their first target name."""
        if self._index is not None and self._index[0] is files:
            return self._index
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        transforms = get_model_conversion_mapping(self.model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = getattr(self.model, "base_model_prefix", None)
        renamed: dict[str, str] = {}
        groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
        # experts in order, as from_pretrained stacks them
        for key in sorted(files.names(), key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, self._params)
            if pattern is not None:
                groups.setdefault(target, (by_pattern[pattern], []))[1].append((key, pattern))
            elif target != key:
                renamed.setdefault(target, key)
        self._index = (files, renamed, groups)
        return self._index

    def _convert(
        self,
        files: WeightFiles,
        name: str,
        groups: dict[str, tuple[Any, list]],
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        """Run the converter of `name`'s group on its source tensors (read one by one)."""
        if name not in self._converted:
            converter, sources = groups[name]
            converter = copy.deepcopy(converter)
            for key, pattern in sources:
                converter.add_tensor(name, key, pattern, functools.partial(files.read, key))
            out = converter.convert(name, model=self.model, config=self.model.config)
            self._converted.update({k: v[0] if isinstance(v, list) else v for k, v in out.items()})
        value = self._converted.pop(name)
        if tuple(value.shape) != shape:
            raise ConfigError(
                f"weights converted to '{name}' have shape {tuple(value.shape)} but the model "
                f"expects {shape}; load weights made for this model"
            )
        return value.float()

    # -- export ---------------------------------------------------------------------------------

    def saved(self, entries: list[Any], make: Callable[..., Any]) -> list[Any]:
        """`entries` (a checkpoint's `TensorEntry`s) as `save_pretrained` would write them: renamed
        in place, or replaced by the tensors their conversion group is saved as (`make(name, unit,
        shape, converted)` builds each), in the order `revert_weight_conversion` gives them."""
        from transformers.core_model_loading import (
            apply_converters,
            apply_renamings,
            revert_weight_conversion,
        )

        renamings, converters = self._reversed()
        out: list[Any] = []
        groups: dict[str, list[Any]] = {}
        for entry in entries:
            target, pattern = apply_converters(entry.name, converters)
            if pattern is None:
                out.append(replace(entry, name=apply_renamings(entry.name, renamings)))
                continue
            if target not in groups:
                groups[target] = []
                out.append(target)  # a placeholder: the group's tensors go here
            groups[target].append(entry)
        result = []
        for item in out:
            if not isinstance(item, str):
                result.append(item)
                continue
            sources = groups[item]
            group = Converted(self.model, sources)
            metas = revert_weight_conversion(
                self.model, {s.name: torch.empty(s.shape, device="meta") for s in sources}
            )
            result += [
                make(name, sources[0].unit, tuple(t.shape), group) for name, t in metas.items()
            ]
        return result

    def _reversed(self) -> tuple[list[Any], list[Any]]:
        """The saving transforms, as `revert_weight_conversion` builds them for a model built from
        its config: no legacy renamings, no prefix changes, each reversed, in reverse order."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

        transforms = [
            t
            for t in get_model_conversion_mapping(self.model, add_legacy=False)
            if not isinstance(t, PrefixChange)
        ]
        reverse = [t.reverse_transform() for t in transforms[::-1]]
        return (
            [t for t in reverse if isinstance(t, WeightRenaming)],
            [t for t in reverse if isinstance(t, WeightConverter)],
        )


def meta_model(config: dict[str, Any]) -> nn.Module:
    """The Hugging Face causal LM of a recorded `config.json`, every tensor on `meta` (export
    needs its conversion mapping and parameter shapes, not its values)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError(
            "exporting a Hugging Face model needs transformers; pip install 'tierzero[hf]'"
        ) from None
    settings = {k: v for k, v in config.items() if k != "model_type"}
    try:
        built = AutoConfig.for_model(config["model_type"], **settings)
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"the checkpoint's config.json is not one this transformers can build ({e}); "
            "export with --tensors model, or upgrade transformers"
        ) from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(built)
