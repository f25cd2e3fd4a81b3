"""A unit's parameters as views into a flat buffer: bind them while the unit computes, pack
their gradients into one flat tensor, and leave meta placeholders otherwise.

The one place that points module attributes at engine-owned memory: the unit runner
(`execute`), the vertical schedule, a root unit's pass, the stored shards' fill and a
checkpoint's restore all bind through here. Nothing here gathers, moves or steps anything.
"""

from __future__ import annotations

import torch

from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit


def bind(unit: Unit, flat: torch.Tensor, requires_grad: bool = False) -> list[torch.Tensor]:
    """Point every parameter of `unit` at its slice of `flat` (views, no copies); return them.

    With `requires_grad` each trainable view becomes its own autograd leaf: autograd then
    writes each parameter's gradient once, instead of scattering every view's gradient into a
    zeroed copy of the whole flat buffer (which costs one flat-sized pass per parameter).
    Frozen parameters stay plain views: autograd computes no gradient for them.
    """
    leaves = []
    for slot in unit.slots:
        view = flat[slot.offset : slot.end].view(slot.shape)
        if requires_grad and not slot.frozen:
            view = view.detach().requires_grad_(True)
        leaves.append(view)
        for module, attr in slot.module_attrs:
            setattr(module, attr, view)
    return leaves


def flat_grad(unit: Unit, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, frozenset[int]]:
    """The gradient of the unit's trainable prefix as one fp32 flat buffer (each parameter's
    grad copied once; one rank: `trainable_numel` long, several: the padded flat, which is
    reduce-scattered), and the indices of the slots that got a gradient (torch's AdamW skips
    a parameter whose `.grad` is None; here its values are zeros)."""
    device = leaves[0].device if leaves else torch.device("cpu")
    out = torch.empty(
        unit.trainable_numel if unit.world_size == 1 else unit.padded_numel,
        dtype=torch.float32,
        device=device,
    )
    present, end = [], 0
    for i, (slot, leaf) in enumerate(zip(unit.slots, leaves)):
        if slot.frozen:
            continue
        if leaf.grad is None:
            out[slot.offset : slot.end].zero_()
        else:
            out[slot.offset : slot.end].copy_(leaf.grad.reshape(-1))
            present.append(i)
        end = slot.end
    out[end:].zero_()
    return out, frozenset(present)


def unbind(unit: Unit, dtype: torch.dtype, device: torch.device) -> None:
    """Replace the views with `Unbound` placeholders on the compute `device`, so a stale use
    fails loudly and frees nothing, while a model that reads a weight's device keeps working."""
    for slot in unit.slots:
        placeholder = Unbound(slot.shape, dtype, device, slot.names[0])
        for module, attr in slot.module_attrs:
            setattr(module, attr, placeholder)


def detach_params(unit: Unit, dtype: torch.dtype, device: torch.device) -> None:
    """Turn the unit's `nn.Parameter`s into plain attributes; the engine owns them from now on."""
    for slot in unit.slots:
        for module, attr in slot.module_attrs:
            module._parameters.pop(attr, None)
    unbind(unit, dtype, device)


class Unbound(torch.Tensor):
    """A parameter while its unit is not bound: its shape, dtype and the compute device, and no
    storage. Models read a weight's device before they call its module (Llama 4 moves
    `input_ids` to `embed_tokens.weight.device` before the embedding unit is bound), so it
    reports where the unit will be bound; any operation on its values raises, naming it."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    param_name: str

    @staticmethod
    def __new__(
        cls, shape: torch.Size, dtype: torch.dtype, device: torch.device, name: str
    ) -> Unbound:
        placeholder = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        placeholder.param_name = name
        return placeholder

    @classmethod
    def __torch_dispatch__(
        cls, func: object, types: object, args: tuple = (), kwargs: dict | None = None
    ) -> None:
        names = [a.param_name for a in (*args, *(kwargs or {}).values()) if isinstance(a, Unbound)]
        raise RuntimeError(
            f"{func} read parameter {names[0] if names else '?'} while its unit is not bound: "
            "the engine binds a unit's parameters only while it computes"
        )

    def __repr__(self) -> str:
        shape = tuple(self.shape)
        return (
            f"Unbound({self.param_name}, shape={shape}, dtype={self.dtype}, device={self.device})"
        )


def place_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Module buffers (rotary tables, masks) live on the compute device with the activations."""
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise ConfigError(
                f"buffer '{name}' is on the meta device and the engine cannot "
                "initialise it; build the model with its buffers materialised"
            )
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(device)
