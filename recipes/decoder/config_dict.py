"""What every family's config dataclass shares: its dict form (what checkpoints store) and the checks of the shared
fields; torch-free, like the configs."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

ConfigT = TypeVar("ConfigT", bound="ConfigDict")


class ConfigDict:
    """``to_dict`` / ``from_dict`` for a config dataclass: plain fields out, and back in with unknown keys refused
    (so a typo in a YAML file or a checkpoint from another family is not silently dropped)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (what checkpoints store)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[ConfigT], values: Mapping[str, Any]) -> ConfigT:
        """Inverse of ``to_dict``; unknown keys are an error so typos are not silently dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown {cls.__name__} field(s) {unknown}; the fields are {sorted(known)}.")
        return cls(**dict(values))

    def require_positive(self, integers: tuple[str, ...], numbers: tuple[str, ...] = ()) -> None:
        """Raise ``ValueError`` naming the first of the fields ``integers`` that is not a positive integer, or of
        ``numbers`` that is not a positive number (booleans are neither)."""
        for names, kinds, what in ((integers, int, "integer"), (numbers, (int, float), "number")):
            for name in names:
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
                    raise ValueError(f"{type(self).__name__}.{name}={value!r} is invalid: it must be a positive {what}.")

    def require_grouped_heads(self) -> None:
        """Raise ``ValueError`` unless ``n_kv_heads`` divides ``n_heads`` (grouped-query attention)."""
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{type(self).__name__}.n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}: "
                "grouped-query attention shares each key/value head among n_heads // n_kv_heads query heads. "
                f"Pick n_kv_heads among the divisors of {self.n_heads}."
            )
