"""The built-in models: `build` a preset (or any `ModelArgs`) on a device, initialised from a
seed."""

import torch

from tierzero.models.llama import Transformer
from tierzero.models.presets import PRESETS, ModelArgs, get_preset

__all__ = ["ModelArgs", "PRESETS", "Transformer", "build", "get_preset"]


def build(
    preset: str | ModelArgs,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
) -> Transformer:
    """A `Transformer` with parameters of `dtype` on `device`.

    On `meta` nothing is allocated (a 70b builds instantly, for counting and planning).
    Elsewhere every unit is initialised from `seed` (see `Transformer.init_unit`), so the same
    seed gives bitwise the same weights on any device; `seed=None` draws from torch's global RNG.
    """
    args = get_preset(preset) if isinstance(preset, str) else preset
    with torch.device("meta"):  # no allocation, and no default init we would overwrite
        model = Transformer(args).to(dtype)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.tie_weights()
    if seed is None:
        model.apply(model.init_weights)
    else:
        model.init_unit(seed, "root")
        for i in range(args.n_layers):
            model.init_unit(seed, i)
    return model
