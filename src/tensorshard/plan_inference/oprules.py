"""How each torch operation moves split features around: the transfer rules of plan inference.

Every torch function and tensor method the traced model calls on a tensor with a shadow (shadows.py)
goes through `Rules.apply`, which looks its name up here:

- shape and indexing ops move ids with the data; element-wise ops pair them; reductions, softmax,
  norms, matmuls, einsum and scaled_dot_product_attention union what they mix;
- metadata reads (``.shape``, ``.dtype``) are ignored; values read on the host (``.item()``, ``bool``)
  and any op without a rule *poison* the features: the layers they come from stay whole.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .features import Ids
from .shadows import Call, Shadows, Unfollowable, _arg, _as_dims, _broadcast, _strides, tensors_of, varying_dims


class Rules(Shadows):
    """Dispatch: the rule for each op name, applied to one call."""

    def apply(self, call: Call) -> None:
        name = call.name
        call.inplace = name.endswith("_") and not name.endswith("__") or name in _INPLACE_DUNDER
        base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
        call.name = base = _DUNDER.get(base, base)
        rule = _TABLE.get(base)
        if rule is None:
            self._poison_inputs(call, f"{name} has no inference rule")
            return
        try:
            result = rule(self, call)
        except Unfollowable as p:
            self._poison_inputs(call, str(p))
            return
        except Exception as e:  # a rule that cannot follow this call: keep the features whole, never guess
            self._poison_inputs(call, f"{name} could not be followed ({type(e).__name__}: {e})")
            return
        if result is None:
            return
        target = call.args[0] if call.inplace and call.args and isinstance(call.args[0], torch.Tensor) else call.out
        self._assign(call, target, result)


_DUNDER = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add", "__sub__": "sub", "__rsub__": "sub", "__isub__": "sub",
    "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul", "__truediv__": "div", "__rtruediv__": "div",
    "__div__": "div", "__rdiv__": "div", "__itruediv__": "div", "__floordiv__": "div", "__rfloordiv__": "div",
    "__mod__": "remainder", "__rmod__": "remainder", "__pow__": "pow", "__rpow__": "pow", "__ipow__": "pow",
    "__neg__": "neg", "__pos__": "neg", "__abs__": "abs", "__matmul__": "matmul", "__rmatmul__": "matmul",
    "__and__": "add", "__rand__": "add", "__or__": "add", "__ror__": "add", "__xor__": "add", "__invert__": "neg",
    "__eq__": "eq", "__ne__": "eq", "__lt__": "eq", "__le__": "eq", "__gt__": "eq", "__ge__": "eq",
    "__lshift__": "add", "__rshift__": "add", "__iand__": "add", "__ior__": "add",
}

_INPLACE_DUNDER = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__iand__", "__ior__"}

ELEMENTWISE = """
add sub subtract rsub mul multiply div divide true_divide floor_divide remainder fmod pow float_power neg negative
positive abs absolute exp exp2 expm1 log log1p log2 log10 sqrt rsqrt sin cos tan tanh sinh cosh asin acos atan
arcsin arccos arctan atan2 arctan2 asinh acosh atanh sigmoid logsigmoid relu relu6 leaky_relu gelu silu mish elu
selu celu softplus softsign hardtanh hardswish hardsigmoid hardshrink softshrink tanhshrink threshold rrelu
prelu clamp clip clamp_min clamp_max minimum maximum fmax fmin where masked_fill lerp addcmul addcdiv sign sgn
signbit floor ceil round trunc fix frac reciprocal square erf erfc erfinv logit xlogy logical_and logical_or
logical_xor logical_not bitwise_and bitwise_or bitwise_xor bitwise_not eq ne lt le gt ge greater less
greater_equal less_equal not_equal dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d
copysign hypot sinc deg2rad rad2deg conj conj_physical resolve_conj resolve_neg angle i0 digamma lgamma
heaviside nextafter ldexp logaddexp logaddexp2 isnan isinf isfinite isneginf isposinf nan_to_num isclose
""".split()

IDENTITY = """
to float half double bfloat16 int long short bool byte char type type_as cpu cuda contiguous clone detach
requires_grad_ retain_grad pin_memory to_dense data real imag _to_copy xpu mps
""".split()

STRUCTURAL = """
view reshape flatten unflatten transpose swapaxes swapdims permute movedim moveaxis squeeze unsqueeze expand
broadcast_to repeat repeat_interleave tile narrow select __getitem__ split split_with_sizes chunk unbind
tensor_split hsplit vsplit dsplit roll flip fliplr flipud t T mT H mH index_select gather take_along_dim
diagonal unfold rot90 atleast_1d atleast_2d atleast_3d ravel narrow_copy diag_embed take
""".split()

# op -> positions of data arguments (the rest are indices): scatter-like ops write data into data
SCATTERS = {
    "index_put": (0, 2), "scatter": (0, 3), "masked_scatter": (0, 2), "index_copy": (0, 3),
    "index_fill": (0,), "select_scatter": (0, 1), "slice_scatter": (0, 1), "diagonal_scatter": (0, 1),
}

LISTS = "cat concat concatenate stack hstack vstack dstack column_stack row_stack".split()

NO_TRACK = """
size dim shape dtype device numel nelement element_size stride storage_offset is_contiguous is_floating_point
is_complex requires_grad grad_fn is_leaf ndim ndimension __len__ data_ptr untyped_storage get_device is_cuda
is_meta layout names __hash__ __format__ __repr__ __str__ __reduce_ex__ __deepcopy__ __setstate__ register_hook
is_sparse is_quantized is_nested is_inference __get__ __contains__ _version grad output_nr is_set_to
is_same_size is_signed is_pinned _is_view _base __dlpack__ __dlpack_device__ dim_order itemsize nbytes
is_mkldnn is_xpu is_mps is_cpu __iter__ __reversed__ __array_wrap__ storage __sizeof__ _typed_storage
""".split()

FACTORY_LIKE = """
zeros_like ones_like empty_like full_like rand_like randn_like randint_like new_zeros new_ones new_empty
new_full new_tensor zero fill normal uniform bernoulli random exponential geometric cauchy log_normal
""".split()

HOST_READS = """
item tolist __bool__ __int__ __float__ __index__ __complex__ numpy equal allclose __array__ argwhere bincount
histc nonzero unique unique_consecutive masked_select
""".split()

# name -> (position of the dim argument, default when absent, keeps the input shape)
REDUCTIONS = {
    "sum": (1, None, False), "nansum": (1, None, False), "mean": (1, None, False), "nanmean": (1, None, False),
    "prod": (1, None, False), "amax": (1, None, False), "amin": (1, None, False), "aminmax": (1, None, False),
    "argmax": (1, None, False), "argmin": (1, None, False), "all": (1, None, False), "any": (1, None, False),
    "std": (1, None, False), "var": (1, None, False), "std_mean": (1, None, False), "var_mean": (1, None, False),
    "norm": (2, None, False), "vector_norm": (2, None, False), "logsumexp": (1, None, False),
    "count_nonzero": (1, None, False), "median": (1, None, False), "nanmedian": (1, None, False),
    "mode": (1, -1, False), "topk": (2, -1, False), "kthvalue": (2, -1, False), "max": (1, None, False),
    "min": (1, None, False), "diff": (2, -1, False),
    "sort": (1, -1, True), "argsort": (1, -1, True), "msort": (1, 0, True), "cumsum": (1, None, True),
    "cumprod": (1, None, True), "cummax": (1, None, True), "cummin": (1, None, True),
    "logcumsumexp": (1, None, True), "softmax": (1, None, True), "log_softmax": (1, None, True),
    "softmin": (1, None, True), "_softmax": (1, None, True), "normalize": (2, 1, True), "renorm": (2, None, True),
    "gumbel_softmax": (4, -1, True),
}

SPATIAL = """
avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d adaptive_avg_pool1d adaptive_avg_pool2d
adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d lp_pool1d lp_pool2d
interpolate upsample upsample_nearest upsample_bilinear max_pool1d_with_indices max_pool2d_with_indices
""".split()

MIX_ALL = """
conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d batch_norm instance_norm group_norm
local_response_norm pixel_shuffle pixel_unshuffle channel_shuffle embedding_bag cross_entropy nll_loss mse_loss
l1_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div smooth_l1_loss huber_loss cosine_similarity
pairwise_distance cdist tril triu trace det logdet inverse
""".split()


def _rule_elementwise(self: Shadows, call: Call):
    operands = [t for t in tree_flatten((call.args, call.kwargs))[0] if isinstance(t, torch.Tensor)]
    out = call.args[0] if call.inplace else call.out
    if not isinstance(out, torch.Tensor):
        raise Unfollowable(f"{call.name} returned no tensor")
    return self.elementwise(out.shape, operands)


def _rule_identity(self: Shadows, call: Call):
    s = self.sh(call.args[0]) if call.args else None
    if s is None:
        if self._input_shadows(call):
            raise Unfollowable(f"{call.name} with a split argument")
        return None
    if not isinstance(call.out, torch.Tensor) or s.numel() != call.out.numel():
        raise Unfollowable(f"{call.name} changed the shape")
    return s.reshape(call.out.shape)


def _rule_structural(self: Shadows, call: Call):
    if self.sh(call.args[0]) is None:
        raise Unfollowable(f"{call.name} uses split values as an index or a shape")
    return self.structural(call)


def _rule_like(self: Shadows, call: Call):
    """view_as / reshape_as / expand_as (other): only other's shape matters."""
    s = self.sh(call.args[0])
    if s is None:
        return None
    if call.name == "expand_as":
        return _broadcast(s, tuple(call.out.shape))
    return s.reshape(call.out.shape)


def _rule_scatter(self: Shadows, call: Call):
    return self.structural(call, data=SCATTERS[call.name])


def _rule_setitem(self: Shadows, call: Call):
    target, index, value = call.args[0], call.args[1], call.args[2]
    st, sv = self.sh(target), self.sh(value)
    if st is None and sv is None:
        raise Unfollowable("__setitem__ with split values as an index")
    st = st.clone() if st is not None else torch.full(tuple(target.shape), -1, dtype=torch.long)
    if isinstance(value, torch.Tensor):
        sv = sv if sv is not None else torch.full(tuple(value.shape), -1, dtype=torch.long)
    else:
        sv = -1

    def as_index(t):
        if isinstance(t, torch.Tensor):
            if self.sh(t) is not None or t.is_meta:
                raise Unfollowable("__setitem__ with split or unknown indices")
            return t.detach().to("cpu")
        return t

    st[tree_map(as_index, index)] = sv
    tracked = st >= 0
    if bool(tracked.any()) and not bool(tracked.all()):
        self.tr.poison(st, "__setitem__ mixes split features with whole values")
    self.tr.set_shadow(target, st if bool(tracked.any()) else None)
    return None


def _rule_copy(self: Shadows, call: Call):
    dst, src = call.args[0], call.args[1]
    s = self.sh(src)
    self.tr.set_shadow(dst, _broadcast(s, tuple(dst.shape)).clone() if s is not None else None)
    return None


def _rule_lists(self: Shadows, call: Call):
    return self.structural(call)


def _rule_no_track(self: Shadows, call: Call):
    return None


def _rule_factory(self: Shadows, call: Call):
    self._clear_outputs(call)
    return None


def _rule_host(self: Shadows, call: Call):
    raise Unfollowable(f"{call.name} reads split values on the host")


def _rule_reduction(self: Shadows, call: Call):
    base = call.name
    pos, default, keep = REDUCTIONS[base]
    if base in ("max", "min") and len(call.args) > 1 and isinstance(call.args[1], torch.Tensor):
        return _rule_elementwise(self, call)
    x = call.args[0]
    s = self.sh(x)
    if s is None:
        raise Unfollowable(f"{call.name} with a split argument")
    dims = _as_dims(_arg(call, pos, "dim", default), x.dim())
    outs = tensors_of(call.out)
    if keep:
        for d in dims:
            self.fs.union_along(s, d)
        return [s if tuple(o.shape) == tuple(s.shape) else _bad_shape(call) for o in outs]
    return self.reduce(s, dims, outs)


def _bad_shape(call: Call):
    raise Unfollowable(f"{call.name} returned an unexpected shape")


def _rule_norm(self: Shadows, call: Call):
    """layer_norm / rms_norm(input, normalized_shape, weight, ...): mixes the last len(shape) dims."""
    x = call.args[0]
    s = self.sh(x)
    if s is None:
        raise Unfollowable(f"{call.name} with split weights")
    shape = _arg(call, 1, "normalized_shape")
    k = len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 1
    for d in range(x.dim() - k, x.dim()):
        self.fs.union_along(s, d)
    operands = [t for t in tree_flatten((call.args, call.kwargs))[0] if isinstance(t, torch.Tensor)]
    return self.elementwise(call.out.shape, operands)


def _rule_mix_all(self: Shadows, call: Call):
    """Ops that mix everything but the batch dimension (convolutions and norms over channels, losses, ...)."""
    x = call.args[0] if call.args else None
    s = self.sh(x)
    if s is None or not isinstance(call.out, torch.Tensor):
        raise Unfollowable(f"{call.name} mixes split features")
    for d in range(1, x.dim()):
        self.fs.union_along(s, d)
    rep = s.reshape(s.shape[0], -1)[:, 0] if s.dim() else s
    if call.out.dim() == 0:
        return rep.reshape(-1)[0]
    return rep.reshape(rep.shape[0], *([1] * (call.out.dim() - 1))).expand(call.out.shape)


def _rule_spatial(self: Shadows, call: Call):
    x = call.args[0]
    s = self.sh(x)
    if s is None:
        raise Unfollowable(f"{call.name} with a split argument")
    for d in range(2, x.dim()):
        self.fs.union_along(s, d)
    rep = s
    for d in range(2, x.dim()):
        rep = rep.narrow(d, 0, 1)
    return [rep.expand(o.shape) for o in tensors_of(call.out)]


def _rule_pad(self: Shadows, call: Call):
    x, pad = call.args[0], _arg(call, 1, "pad")
    s = self.sh(x)
    if s is None:
        raise Unfollowable("pad with a split value")
    # A padded element belongs to the features of its neighbour: pad the shadow by edge replication.
    out = s
    for i in range(len(pad) // 2):
        d = s.dim() - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        if lo < 0 or hi < 0:
            out = out.narrow(d, max(-lo, 0), out.shape[d] - max(-lo, 0) - max(-hi, 0))
            lo, hi = max(lo, 0), max(hi, 0)
        if (lo or hi) and out.shape[d] == 0:
            raise Unfollowable("pad of an empty split dimension")
        parts = [out.narrow(d, 0, 1).expand(*out.shape[:d], lo, *out.shape[d + 1 :])] if lo else []
        parts.append(out)
        if hi:
            parts.append(out.narrow(d, out.shape[d] - 1, 1).expand(*out.shape[:d], hi, *out.shape[d + 1 :]))
        out = torch.cat(parts, d) if len(parts) > 1 else out
    return out


def _rule_matmul(self: Shadows, call: Call):
    name = call.name
    bias = None
    if name in _FUSED_ADD:
        bound = dict(zip(_FUSED_ADD[name], call.args)) | call.kwargs
        bias, a, b = (bound[k] for k in _FUSED_ADD[name])
    elif name == "linear":
        a, w = call.args[0], _arg(call, 1, "weight")
        bias = _arg(call, 2, "bias")
        b, sb = (w.t(), self.sh(w).t() if self.sh(w) is not None else None) if w.dim() == 2 else (w, self.sh(w))
        out = self.matmul_ids(a, self.sh(a), b, sb) if (self.sh(a) is not None or sb is not None) else None
        return _with_bias(self, call, out, bias)
    elif name in ("outer", "ger"):
        a, b = call.args[0], call.args[1]
        sa = self.sh(a).unsqueeze(-1) if self.sh(a) is not None else None
        sb = self.sh(b).unsqueeze(0) if self.sh(b) is not None else None
        out = self.matmul_ids(a.unsqueeze(-1), sa, b.unsqueeze(0), sb)
        return out
    else:
        a, b = call.args[0], call.args[1]
    sa, sb = self.sh(a), self.sh(b)
    out = self.matmul_ids(a, sa, b, sb) if (sa is not None or sb is not None) else None
    if out is not None and name == "addbmm":
        out = self.reduce(out, [0], [call.out])[0]
    return _with_bias(self, call, out, bias)


_FUSED_ADD = {
    "addmm": ("input", "mat1", "mat2"), "baddbmm": ("input", "batch1", "batch2"),
    "addbmm": ("input", "batch1", "batch2"), "addmv": ("input", "mat", "vec"),
}


def _with_bias(self: Shadows, call: Call, out: Ids | None, bias) -> Ids:
    if out is not None:
        out = out.reshape(call.out.shape)
    if not isinstance(bias, torch.Tensor):
        if out is None:
            raise Unfollowable(f"{call.name} without split operands")
        return out
    return self.elementwise(call.out.shape, [bias], extra=[out] if out is not None else [])


def _rule_sdpa(self: Shadows, call: Call):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    bound = dict(zip(names, call.args)) | call.kwargs
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask = bound.get("attn_mask")
    sq, sk, sv = self.sh(q), self.sh(k), self.sh(v)
    if isinstance(mask, torch.Tensor) and self.sh(mask) is not None:
        raise Unfollowable("attention mask derived from split features")
    if bound.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
        sk = sk.repeat_interleave(rep, -3) if sk is not None else None
        sv = sv.repeat_interleave(rep, -3) if sv is not None else None
    kt = k.transpose(-2, -1)
    score_shape = tuple(torch.broadcast_shapes((*q.shape[:-1], 1), (*kt.shape[:-2], 1, kt.shape[-1])))
    scores = None
    if sq is not None or sk is not None:
        scores = _broadcast(self.matmul_ids(q, sq, kt, sk.transpose(-2, -1) if sk is not None else None), score_shape).clone()
        if isinstance(mask, torch.Tensor):
            for d in varying_dims(tuple(mask.shape), _strides(mask), score_shape):
                self.fs.union_along(scores, d)
        self.fs.union_along(scores, -1)  # softmax over the keys
    holder = torch.empty(score_shape, device="meta")
    return self.matmul_ids(holder, scores, v, sv).reshape(call.out.shape)


def _rule_einsum(self: Shadows, call: Call):
    eq = call.args[0].replace(" ", "")
    ops = list(call.args[1]) if len(call.args) == 2 and isinstance(call.args[1], (list, tuple)) else list(call.args[1:])
    lhs, arrow, out_letters = eq.partition("->")
    ins = lhs.split(",")
    if "..." in eq or not arrow or len(ins) != len(ops) or len(ops) > 2:
        raise Unfollowable("einsum in a form that is not followed ('...', implicit output or 3+ operands)")
    tracked = [i for i, t in enumerate(ops) if self.sh(t) is not None]
    batch = {c for c in out_letters if all(c in s for s in ins)}
    sizes = {c: t.shape[j] for s, t in zip(ins, ops) for j, c in enumerate(s)}
    keep_free = len(tracked) == 1
    reps = {}
    for i in tracked:
        s, letters = self.sh(ops[i]), ins[i]
        kept = [c for c in letters if c in batch or (keep_free and c in out_letters)]
        for j, c in enumerate(letters):
            if c not in kept:
                self.fs.union_along(s, j)
        rep = s[tuple(slice(None) if c in kept else 0 for c in letters)].clone()
        reps[i] = (rep, kept)
    for i, t in enumerate(ops):  # a whole operand varying along batch letters mixes the split ones along them
        if i in tracked:
            continue
        strides = _strides(t)
        for j, c in enumerate(ins[i]):
            if c in batch and t.shape[j] > 1 and strides[j] != 0:
                for k in tracked:
                    rep, kept = reps[k]
                    self.fs.union_along(rep, kept.index(c))

    def to_out(rep, kept):
        order = [c for c in out_letters if c in kept]
        rep = rep.permute([kept.index(c) for c in order]) if order else rep
        return rep.reshape([sizes[c] if c in kept else 1 for c in out_letters]).expand([sizes[c] for c in out_letters])

    if len(tracked) == 1:
        return to_out(*reps[tracked[0]])
    self.fs.mark_kv(self.sh(ops[1]))
    return self.combine(to_out(*reps[0]).clone(), to_out(*reps[1]).clone())


def _rule_glu(self: Shadows, call: Call):
    s = self.sh(call.args[0])
    a, b = s.chunk(2, _arg(call, 1, "dim", -1))
    return self.combine(a.clone(), b.clone())


def _rule_complex(self: Shadows, call: Call):
    s = self.sh(call.args[0])
    if call.name == "view_as_complex":
        self.fs.union_along(s, -1)
        return s[..., 0]
    return s.unsqueeze(-1).expand(*s.shape, 2)


_TABLE: dict[str, Callable[[Rules, Call], Any]] = {}
for _names, _rule in (
    (ELEMENTWISE, _rule_elementwise), (IDENTITY, _rule_identity), (STRUCTURAL, _rule_structural),
    (LISTS, _rule_lists), (NO_TRACK, _rule_no_track), (FACTORY_LIKE, _rule_factory), (HOST_READS, _rule_host),
    (list(REDUCTIONS), _rule_reduction), (SPATIAL, _rule_spatial), (MIX_ALL, _rule_mix_all),
    (list(SCATTERS), _rule_scatter), (["layer_norm", "rms_norm"], _rule_norm),
    (["view_as", "reshape_as", "expand_as"], _rule_like),
    ("matmul mm bmm addmm baddbmm addbmm mv addmv dot vdot inner linear outer ger".split(), _rule_matmul),
):
    for _n in _names:
        _TABLE[_n] = _rule
_TABLE["scaled_dot_product_attention"] = _rule_sdpa
_TABLE["einsum"] = _rule_einsum
_TABLE["glu"] = _rule_glu
_TABLE["view_as_complex"] = _rule_complex
_TABLE["view_as_real"] = _rule_complex
_TABLE["__setitem__"] = _rule_setitem
_TABLE["copy"] = _rule_copy
_TABLE["pad"] = _rule_pad
