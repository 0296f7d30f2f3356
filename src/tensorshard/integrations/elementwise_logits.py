"""Whether a causal LM's forward treats its logits elementwise after the output head: the gate of the sliced loss.

    reason = why_not_elementwise(lm, "lm_head")   # None: every op on the logits acts on each vocabulary entry alone

causal_lm_loss.py leaves the head's output split over the vocabulary (each rank a contiguous slice) and
computes the loss from the slices. That is exact only if the forward, from ``logits = self.lm_head(...)`` on,
does to the logits nothing that depends on a vocabulary index or on the whole vocabulary: softcapping
(``logits / c``, ``torch.tanh``, ``* c``), ``logits * self.logit_scale``, ``.float()`` are fine on a slice;
``logits[..., token] = -inf``, ``logits[..., :text_vocab]``, ``masked_fill`` over some ids or a softmax over the
vocabulary would give a wrong loss on a slice, silently.

The check reads the forward's source (``inspect.getsource`` of the unwrapped class forward: decorators made
with ``functools.wraps`` are looked through, an inherited forward is read where it is defined) and accepts only
if

1. the head is called exactly once, outside any loop or ``try``, as ``NAME = self.<head>(...)`` or an
   elementwise expression of it (``self.lm_head(h).float()``, ``self.lm_head(h) * self.config.logits_scaling``);
2. the loss is ``self.loss_function(...)``, called exactly once, with the logits argument an accepted
   expression of NAME;
3. every other statement after the head call that mentions NAME is ``NAME = e``, ``NAME op= s``, or a
   ``return`` handing NAME on as it is (``logits=NAME``, a tuple element), where ``e`` is built from NAME,
   numbers and scalar attributes (``self.config.final_logit_softcapping``, ``self.logit_scale``) by + - * / **,
   unary minus, ``torch.tanh`` / ``sigmoid`` / ``exp`` / ``abs``, and ``.float()`` / ``.to(...)``-style
   casts, and ``s`` likewise without NAME;
4. on the instance, every scalar attribute is a number, None (a guarded branch) or a one-element tensor.

Anything else (a subscript, a mask, a helper method, a loop, source that cannot be read) is a reason, and the
model keeps its own path: the logits gathered in the forward and its own loss on them. The source analysis is
cached per (class, head); step 4 is per instance.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from torch import nn

ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)
FUNCTIONS = {"tanh", "sigmoid", "exp", "abs"}  # torch.<f>(x), torch.nn.functional.<f>(x), F.<f>(x)
METHODS = {"float", "half", "bfloat16", "double", "to", "type_as", "contiguous", "clone",  # same values
           "tanh", "sigmoid", "exp", "abs", "mul", "div", "add", "sub", "mul_", "div_", "add_", "sub_", "tanh_"}
FUNCTION_MODULES = {"torch", "F", "torch.nn.functional", "nn.functional", "functional"}
GETTERS = {"get_text_config", "get_decoder"}  # zero-argument calls read along a scalar's path from self


def why_not_elementwise(lm: nn.Module, head: str) -> str | None:
    """None if `lm`'s forward provably treats the output of ``self.<head>`` (a dotted path from `lm`)
    elementwise up to its loss; otherwise the reason, for a debug log. The class part (`classify`, steps 1-3,
    cached per class) first, then step 4 on the instance."""
    reason = classify(type(lm), head)
    if reason is not None:
        return reason
    for text, steps in _analyse(type(lm), head)[1]:
        try:
            value = lm
            for kind, attr in steps:
                if kind == "getattr":  # getattr(x, "name", default): a constant default
                    value = getattr(value, attr, None)
                else:
                    value = getattr(value, attr)() if kind == "call" else getattr(value, attr)
        except Exception as e:  # noqa: BLE001 - any failure to read it: not provably a scalar
            return f"{text} cannot be read on the instance ({type(e).__name__})"
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            continue
        return f"{text} (a {type(value).__name__}) is not a scalar: it may differ across the vocabulary"
    return None


def classify(cls: type, head: str = "lm_head") -> str | None:
    """The class part of the check (steps 1-3), from the source alone, no instance: None, or why not.
    `why_not_elementwise` asks it first; the audit of transformers' classes asks it alone."""
    return _analyse(cls, head)[0]


Steps = tuple[tuple[str, str], ...]  # ("attr", "config"), ("call", "get_text_config"), ("getattr", "x"): from self


@functools.lru_cache(maxsize=None)
def _analyse(cls: type, head: str) -> tuple[str | None, tuple[tuple[str, Steps], ...]]:
    """(reason or None, the scalars to read on the instance: (source text, steps from self))."""
    try:
        fn = inspect.unwrap(cls.forward)
        lines, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
        ast.increment_lineno(tree, first - 1)  # reasons name the file's line numbers
    except (OSError, TypeError, SyntaxError) as e:
        return f"the source of {cls.__name__}.forward cannot be read ({type(e).__name__})", ()
    func = tree.body[0]
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{cls.__name__}.forward is not a plain function", ()
    return _Forward(func, f"{cls.__qualname__}.forward ({inspect.getsourcefile(fn)})", head).check()


class _Forward:
    """One parsed forward: the head call, the name its output goes to, and the statements after it."""

    def __init__(self, func: ast.FunctionDef, where: str, head: str) -> None:
        self.func, self.where, self.head = func, where, head
        self.parents = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
        self.scalars: list[tuple[str, Steps]] = []
        self.names: set[str] = set()  # the logits, and names holding them untouched (an output, a tuple)
        self.head_call: ast.Call | None = None
        # local names bound only to attribute chains from self (cap = self.config.logits_soft_cap)
        self.locals: dict[str, list[ast.expr | None]] = {}
        arguments = func.args
        for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]:
            if arg is not None:
                self.locals[arg.arg] = [None]  # a parameter: the caller's value, not a chain from self
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
                for t in targets:
                    self.locals.setdefault(t, []).append(node.value if len(node.targets) == 1 else None)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and isinstance(node.target, ast.Name):
                self.locals.setdefault(node.target.id, []).append(getattr(node, "value", None)
                                                                  if not isinstance(node, ast.AugAssign) else None)
            elif isinstance(node, (ast.For, ast.comprehension, ast.With)):
                for n in ast.walk(node.target if not isinstance(node, ast.With) else node):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        self.locals.setdefault(n.id, []).append(None)

    def check(self) -> tuple[str | None, tuple[tuple[str, Steps], ...]]:
        where, head = self.where, self.head
        calls = [n for n in ast.walk(self.func) if isinstance(n, ast.Call)]
        head_calls = [c for c in calls if _chain(c.func) == f"self.{head}"]
        if len(head_calls) != 1:
            return f"{where} calls self.{head} {len(head_calls)} times, not once", ()
        self.head_call = head_calls[0]
        stmt = self._statement(self.head_call)
        if _inside(stmt, self.parents, (ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.FunctionDef, ast.Lambda)):
            return f"{where}: self.{head} is called inside a loop, try, with or nested function", ()
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and self._elementwise(stmt.value)):
            return f"{where} line {stmt.lineno}: the output of self.{head} is not assigned, elementwise, to one name", ()
        self.names.add(stmt.targets[0].id)
        nested = [n for n in ast.walk(self.func) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                  and n is not self.func]
        if any(self._mentions(n) for n in nested):  # a closure could edit them wherever it is called
            return f"{where}: a nested function or lambda reads the logits", ()

        loss_calls = [c for c in calls if _chain(c.func) == "self.loss_function"]
        if len(loss_calls) != 1:
            return f"{where} calls self.loss_function {len(loss_calls)} times, not once", ()
        loss = loss_calls[0]
        arg = next((k.value for k in loss.keywords if k.arg == "logits"), loss.args[0] if loss.args else None)
        if arg is None or not self._mentions(arg) or not self._elementwise(arg):
            return f"{where}: the logits passed to self.loss_function are not an elementwise form of the head's output", ()

        later = sorted((n for n in ast.walk(self.func) if isinstance(n, ast.stmt) and n is not stmt
                        and n is not self.func and n.lineno >= stmt.lineno), key=lambda n: (n.lineno, n.col_offset))
        for node in later:
            if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith)):
                if any(self._mentions(h) for h in _header(node)):  # the body's statements come on their own
                    return f"{where} line {node.lineno}: a condition or loop reads the logits", ()
                continue
            if not self._mentions(node):
                continue
            if _within(loss, node):
                others = [a for a in [*loss.args, *(k.value for k in loss.keywords)] if a is not arg]
                assigned = isinstance(node, ast.Assign) and not any(self._mentions(t) for t in node.targets)
                if not ((assigned or isinstance(node, ast.Return)) and node.value is loss
                        and not any(self._mentions(a) for a in others)):
                    return f"{where} line {node.lineno}: the logits are used around the loss call", ()
                continue
            if not self._accepted(node):
                return f"{where} line {node.lineno}: `{ast.unparse(node).splitlines()[0]}` is not a recognised elementwise step", ()
        return None, tuple(dict.fromkeys(self.scalars))

    def _accepted(self, node: ast.stmt) -> bool:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if self._elementwise(node.value) and self._mentions(node.value):
                return target in self.names  # logits = logits / cap
            if self._handed_on(node.value):
                self.names.add(target)  # output = (logits,) + rest: the logits untouched, in another holder
                return True
            return False
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id in self.names:
            return isinstance(node.op, ARITHMETIC) and not self._mentions(node.value) and self._elementwise(node.value)
        if isinstance(node, ast.Return) and node.value is not None:
            return self._handed_on(node.value)
        return False

    def _handed_on(self, e: ast.expr) -> bool:
        """`e` passes the logits along untouched: ``Output(logits=logits, ...)``, ``(loss, logits) + rest``."""
        if isinstance(e, ast.Name):
            return True
        if isinstance(e, ast.Call):  # an output class (CapWords) or dict, not a function that might edit them
            callee = _chain(e.func)
            return (callee is not None and (callee == "dict" or callee.rsplit(".", 1)[-1][:1].isupper())
                    and not self._mentions(e.func) and not any(self._mentions(a) for a in e.args)
                    and all(not self._mentions(k.value) or (k.arg is not None and isinstance(k.value, ast.Name))
                            for k in e.keywords))
        if isinstance(e, ast.Tuple):
            return all(isinstance(x, ast.Name) or not self._mentions(x) for x in e.elts)
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
            return self._handed_on(e.left) and self._handed_on(e.right)
        if isinstance(e, ast.IfExp):
            return not self._mentions(e.test) and self._handed_on(e.body) and self._handed_on(e.orelse)
        return not self._mentions(e)

    def _elementwise(self, e: ast.expr) -> bool:
        """`e` is the logits, the head call, a number or a scalar from self, combined elementwise."""
        if e is self.head_call:
            return True
        if isinstance(e, ast.Name) and e.id in self.names:
            return True
        if isinstance(e, ast.Constant):
            return isinstance(e.value, (int, float)) and not isinstance(e.value, bool)
        if isinstance(e, ast.BinOp):
            return isinstance(e.op, ARITHMETIC) and self._elementwise(e.left) and self._elementwise(e.right)
        if isinstance(e, ast.UnaryOp):
            return isinstance(e.op, (ast.USub, ast.UAdd)) and self._elementwise(e.operand)
        if isinstance(e, ast.NamedExpr):
            return self._elementwise(e.value)
        steps = self._steps(e)
        if steps:
            self.scalars.append((ast.unparse(e), steps))
            return True
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
            func, owner = e.func.attr, e.func.value
            if _chain(owner) in FUNCTION_MODULES and func in FUNCTIONS:
                return len(e.args) == 1 and not e.keywords and self._elementwise(e.args[0])
            if func in METHODS and self._carries_logits(owner) and self._elementwise(owner):
                args = [*e.args, *(k.value for k in e.keywords)]
                if func in {"to", "type_as"}:  # a dtype or device, not data from the logits
                    return not any(self._mentions(a) for a in args)
                return all(not self._mentions(a) and self._elementwise(a) for a in args)
        return False

    def _steps(self, e: ast.expr, depth: int = 0) -> Steps | None:
        """Attribute reads and zero-argument getter calls from self (``self.get_decoder().config.x``), through
        local names bound only to such chains; None for anything else."""
        if isinstance(e, ast.Name):
            if e.id == "self":
                return ()
            values = self.locals.get(e.id)
            if depth > 3 or not values or len(values) != 1 or values[0] is None:
                return None
            return self._steps(values[0], depth + 1)
        if isinstance(e, ast.NamedExpr):
            return self._steps(e.value, depth)
        if isinstance(e, ast.Attribute):
            base = self._steps(e.value, depth)
            return None if base is None else (*base, ("attr", e.attr))
        if (isinstance(e, ast.Call) and _chain(e.func) == "getattr" and len(e.args) in (2, 3) and not e.keywords
                and isinstance(e.args[1], ast.Constant) and isinstance(e.args[1].value, str)
                and (len(e.args) == 2 or isinstance(e.args[2], ast.Constant))):  # getattr(config, "x", None)
            base = self._steps(e.args[0], depth)
            return None if base is None else (*base, ("getattr", e.args[1].value))
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and not e.args and not e.keywords \
                and e.func.attr in GETTERS:
            base = self._steps(e.func.value, depth)
            return None if base is None else (*base, ("call", e.func.attr))
        return None

    def _carries_logits(self, e: ast.expr) -> bool:
        return e is self.head_call or self._mentions(e)

    def _mentions(self, node: ast.AST) -> bool:
        return any((isinstance(n, ast.Name) and n.id in self.names) or n is self.head_call for n in ast.walk(node))

    def _statement(self, node: ast.AST) -> ast.stmt:
        while not isinstance(node, ast.stmt):
            node = self.parents[node]
        return node


def _chain(e: ast.expr) -> str | None:
    """``a.b.c`` for a plain chain of names and attributes, else None."""
    parts = []
    while isinstance(e, ast.Attribute):
        parts.append(e.attr)
        e = e.value
    if not isinstance(e, ast.Name):
        return None
    return ".".join([e.id, *reversed(parts)])


def _header(node: ast.stmt) -> list[ast.AST]:
    """What a compound statement evaluates itself: an if's or while's test, a for's target and iterable, ..."""
    if isinstance(node, (ast.If, ast.While)):
        return [node.test]
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return [node.target, node.iter]
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return list(node.items)
    return []  # try: its handlers' types are expressions too, but read no logits in any model seen


def _within(node: ast.AST, outer: ast.AST) -> bool:
    return any(n is node for n in ast.walk(outer))


def _inside(node: ast.AST, parents: dict, kinds: tuple) -> bool:
    """Some enclosing node of `node`, below the forward itself (the root, which has no parent), is of `kinds`."""
    node = parents.get(node)
    while node is not None and node in parents:
        if isinstance(node, kinds):
            return True
        node = parents[node]
    return False
