"""Units, flat buffers and the index from parameter names to (unit, offset, shape).

A unit is one repeated block (the children of the model's largest `ModuleList` of same-class
modules, or the list the user names) or the *root* unit: every parameter outside the blocks.
A unit's parameters are laid end to end in one flat buffer per state kind: weight-decayed
parameters first, then the rest, so an optimizer shard has at most two segments. The flat
length is padded so it splits into `world_size` equal shards whose byte sizes are multiples of
`ALIGN_BYTES` in every dtype we store (direct I/O needs 4 KiB-aligned sizes).

This module only describes layouts; it allocates nothing and moves no bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from tierzero.adamw import decays
from tierzero.errors import ConfigError

ALIGN_BYTES = 4096
ALIGN_NUMEL = ALIGN_BYTES // 2  # numel multiple that keeps 2-byte (bf16/fp16) shards aligned too


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its unit's flat buffer. `names` lists every tied alias."""

    names: tuple[str, ...]
    module_attrs: tuple[tuple[nn.Module, str], ...]
    offset: int
    numel: int
    shape: tuple[int, ...]
    decays: bool

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass
class Unit:
    """One unit: its index, name, the modules it owns and its flat layout."""

    index: int
    name: str
    module: nn.Module | None  # the block; None for the root unit
    slots: list[ParamSlot] = field(default_factory=list)
    numel: int = 0  # unpadded
    padded_numel: int = 0
    decay_numel: int = 0  # flat[:decay_numel] is weight-decayed
    world_size: int = 1

    @property
    def is_root(self) -> bool:
        return self.module is None

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def segments(self, rank: int) -> list[tuple[int, int, bool]]:
        """(start, end, decays) runs of this rank's shard, in shard-local offsets."""
        lo, hi = self.shard_range(rank)
        runs = [(lo, min(hi, self.decay_numel), True), (max(lo, self.decay_numel), hi, False)]
        return [(a - lo, b - lo, d) for a, b, d in runs if b > a]


def find_blocks(model: nn.Module, units: str | None = None) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: the named `ModuleList`, or its largest one of one class."""
    if units is not None:
        try:
            blocks = model.get_submodule(units)
        except AttributeError:
            blocks = None
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ConfigError(f"units '{units}' is not a non-empty nn.ModuleList of the model; "
                              "name the attribute path of its repeated blocks, e.g. 'model.layers'")
        return units, blocks
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and len(module) > 1
                and len({type(m) for m in module}) == 1
                and (best is None or len(module) > len(best[1]))):
            best = (name, module)
    if best is None:
        raise ConfigError(f"{type(model).__name__} has no nn.ModuleList of repeated blocks to split "
                          "into units; name one with Config(units='path.to.blocks')")
    return best


def partition(model: nn.Module, world_size: int = 1, units: str | None = None) -> list[Unit]:
    """Split `model` into units: the root unit (index 0) and one per block, in forward order."""
    blocks_name, blocks = find_blocks(model, units)
    block_of_module = {id(m): i + 1 for i, block in enumerate(blocks) for m in block.modules()}
    result = [Unit(0, "root", None, world_size=world_size)]
    result += [Unit(i + 1, f"{blocks_name}.{i}", b, world_size=world_size) for i, b in enumerate(blocks)]
    found: dict[int, tuple[list[str], list[tuple[nn.Module, str]], nn.Parameter]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False, remove_duplicate=False):
            names, attrs, _ = found.setdefault(id(p), ([], [], p))
            full = f"{mod_name}.{attr}" if mod_name else attr
            if full not in names:
                names.append(full)
            if all(m is not module or a != attr for m, a in attrs):
                attrs.append((module, attr))
    members: list[list[int]] = [[] for _ in result]
    for pid, (_, attrs, _) in found.items():
        # a parameter used by several units (tied) goes to the root, which stays gathered all step
        owners = {block_of_module.get(id(module), 0) for module, _ in attrs}
        members[owners.pop() if len(owners) == 1 else 0].append(pid)
    by_param = found
    for unit, pids in zip(result, members):
        ordered = sorted(pids, key=lambda pid: not decays(by_param[pid][2]))  # stable: decayed first
        offset = 0
        for pid in ordered:
            names, attrs, p = by_param[pid]
            unit.slots.append(ParamSlot(tuple(names), tuple(attrs), offset, p.numel(), tuple(p.shape), decays(p)))
            offset += p.numel()
            if decays(p):
                unit.decay_numel = offset
        unit.numel = offset
        quantum = ALIGN_NUMEL * world_size
        unit.padded_numel = max(quantum, -(-offset // quantum) * quantum)
    return result
