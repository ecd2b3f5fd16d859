"""Triton interpreter speed-ups for moekit's CPU tests, installed where TRITON_INTERPRET=1.

The repository's conftest.py loads this file in every test process, and puts its folder first on
PYTHONPATH, so that the Python processes the tests start (the benchmarks' smoke runs) import it at
start-up as `sitecustomize` and run their kernels with the same speed-ups. Nothing here changes what
a kernel computes; the patches apply to triton 3.6 (constraints.txt) and step aside for another.

The interpreter re-patches triton.language (every builtin of `tl`, `tl.tensor` and `tl.math`, a few
milliseconds) at every call of a `@triton.jit` helper from inside a kernel, although the launch that
runs the kernel has patched those same modules already and restores them when it ends. moekit's
kernels call small helpers per tile: in one quantize test that re-patching was a third of the time
(43 s -> 26 s without it). `_patch_each_launch_once` skips it for a helper whose language modules
the running launch has patched; any other helper (one that also names `triton.language.core`, say)
is patched as before. What is computed does not change: the helper runs with the same patched
builtins either way.

What is left of the interpreter's time is bookkeeping, not arithmetic (cProfile of one quantize test:
numpy is a few percent; most is building triton.language type objects for every operation of every
program). `_cheaper_interpreter_types` removes three of its costs, each without changing a value:
the numpy dtype of a Triton type is looked up in one table built once (triton 3.6 builds that dict
at every call), a block type of plain int dimensions is built without the generic unwrapping (the
same attributes, of the same types; anything else goes to the original), and a tuple type's and a
block type's `name` string is made when read rather than at every construction. That test: 28 s -> 20 s.
Then the shapes themselves: every operation's result type and tensor built its shape as a triton
`tuple` (of ints for the type, of constexprs for the tensor), and a triton tuple builds the tuple type
of its members; now each block shape's two (and a scalar tensor's empty one) are made once and shared
by every type and tensor of that shape (triton never changes a shape in place), and a shape compared
with plain ints (each broadcast compares its operands' shapes with the result's) compares the value
lists without building a triton tuple of the other side first; a scalar type compared with itself is
equal without unwrapping and comparing names. The transposed weight copy's test under fp8_rowwise:
18.5 s -> 12.1 s.

The interpreter reduces with numpy only for triton's own combine functions (sum, min, max, argmin,
argmax); any other `tl.reduce` runs its combine function in Python, element by element, building
triton tensors for every pair. moekit's tile schedule (`moekit.ops.kernels.schedule.locate_tile`, in
every persistent kernel, once a tile) reduces a tuple of four int32 vectors by (sum, max, min, min):
in a quantized-layer test that generic reduce was about half of the time. `_vectorized_tuple_reduces`
gives the combine functions listed in `TUPLE_REDUCES` their numpy reductions, each element's the
same integer operation in the same dtype (no float: the order of a sum cannot change an integer's
value); any other combine function takes the interpreter's own path.
"""

import inspect
import math
import os

_tuple = tuple  # the builtin (triton's own is `core.tuple`)


def _install() -> None:
    try:
        import numpy as np
        import triton.language as tl
        from triton.language import core
        from triton.runtime import interpreter
    except ImportError:
        return
    _patch_each_launch_once(tl, interpreter)
    _cheaper_interpreter_types(np, tl, core, interpreter)
    _vectorized_tuple_reduces(np, interpreter)


def _patch_each_launch_once(tl, interpreter) -> None:
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or getattr(patch_lang, "once_per_launch", False):
        return  # another triton than the one this was written for (3.6), or already installed
    patched: list[set[int]] = []  # the language modules the running launch has patched

    known: dict[object, set[int]] = {}

    def languages(fn) -> set[int]:
        if fn not in known:
            mods = (v for v in fn.__globals__.values() if inspect.ismodule(v))
            known[fn] = {id(v) for v in mods if v in (tl, tl.core)}
        return known[fn]

    class LaunchScope:
        def __init__(self, scope) -> None:
            self.scope = scope

        def restore(self) -> None:
            patched.pop()
            self.scope.restore()

    def once_per_launch(fn):
        langs = languages(fn)
        if not patched:  # a launch (kernels do not launch kernels): patch, restored when it ends
            scope = patch_lang(fn)
            patched.append(langs)
            return LaunchScope(scope)
        if langs <= patched[-1]:  # a helper called from the kernel: its modules are patched already
            return None
        patched[-1] |= langs
        return patch_lang(fn)

    once_per_launch.once_per_launch = True
    interpreter._patch_lang = once_per_launch


def _cheaper_interpreter_types(np, tl, core, interpreter) -> None:
    get_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if get_np_dtype is None or getattr(get_np_dtype, "cached", False):
        return  # another triton than the one this was written for (3.6), or already installed
    scalars = (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32)
    scalars += (tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv)
    scalars += (tl.float8e4b8, tl.float8e4b15)
    np_types = {t: get_np_dtype(t) for t in scalars}

    def cached_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):
            return np.dtype(np.uint64)
        return np_types[element]

    cached_np_dtype.cached = True
    interpreter._get_np_dtype = cached_np_dtype

    block_init = core.block_type.__init__

    # dims -> (shape, numel) of a block type, and (shape, numel) of a tensor of that type: made once
    # per block shape and shared by every type and tensor of it (none of them is ever changed in place).
    block_shapes: dict = {}
    tensor_shapes: dict = {}

    def block_type_init(self, element_ty, shape) -> None:
        dims = shape.values if isinstance(shape, core.tuple) else shape
        dims = tuple(d.value if isinstance(d, core.constexpr) else d for d in dims)
        cached = block_shapes.get(dims)
        if cached is None:
            if not dims or not all(type(d) is int for d in dims):
                block_init(self, element_ty, shape)  # the original, and its errors
                return
            # the types the original gives (core's `tuple` is triton's own)
            shape_ = core.tuple(dims)
            cached = block_shapes[dims] = (shape_, core.validate_block_shape(shape_))
        self.element_ty = element_ty
        self.shape, self.numel = cached

    tensor_init = core.tensor.__init__

    def cached_tensor_init(self, handle, type) -> None:
        if type.is_block() and not isinstance(type, core.block_type):
            tensor_init(self, handle, type)
            return
        dims = tuple(type.shape) if type.is_block() else ()  # a scalar's shape: ()
        cached = tensor_shapes.get(dims)
        if cached is None:  # what the original computes
            shape_ = core.tuple([core.constexpr(d) for d in dims])
            cached = tensor_shapes[dims] = (shape_, core.constexpr(math.prod(dims)))
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        self.shape, self.numel = cached

    def block_type_name(self) -> str:
        name = self.__dict__.get("_name")
        if name is None:  # made when first read, as the original makes it at construction
            name = self.__dict__["_name"] = f"<{self.shape}, {self.element_ty}>"
        return name

    def set_block_type_name(self, name: str) -> None:  # the original's construction assigns it
        self.__dict__["_name"] = name

    # A shape compared with a shape (every operation's broadcast compares its operands' shapes and the
    # result's): the original first builds a triton tuple of the other side (and its tuple type). For
    # plain ints on both sides the comparison of the value lists is what that gives.
    tuple_eq = core.tuple.__eq__

    def tuple_eq_of_ints(self, other):
        kind = type(other)
        if kind is core.tuple:
            values = other.values
        elif kind is list:
            values = other
        elif kind is _tuple:
            values = list(other)
        else:
            return tuple_eq(self, other)
        if not all(type(v) is int for v in values):
            return tuple_eq(self, other)
        return core.constexpr(self.values == values)

    tuple_eq_of_ints.original = tuple_eq
    core.tuple.__eq__ = tuple_eq_of_ints

    # A scalar type compared with itself (every operation's casts compare its operands' element types,
    # mostly the same singletons): the original unwraps and compares names, equal for the same object.
    dtype_eq = core.dtype.__eq__

    def dtype_eq_or_same(self, other) -> bool:
        return True if self is other else dtype_eq(self, other)

    dtype_eq_or_same.original = dtype_eq
    core.dtype.__eq__ = dtype_eq_or_same

    block_type_init.original = block_init
    cached_tensor_init.original = tensor_init
    core.block_type.__init__ = block_type_init
    core.tensor.__init__ = cached_tensor_init
    core.block_type.name = property(block_type_name, set_block_type_name)

    def tuple_type_init(self, types, fields=None) -> None:
        self.types = types
        self.fields = fields or [""] * len(types)

    def tuple_type_name(self) -> str:
        return "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types, strict=False)]) + "]"

    core.tuple_type.__init__ = tuple_type_init
    core.tuple_type.name = property(tuple_type_name)


# (module, name) of a combine function -> the numpy reduction of each of its tuple's members.
TUPLE_REDUCES = {("moekit.ops.kernels.schedule", "_min_tuple"): ("sum", "max", "min", "min")}


def _vectorized_tuple_reduces(np, interpreter) -> None:
    ops = getattr(interpreter, "ReduceOps", None)
    apply_impl = getattr(ops, "apply_impl", None)
    if apply_impl is None or getattr(apply_impl, "vectorized", False):
        return  # another triton than the one this was written for (3.6), or already installed

    def vectorized(self, input):
        fn = getattr(self.combine_fn, "fn", None)
        names = TUPLE_REDUCES.get((getattr(fn, "__module__", None), getattr(fn, "__name__", None)))
        if names is None or len(input) != len(names) or not all(t.dtype.is_int() for t in input):
            return apply_impl(self, input)
        out = []
        for name, t in zip(names, input, strict=True):
            data = t.handle.data
            out.append(
                self.to_tensor(
                    getattr(np, name)(data, axis=self.axis, keepdims=self.keep_dims).astype(data.dtype), t.dtype
                )
            )
        return out

    vectorized.vectorized = True
    vectorized.original = apply_impl
    vectorized.reduces = TUPLE_REDUCES
    ops.apply_impl = vectorized


if os.environ.get("TRITON_INTERPRET") == "1":
    _install()
