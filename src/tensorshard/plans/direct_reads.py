"""Modules whose forward reads a submodule's weights without calling the submodule.

A style changes how its module computes by replacing the module's forward (a column-parallel Linear
computes its slice of the outputs, a row-parallel one all-reduces). A parent that reads the child's
weight itself, ``F.linear(x, self.fc.weight)``, bypasses that forward and computes with the local slice
as if it were the whole weight: the numbers are wrong, often without an error. PyTorch's own layers do
this: ``nn.MultiheadAttention`` always passes ``self.out_proj.weight`` to its functional kernel, and
``nn.TransformerEncoderLayer`` in eval under ``no_grad`` reads ``self.linear1.weight``,
``self.self_attn.in_proj_weight``, ... into one fused kernel.

`direct_reads(model)` finds every such read by reading the source of each module's ``forward`` (and of
the methods it calls on ``self``): an expression ``self.a.b.weight`` naming a parameter or buffer of a
descendant, used for its values. Uses that only look at metadata (``.dtype``, ``.shape``, ``is None``,
``isinstance(...)``) do not count, nor reads under an ``if`` that the module's own plain attributes
decide against (Bloom's ``if self.pretraining_tp > 1 and self.slow_but_exact``; ``self.training`` is never
taken as decided: the mode changes after splitting). `shard_plan` refuses a plan that splits a tensor read
this way, and plan inference leaves such layers whole. A module whose source cannot be read (a compiled
extension, code run with ``exec``) is not checked.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from torch import nn

# Attributes of a tensor that describe it without reading its values.
_METADATA = {
    "dtype", "shape", "device", "size", "dim", "ndim", "is_cuda", "is_meta", "is_floating_point", "numel",
    "requires_grad", "layout", "is_sparse", "is_quantized", "element_size", "nbytes", "itemsize", "names",
    "data_ptr", "stride", "is_contiguous", "__class__", "grad_fn",
}
_METADATA_CALLS = {"isinstance", "hasattr", "getattr", "type", "id", "len", "callable"}


def direct_reads(model: nn.Module) -> dict[str, list[str]]:
    """``{reader module name: [names of descendant tensors it reads directly], ...}``, names relative to
    `model` (``"layers.0": ["layers.0.linear1.weight", ...]``); readers with none are left out."""
    out: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        found = []
        for chain, metadata_use, guards in _chains(type(module)):
            read = None if _dead(module, guards) else _tensor_read(module, chain, metadata_use)
            if read is not None:
                found.append(".".join(p for p in (name, read) if p))
        if found:
            out[name] = sorted(set(found))
    return out


def _tensor_read(module: nn.Module, chain: tuple[str, ...], metadata_use: bool) -> str | None:
    """The descendant tensor ``self.a.b.weight[...]`` reads for its values ("a.b.weight"), if any."""
    for k in range(1, len(chain)):
        try:
            child = module.get_submodule(".".join(chain[:k]))
        except AttributeError:
            return None
        tensor, rest = chain[k], chain[k + 1 :]
        if tensor in child._parameters or tensor in child._buffers:
            only_metadata = rest[0] in _METADATA if rest else metadata_use
            return None if only_metadata else ".".join(chain[: k + 1])
    return None


@functools.lru_cache(maxsize=None)
def _chains(cls: type) -> tuple[tuple[tuple[str, ...], bool, tuple], ...]:
    """Attribute chains ``self.a.b.c`` (as ``("a", "b", "c")``, 2+ parts, the longest written) in `cls`'s
    forward and the methods of `cls` it calls on ``self``, each with whether its use only reads metadata
    and the ``if`` conditions it sits under, as ``((test expression, branch taken), ...)``."""
    chains: dict[tuple, None] = {}
    todo, seen = ["forward"], set()
    while todo:
        method = todo.pop()
        if method in seen:
            continue
        seen.add(method)
        tree = _source_tree(cls, method)
        if tree is None:
            continue
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node, guards in _guarded_nodes(tree, ()):
            chain = _self_chain(node)
            if chain is None:
                continue
            parent = parents.get(node)
            if len(chain) == 1:
                if isinstance(parent, ast.Call) and parent.func is node:
                    todo.append(chain[0])  # self.helper(...): read that method too
                continue
            if isinstance(parent, ast.Attribute) and _self_chain(parent) is not None:
                continue  # part of a longer chain, seen on its own
            chains[(chain, _metadata_only(node, parent), guards)] = None
    return tuple(chains)


def _guarded_nodes(node: ast.AST, guards: tuple):
    """Every node under `node`, with the ``if`` tests (and which branch) that lead to it."""
    yield node, guards
    if isinstance(node, (ast.If, ast.IfExp)):
        yield from _guarded_nodes(node.test, guards)
        body = node.body if isinstance(node.body, list) else [node.body]
        orelse = node.orelse if isinstance(node.orelse, list) else [node.orelse]
        for child in body:
            yield from _guarded_nodes(child, guards + ((node.test, True),))
        for child in orelse:
            yield from _guarded_nodes(child, guards + ((node.test, False),))
        return
    for child in ast.iter_child_nodes(node):
        yield from _guarded_nodes(child, guards)


def _dead(module: nn.Module, guards: tuple) -> bool:
    """True when one of the ``if`` tests, computed from the module's plain attributes alone (Bloom's
    ``self.pretraining_tp > 1 and self.slow_but_exact``), sends this module the other way."""
    for test, branch in guards:
        value = _value(test, module)
        if value is not _UNKNOWN and bool(value) != branch:
            return True
    return False


_UNKNOWN = object()
_PLAIN = (bool, int, float, str, type(None))


def _value(expr: ast.AST, module: nn.Module):
    """The value of `expr` when it only combines constants and plain attributes of `module`, else _UNKNOWN."""
    if isinstance(expr, ast.Constant):
        return expr.value
    chain = _self_chain(expr)
    if chain is not None:
        if "training" in chain:
            return _UNKNOWN  # the mode changes after splitting (an eval-only fast path must still count)
        value = module
        for part in chain:
            value = getattr(value, part, _UNKNOWN)
            if value is _UNKNOWN:
                return _UNKNOWN
        return value if isinstance(value, _PLAIN) else _UNKNOWN
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        value = _value(expr.operand, module)
        return _UNKNOWN if value is _UNKNOWN else not value
    if isinstance(expr, ast.BoolOp):
        values = [_value(v, module) for v in expr.values]
        if isinstance(expr.op, ast.And) and any(v is not _UNKNOWN and not v for v in values):
            return False
        if isinstance(expr.op, ast.Or) and any(v is not _UNKNOWN and v for v in values):
            return True
        return _UNKNOWN if any(v is _UNKNOWN for v in values) else values[-1]
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
        left, right = _value(expr.left, module), _value(expr.comparators[0], module)
        if left is _UNKNOWN or right is _UNKNOWN:
            return _UNKNOWN
        compare = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Gt: lambda a, b: a > b,
                   ast.GtE: lambda a, b: a >= b, ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
                   ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b}.get(type(expr.ops[0]))
        try:
            return _UNKNOWN if compare is None else compare(left, right)
        except TypeError:
            return _UNKNOWN
    return _UNKNOWN


def _source_tree(cls: type, method: str) -> ast.AST | None:
    fn = getattr(cls, method, None)
    fn = getattr(fn, "__func__", fn)
    owner = getattr(fn, "__qualname__", "").split(".")[0]
    if not inspect.isfunction(fn) or owner in ("Module", "Sequential", "ModuleList", "ModuleDict"):
        return None  # nn.Module's own machinery, or not Python
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except Exception:  # no source (a compiled extension), or code exec'd under another file's name
        return None


def _self_chain(node: ast.AST) -> tuple[str, ...] | None:
    """``self.a.b`` -> ("a", "b"); anything not rooted at ``self`` -> None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return tuple(reversed(parts))
    return None


def _metadata_only(node: ast.AST, parent: ast.AST | None) -> bool:
    if isinstance(parent, ast.Attribute):
        return parent.attr in _METADATA  # self.fc.weight.dtype
    if isinstance(parent, ast.Call) and node in parent.args:
        return isinstance(parent.func, ast.Name) and parent.func.id in _METADATA_CALLS  # isinstance(self.fc.weight, T)
    if isinstance(parent, ast.Compare):
        return all(isinstance(op, (ast.Is, ast.IsNot)) for op in parent.ops)  # self.fc.bias is None
    return False
