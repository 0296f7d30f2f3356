"""Heads: the attention geometry of a module, for the projections inside it, and its local head counts.

An entry such as ``"layers.*.attn": Heads(num_heads=9, num_kv_heads=3, attrs={"n_heads": "heads"})``
does two things:

- the column/row styles of the projections *inside* that module read "q" and "kv" blocks against this
  geometry, so q, k, v and o all split on the same head boundaries (see `HeadGroups`);
- the listed attributes, which the module's forward uses to reshape, are set to each device's local
  value: ``heads`` (query heads here), ``kv_heads``, ``groups`` (query heads per KV head), and with
  ``head_dim`` given, ``features`` (heads * head_dim) and ``kv_features``. A dotted path such as
  ``"config.num_attention_heads"`` reaches into an attribute's object: this module gets a `LocalValues`
  view of it (local_values.py) holding its local count, so the config shared by all layers keeps its
  global values everywhere else, and every other field of it stays the shared one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .style import ShardContext, Splits, Style, register
from .local_values import set_local_path

QUANTITIES = ("heads", "kv_heads", "groups", "features", "kv_features")


@register("heads")
@dataclass(frozen=True, kw_only=True)
class Heads(Style):
    """Attention geometry for the projections inside this module; sets its head-count attributes.

    Args:
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention); default: num_heads.
        head_dim: features per head; needed only for the "features"/"kv_features" quantities.
        attrs: attribute path -> local quantity, one of heads, kv_heads, groups, features, kv_features.
    """

    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    attrs: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for path, quantity in self.attrs.items():
            if quantity not in QUANTITIES:
                raise ValueError(f"Heads attrs[{path!r}] = {quantity!r}: use one of {QUANTITIES}")
            if quantity in ("features", "kv_features") and self.head_dim is None:
                raise ValueError(f"Heads attrs[{path!r}] = {quantity!r} needs head_dim=...")

    @property
    def kv(self) -> int:
        return self.num_kv_heads or self.num_heads

    @classmethod
    def _from_json(cls, name, value):
        return value  # attrs stays a dict

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        for path in self.attrs:
            _resolve(module, path, ctx.name)  # fail before anything is changed
        return {}

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        local = ctx.heads.local(ctx.rank)
        if self.head_dim is not None:
            local["features"] = local["heads"] * self.head_dim
            local["kv_features"] = local["kv_heads"] * self.head_dim
        for path, quantity in self.attrs.items():
            # "config.num_attention_heads": the config object is shared by every layer (and device); this
            # module sees it through a view of its own holding the local count (local_values.py).
            set_local_path(module, path, local[quantity])


def _resolve(module: nn.Module, path: str, where: str):
    *parents, attr = path.split(".")
    owner = module
    for part in parents:
        owner = getattr(owner, part, None)
    if owner is None or not hasattr(owner, attr):
        ints = sorted(k for k, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool) and not k.startswith("_"))
        raise ValueError(
            f"{where}: Heads attrs names {path!r}, but {type(module).__name__} has no such attribute. Name the "
            f"attributes its forward reshapes with (its int attributes: {', '.join(ints) or 'none'})."
        )
    return owner, attr
