"""Union-find over the output features of candidate column layers, the bookkeeping of plan inference.

Every output feature of a layer that might be split by output features (a *column* candidate) gets an
integer id. While the model runs on a tiny input (see trace.py), every operation that combines features
which must end up on the same device *unions* them: a reduction over head_dim unions the features of one
head, ``gate * up`` unions gate feature i with up feature i. At the end each class of features is one
indivisible *unit* (one MLP feature and its partner, one attention head), and a plan may split a layer only
on unit boundaries.

Grouped-query attention is not a union: query head h *needs* key/value head h // group, which may be
replicated on several devices. Such relations are kept as `needs` edges (needer id -> needed id).

Everything is vectorised with torch: ids are int64 tensors, and -1 marks an element that derives from no
split feature (a replicated value), which every operation here ignores.
"""

from __future__ import annotations

import torch

Ids = torch.Tensor  # int64, any shape; -1 = not a split feature


class FeatureSet:
    """A growable union-find over feature ids, plus the `needs` edges between them."""

    def __init__(self) -> None:
        self.parent = torch.empty(1024, dtype=torch.long)
        self.kv_side = torch.zeros(1024, dtype=torch.bool)  # read as keys/values (right of q @ k.T, p @ v)
        self.size = 0
        self._version = 0  # bumped by every union that merges classes
        self._needs: list[Ids] = []
        self._needs_cache = None
        # Who joined what, for naming the op when a given plan's split cuts a unit (plan_inference/plancheck.py): off
        # (None) unless asked for; the tracer sets `op` before each rule.
        self.log: list[tuple[str, Ids, Ids]] | None = None
        self.op = ""

    def new(self, count: int) -> Ids:
        """`count` fresh ids, each its own class."""
        start, stop = self.size, self.size + count
        if stop > self.parent.numel():
            grown = torch.empty(max(stop, 2 * self.parent.numel()), dtype=torch.long)
            grown[: self.size] = self.parent[: self.size]
            self.parent = grown
            flags = torch.zeros(grown.numel(), dtype=torch.bool)
            flags[: self.size] = self.kv_side[: self.size]
            self.kv_side = flags
        self.parent[start:stop] = torch.arange(start, stop)
        self.size = stop
        return torch.arange(start, stop)

    def find(self, ids: Ids) -> Ids:
        """The class (root id) of every id; -1 stays -1. Compresses the paths it walks."""
        small = compact(ids)
        if small.numel() < ids.numel():
            return self.find(small).expand(ids.shape)
        flat = ids.reshape(-1)
        keep = flat >= 0
        if bool(keep.all()):
            x = flat
        else:
            x = flat[keep]
        roots = x
        while True:
            up = self.parent[roots]
            if torch.equal(up, roots):
                break
            roots = up
        if x.numel():
            self.parent[x] = roots
        if x is flat:
            return roots.view(ids.shape)
        out = flat.clone()
        out[keep] = roots
        return out.view(ids.shape)

    def union(self, a: Ids, b: Ids) -> bool:
        """Join the classes of a[i] and b[i] for every i (same shape; pairs with a -1 are skipped).

        Returns True when some classes were actually merged."""
        a, b = a.reshape(-1), b.reshape(-1)
        both = (a >= 0) & (b >= 0)
        if not bool(both.all()):
            a, b = a[both], b[both]
        merged = False
        while a.numel():
            ra, rb = self.find(a), self.find(b)
            differ = ra != rb
            if not bool(differ.any()):
                break
            merged = True
            self._version += 1
            ra, rb = ra[differ], rb[differ]
            if self.log is not None:
                self.log.append((self.op, ra.clone(), rb.clone()))
            # Link each larger root to the smallest root it meets; repeat until every pair agrees.
            self.parent.scatter_reduce_(0, torch.maximum(ra, rb), torch.minimum(ra, rb), reduce="amin")
            a, b = a[differ], b[differ]
        return merged

    def union_along(self, ids: Ids, dim: int) -> bool:
        """Join every id with the others along `dim` (a reduction or a mix over that dimension)."""
        if ids.dim() == 0 or ids.shape[dim] <= 1:
            return False
        dim = dim % ids.dim()
        ids = compact(ids, keep=dim)
        first = ids.narrow(dim, 0, 1).expand_as(ids)
        return self.union(first, ids)

    def distinct(self, ids: Ids) -> Ids:
        """The distinct ids (>= 0), sorted; linear time, no sort."""
        flat = compact(ids).reshape(-1)
        mask = torch.zeros(self.size, dtype=torch.bool)
        mask[flat[flat >= 0]] = True
        return mask.nonzero().squeeze(1)

    def classes(self, ids: Ids) -> Ids:
        """The distinct classes (roots) of `ids`."""
        return self.distinct(self.find(compact(ids)))

    def relation(self, a: Ids, b: Ids) -> str:
        """How paired ids a[i], b[i] (all >= 0) relate: 'bijection' (union them), 'a_shared' (each a meets
        several b's, each b one a: b needs a; a repeated key/value head), 'b_shared', or 'many'."""
        a, b = a.reshape(-1), b.reshape(-1)
        partner = torch.full((self.size,), -1, dtype=torch.long)
        partner[a] = b
        a_once = torch.equal(partner[a], b)  # every a meets a single b
        partner.fill_(-1)
        partner[b] = a
        b_once = torch.equal(partner[b], a)
        if a_once and b_once:
            return "bijection"
        if b_once:
            return "a_shared"
        if a_once:
            return "b_shared"
        return "many"

    def mark_kv(self, ids: Ids) -> None:
        """Remember that these features are read on the key/value side of an attention product."""
        ids = ids.reshape(-1)
        self.kv_side[ids[ids >= 0]] = True

    # -- needs ---------------------------------------------------------------------------------------

    def add_needs(self, needer: Ids, needed: Ids) -> None:
        """needer[i] must be on a device that holds needed[i] (which may be replicated)."""
        needer, needed = compact_pair(needer, needed)
        needer, needed = needer.reshape(-1), needed.reshape(-1)
        keep = (needer >= 0) & (needed >= 0)
        if bool(keep.any()):
            pairs = torch.unique(needer[keep] * self._stride + needed[keep])  # 1-d: fast, and deduplicated
            self._needs.append(pairs)
            self._needs_cache = None

    _stride = 1 << 31  # pairs are encoded as needer * 2**31 + needed (ids stay far below 2**31)

    def needs(self) -> tuple[Ids, Ids]:
        """All needs edges as (needer roots, needed roots), deduplicated, self-edges dropped."""
        if self._needs_cache is not None and self._needs_cache[0] == self._version:
            return self._needs_cache[1]
        if not self._needs:
            empty = torch.empty(0, dtype=torch.long)
            return empty, empty
        pairs = torch.unique(torch.cat(self._needs))
        self._needs = [pairs]
        a, b = self.find(pairs // self._stride), self.find(pairs % self._stride)
        pairs = torch.unique(a * self._stride + b)
        a, b = pairs // self._stride, pairs % self._stride
        keep = a != b
        self._needs_cache = (self._version, (a[keep], b[keep]))
        return a[keep], b[keep]

    def merge_co_needed(self) -> None:
        """Everything one class needs must sit together: union the classes needed by the same needer."""
        for _ in range(8):
            needer, needed = self.needs()
            if not needer.numel():
                return
            order = torch.argsort(needer, stable=True)
            needer, needed = needer[order], needed[order]
            first = torch.ones_like(needer, dtype=torch.bool)
            first[1:] = needer[1:] != needer[:-1]
            leader = needed[first][torch.cumsum(first.long(), 0) - 1]
            if not self.union(leader, needed):
                return


def compact(x: Ids, keep: int | None = None) -> Ids:
    """`x` without redundancy: every dim along which it is constant (batch, sequence) narrowed to size 1."""
    for d in range(x.dim()):
        if d != keep and x.shape[d] > 1 and (x.stride(d) == 0 or bool((x == x.narrow(d, 0, 1)).all())):
            x = x.narrow(d, 0, 1)
    return x


def compact_pair(a: Ids, b: Ids) -> tuple[Ids, Ids]:
    """`compact` for two shadows of one shape, narrowing only dims along which both are constant."""
    for d in range(a.dim()):
        if a.shape[d] > 1:
            same_a = a.stride(d) == 0 or bool((a == a.narrow(d, 0, 1)).all())
            if same_a and (b.stride(d) == 0 or bool((b == b.narrow(d, 0, 1)).all())):
                a, b = a.narrow(d, 0, 1), b.narrow(d, 0, 1)
    return a, b
