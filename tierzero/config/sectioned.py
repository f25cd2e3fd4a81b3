"""`Sectioned`: a config composed of frozen sections, built and read back by flat keys.

Each room receives the one section it uses (`config.optimizer`, `config.tiering`, ...), so what
it can read is what it needs. Users and the TOML file still name settings by their flat key
(`Config(lr=3e-4, offload="nvme")`, `lr = 3e-4`): the key picks its section, and a run's
`config.toml` written before the sections existed reads back unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

S = TypeVar("S", bound="Sectioned")


class Sectioned:
    """A frozen dataclass whose `SECTIONS` fields are section dataclasses and whose other
    fields are plain settings; its constructor takes flat keys (or whole sections)."""

    SECTIONS: ClassVar[dict[str, type]] = {}

    def __init__(self, **keys: Any) -> None:
        for name, section in self.SECTIONS.items():
            own = {k: keys.pop(k) for k in _names(section) if k in keys}
            whole = keys.pop(name, None)
            if whole is not None and own:
                raise TypeError(f"{sorted(own)} given twice: flat and in the {name} section")
            object.__setattr__(self, name, whole if whole is not None else section(**own))
        for f in _fields(self):
            if f.name in self.SECTIONS:
                continue
            if f.name in keys:
                value = keys.pop(f.name)
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            object.__setattr__(self, f.name, value)
        if keys:
            raise TypeError(f"{type(self).__name__} got unknown keys {sorted(keys)}")
        self.__post_init__()

    def __post_init__(self) -> None:
        """Checks across sections (each section checks its own fields)."""

    @classmethod
    def keys(cls) -> set[str]:
        """Every flat key: the sections' fields and the plain settings."""
        plain = {f.name for f in _fields(cls) if f.name not in cls.SECTIONS}
        return plain.union(*(_names(s) for s in cls.SECTIONS.values()))

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat key (what the TOML file and the trackers hold)."""
        out: dict[str, Any] = {}
        for f in _fields(self):
            value = getattr(self, f.name)
            if f.name in self.SECTIONS:
                out.update({k: getattr(value, k) for k in _names(type(value))})
            else:
                out[f.name] = value
        return out

    def replace(self: S, **keys: Any) -> S:
        """A copy with `keys` (flat keys) changed, checked like a new config."""
        unknown = set(keys) - self.keys()
        if unknown:
            raise TypeError(f"{type(self).__name__} has no keys {sorted(unknown)}")
        changed = {}
        for name, section in self.SECTIONS.items():
            own = {k: keys.pop(k) for k in _names(section) if k in keys}
            if own:
                changed[name] = dataclasses.replace(getattr(self, name), **own)
        plain = {f.name: getattr(self, f.name) for f in _fields(self)}
        return type(self)(**{**plain, **changed, **keys})


def _fields(config: Any) -> tuple[dataclasses.Field, ...]:
    """A sectioned config's own fields (its subclasses are dataclasses; this base is not)."""
    return dataclasses.fields(config)


def _names(section: type) -> list[str]:
    return [f.name for f in dataclasses.fields(section)]
