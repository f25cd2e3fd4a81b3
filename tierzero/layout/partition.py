"""Units, flat buffers and the index from parameter names to (unit, offset, shape).

A unit is one repeated block (the children of the model's largest `ModuleList` of same-class
modules, or the list the user names), the *embedding* (the model's input embedding module) or
the *head* (every other parameter: the final norm and the output layer), each run through an
entry point the engine wraps -- a block's or the embedding's `forward`, the model's
`head_out(hidden, targets)` -- so no unit is held for the whole step. Tied embeddings stay in
the embedding unit, which the head then uses too (`uses_with`): one unit used at both ends.
A model without an input embedding or a `head_out` gets one *root* unit instead, every
parameter outside the blocks, bound for the whole pass.
A unit's parameters are laid end to end in one flat buffer per state kind: trainable
weight-decayed parameters first, then the other trainable ones, so an optimizer shard has at
most two segments; then, from an aligned offset (`trainable_numel`), the frozen ones
(`requires_grad=False`), which have a param and no grad, master or Adam state: the state
kinds other than `param` cover only the flat buffer's trainable prefix. The flat
length is padded so it splits into `world_size` equal shards whose byte sizes are multiples of
`ALIGN_BYTES` in every dtype we store (direct I/O needs 4 KiB-aligned sizes).

This module only describes layouts; it allocates nothing and moves no bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tierzero.adamw import decays
from tierzero.errors import ConfigError
from tierzero.storage.base import ALIGN_BYTES  # direct I/O's 4 KiB: every shard's size a multiple

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
    frozen: bool = False  # requires_grad=False: stored as a param only, never stepped

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass
class Unit:
    """One unit: its index, name, how it runs, the units it binds too, and its flat layout."""

    index: int
    name: str
    kind: str  # "embedding" | "block" | "head" | "root"
    entry: tuple[Any, str] | None  # (owner, attribute) whose call runs the unit; None: root
    uses_with: tuple[int, ...] = ()  # units bound while this one computes (tied weights)
    slots: list[ParamSlot] = field(default_factory=list)
    # the flat layout's end before padding (with frozen params: the aligned gap before them too)
    numel: int = 0
    padded_numel: int = 0
    trainable_numel: int = 0  # flat[:trainable_numel] has grads and optimizer states; frozen after
    world_size: int = 1
    replicated: bool = False  # ZeRO stage 1/2: every rank's param home holds the whole flat buffer

    @property
    def is_root(self) -> bool:
        return self.kind == "root"

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    @property
    def param_numel(self) -> int:
        """Elements of the param a rank stores: its shard, or the whole flat buffer when
        replicated."""
        return self.padded_numel if self.replicated else self.shard_numel

    def param_offset(self, rank: int) -> int:
        """Where this rank's shard starts in the param it stores."""
        return self.shard_range(rank)[0] if self.replicated else 0

    @property
    def has_frozen(self) -> bool:
        return self.trainable_numel < self.padded_numel

    def state_numel(self, rank: int) -> int:
        """Elements of this rank's shard that have grads and optimizer states (a prefix of it:
        the whole shard unless the unit has frozen parameters)."""
        lo, _ = self.shard_range(rank)
        return min(self.shard_numel, max(0, self.trainable_numel - lo))

    def pieces(self, piece_numel: int, rank: int) -> list[tuple[int, int]]:
        """(start, end) of each piece of the shard's trainable prefix, in shard-local offsets:
        `piece_numel` each (the last one shorter), so every piece of every state kind stays
        aligned. Grads, master weights and Adam states are stored in these pieces."""
        return piece_ranges(self.state_numel(rank), piece_numel)

    def param_pieces(self, piece_numel: int, rank: int) -> list[tuple[int, int]]:
        """The pieces of the param this rank stores, in its offsets. Per shard: the trainable
        prefix's (so the optimizer writes param piece i as it steps piece i), then the frozen
        rest's, which are never written; replicated, every rank's shard's pieces end to end
        (this rank's from `param_piece_base(rank)` on)."""
        if self.replicated:
            return [
                (lo + a, lo + b)
                for r in range(self.world_size)
                for lo in [self.shard_range(r)[0]]
                for a, b in self._shard_param_pieces(piece_numel, r)
            ]
        return self._shard_param_pieces(piece_numel, rank)

    def param_piece_base(self, piece_numel: int, rank: int) -> int:
        """The index of this rank's first param piece among those it stores (0 unless
        replicated)."""
        if not self.replicated:
            return 0
        return sum(len(self._shard_param_pieces(piece_numel, r)) for r in range(rank))

    def _shard_param_pieces(self, piece_numel: int, rank: int) -> list[tuple[int, int]]:
        start = self.state_numel(rank)
        frozen = piece_ranges(self.shard_numel - start, piece_numel)
        return self.pieces(piece_numel, rank) + [(start + a, start + b) for a, b in frozen]


def piece_ranges(shard_numel: int, piece_numel: int) -> list[tuple[int, int]]:
    return [(a, min(a + piece_numel, shard_numel)) for a in range(0, shard_numel, piece_numel)]


def find_blocks(model: nn.Module, units: str | None = None) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: the named `ModuleList` (or the one the model names as its
    `blocks_path`: a Hugging Face hybrid's layers are of several classes), or its largest one of
    one class."""
    # its own, not a wrapper's
    units = units if units is not None else vars(model).get("blocks_path")
    if units is not None:
        try:
            blocks = model.get_submodule(units)
        except AttributeError:
            blocks = None
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ConfigError(
                f"units '{units}' is not a non-empty nn.ModuleList of the model; "
                "name the attribute path of its repeated blocks, e.g. 'model.layers'"
            )
        return units, blocks
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > 1
            and len({type(m) for m in module}) == 1
            and (best is None or len(module) > len(best[1]))
        ):
            best = (name, module)
    if best is None:
        raise ConfigError(
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks to split "
            "into units; name its attribute path with --units (Config(units=...)), "
            "e.g. model.layers"
        )
    return best


def input_embedding(model: nn.Module, blocks: nn.ModuleList) -> nn.Module | None:
    """The model's input embedding: `get_input_embeddings()` where the model has one, else its
    only `nn.Embedding` outside the blocks; None when there is no single one."""
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        found = getter()
        if isinstance(found, nn.Module):
            return found
    inside = {id(m) for m in blocks.modules()}
    candidates = [m for m in model.modules() if isinstance(m, nn.Embedding) and id(m) not in inside]
    return candidates[0] if len(candidates) == 1 else None


def partition(model: nn.Module, world_size: int = 1, units: str | None = None) -> list[Unit]:
    """Split `model` into units in forward order: embedding (0), blocks (1..n), head (n+1);
    or, for a model without an input embedding and `head_out`, root (0) and blocks."""
    blocks_name, blocks = find_blocks(model, units)
    n = len(blocks)
    unit_of_module = {id(m): i + 1 for i, block in enumerate(blocks) for m in block.modules()}
    embedding = input_embedding(model, blocks)
    head_owner = _head_owner(model)
    found = _parameters(model)
    split = (
        embedding is not None
        and head_owner is not None
        and _only_embeddings_tied(found, unit_of_module)
    )
    if split:
        assert embedding is not None
        unit_of_module.update({id(m): 0 for m in embedding.modules()})
        result = [Unit(0, "embedding", "embedding", (embedding, "forward"))]
    else:
        result = [Unit(0, "root", "root", None)]
    result += [
        Unit(i + 1, f"{blocks_name}.{i}", "block", (b, "forward")) for i, b in enumerate(blocks)
    ]
    rest = 0
    if split:
        result.append(Unit(n + 1, "head", "head", (head_owner, "head_out")))
        rest = n + 1
    members: list[list[int]] = [[] for _ in result]
    for pid, (_, attrs, _) in found.items():
        owners = {unit_of_module.get(id(module), rest) for module, _ in attrs}
        if len(owners) == 1:
            members[owners.pop()].append(pid)
        elif split:  # tied to the embedding (checked above): the head uses the embedding unit
            members[0].append(pid)
            result[-1].uses_with = (0,)
        else:  # used by several units: the root, bound for the whole pass, holds it
            members[0].append(pid)
    for unit, pids in zip(result, members):
        _lay_out(unit, pids, found, world_size)
    return result


def _head_owner(model: nn.Module) -> nn.Module | None:
    """The module whose class defines `head_out`: the model, or the model a wrapper holds (a
    `peft` model forwards attribute reads to it, but its own calls go to the inner model)."""
    return next((m for m in model.modules() if callable(getattr(type(m), "head_out", None))), None)


def _parameters(
    model: nn.Module,
) -> dict[int, tuple[list[str], list[tuple[nn.Module, str]], nn.Parameter]]:
    """Every parameter once (by identity): its names (tied aliases) and (module, attr) uses."""
    found: dict[int, tuple[list[str], list[tuple[nn.Module, str]], nn.Parameter]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False, remove_duplicate=False):
            names, attrs, _ = found.setdefault(id(p), ([], [], p))
            full = f"{mod_name}.{attr}" if mod_name else attr
            if full not in names:
                names.append(full)
            if all(m is not module or a != attr for m, a in attrs):
                attrs.append((module, attr))
    return found


def _only_embeddings_tied(found: dict, unit_of_module: dict[int, int]) -> bool:
    """Whether no parameter is shared between blocks (those need the root unit)."""
    for _, attrs, _ in found.values():
        blocks = {unit_of_module[id(m)] for m, _ in attrs if id(m) in unit_of_module}
        if len(blocks) > 1 or (
            blocks and len(attrs) > len([m for m, _ in attrs if id(m) in unit_of_module])
        ):
            return False
    return True


def _lay_out(unit: Unit, pids: list[int], found: dict, world_size: int) -> None:
    """Trainable decayed parameters first, then the other trainable ones, then (from an
    aligned offset, so their pieces stay aligned) the frozen; pad so every rank's shard is
    aligned."""
    unit.world_size = world_size

    def order(pid: int) -> int:
        p = found[pid][2]
        return 2 if not p.requires_grad else 0 if decays(p) else 1

    ordered = sorted(pids, key=order)  # stable
    offset = 0
    frozen_from = None
    for pid in ordered:
        names, attrs, p = found[pid]
        frozen = not p.requires_grad
        if frozen and frozen_from is None:
            frozen_from = offset = -(-offset // ALIGN_NUMEL) * ALIGN_NUMEL
        unit.slots.append(
            ParamSlot(
                tuple(names),
                tuple(attrs),
                offset,
                p.numel(),
                tuple(p.shape),
                decays(p) and not frozen,
                frozen,
            )
        )
        offset += p.numel()
    unit.numel = offset
    unit.padded_numel = padded_numel(offset, world_size)
    unit.trainable_numel = unit.padded_numel if frozen_from is None else frozen_from


def padded_numel(numel: int, world_size: int) -> int:
    """A flat length of `numel` padded to split into `world_size` equal, aligned shards (at
    least one aligned element run each, so no rank's shard is empty)."""
    quantum = ALIGN_NUMEL * world_size
    return max(quantum, -(-numel // quantum) * quantum)


def replicate_params(units: list[Unit], replicated: bool) -> None:
    """Store every unit's params whole on each rank (ZeRO stage 1/2) or sharded (stage 3)."""
    for unit in units:
        unit.replicated = replicated and unit.world_size > 1


def forward_uses(units: list[Unit]) -> list[tuple[int, ...]]:
    """The units each call binds, in forward order (the head with the embedding when tied)."""
    return [(u.index, *u.uses_with) for u in units]


def forward_only(units: list[Unit]) -> frozenset[int]:
    """Units whose call needs no backward: an embedding without trainable parameters (its
    input is token ids, which need no gradient either), so it is neither refetched nor
    recomputed in backward."""
    return frozenset(u.index for u in units if u.kind == "embedding" and u.trainable_numel == 0)


def grad_uses(units: list[Unit]) -> dict[int, int]:
    """How many gradient contributions each unit gets per backward (2 for a tied embedding)."""
    counts = {u.index: 0 for u in units}
    for call in forward_uses(units):
        for index in call:
            counts[index] += 1
    return counts
