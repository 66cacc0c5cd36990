"""LF001's notes: what a ctx attribute keeps that lives anyway or costs a few bytes.

A parameter, weight or buffer lives as long as its module; an RNG state is a few KB; a
varlen kernel's ``cu_seqlens`` is batch + 1 integers; a tensor made with constant sizes or
by a full reduction is a few numbers whatever the data. Each is reported at level
``note``: worth knowing, it does not fail the scan.
"""

from __future__ import annotations

import ast
import re

from leakfree.scan._syntax import elements, name_words, tail, walk, words
from leakfree.scan._tensors import few

#: words naming a module's parameters and buffers: they live as long as the module
_WEIGHT_WORDS = words("weight weights bias biases param params parameter parameters buffer")


#: names of packed sequences' boundaries (``cu_seqlens``, ``chunk_indices``): batch + 1
#: integers, or one pair per chunk, kept beside varlen kernels
_BOUNDARIES = re.compile(r"^(?:cu_seq_?lens\w*|cu_seqlens\w*|chunk_indices\w*|seq_?lens(?:_cpu)?)$")
#: ALiBi's slopes: one number per attention head
_ALIBI = re.compile(r"^alibi_slopes?$")
#: rotary embedding tables (``cos``, ``sin_cached``, ``freqs_cis``)
_ROTARY = re.compile(r"^(?:cos|sin)(?:_\w+)?$|^freqs?_cis$|^inv_freq$")
#: words that make a "bias" an activation's, not a module's (``attn_bias``, ``alibi``)
_NOT_WEIGHT_WORDS = words("attn attention alibi mask pos position rel relative")


def _weight_named(name: str) -> bool:
    """``weight``, ``ln_bias``, ``weight_chunked``: a module's own; not ``attn_bias`` nor
    ``attn_bias_tensor`` (an attention bias, made per call)."""
    found = name_words(name)
    return bool(found & _WEIGHT_WORDS) and not found & _NOT_WEIGHT_WORDS


#: methods whose result shares (or copies without growing) the data they are called on
_SAME_AS = frozenset({"detach", "view", "t", "contiguous", "reshape", "to", "float", "half"})


def _leaves(value: ast.AST) -> list[ast.AST]:
    """The values a store may hold: the elements of a display, both branches of ``a if c
    else b`` (a ``None`` branch holds nothing), a comprehension's source."""
    out: list[ast.AST] = []
    for v in elements(value):
        if isinstance(v, ast.IfExp):
            out += [b for b in _leaves(v.body) + _leaves(v.orelse) if not _none(b)]
        elif isinstance(v, (ast.ListComp, ast.GeneratorExp)):
            out.append(v.generators[0].iter)
        else:
            out.append(v)
    return out


def _none(e: ast.AST) -> bool:
    return isinstance(e, ast.Constant) and e.value is None


def _same_data(e: ast.AST) -> ast.AST:
    """``bias.detach()`` -> ``bias``: what a view or a detached alias is of."""
    while isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in _SAME_AS:
        e = e.func.value
    return e


def lives_anyway(
    attr: str, value: ast.AST, names: dict[str, str], bound: dict[str, list[ast.AST]]
) -> str | None:
    """Why the stored value costs nothing beyond what lives anyway (a note, not a leak):
    a parameter, weight or buffer, an RNG state (a few KB), sequence boundaries, rotary
    tables, a tensor of a few numbers whatever the data (:func:`few`: ``x.new_empty(0)``,
    ``mask.sum()``), or a slice of the inputs kept under a weights name (``ctx.weights =
    inputs_and_weights[n:]``); None for anything else."""
    for n in walk(value):
        if isinstance(n, ast.Call) and "rng" in name_words(tail(n.func)):
            # get_rng_state(), Megatron's _get_all_rng_states()
            return "an RNG state (a few KB per call, not activations)"
    leaves = [_same_data(v) for v in _leaves(value)]
    if leaves and all(
        (isinstance(v, (ast.Name, ast.Attribute)) and _weight_named(tail(v)))
        or (isinstance(v, ast.Call) and tail(v.func) in ("parameters", "buffers"))
        for v in leaves
    ):
        return "a parameter or weight, which lives as long as its module anyway"
    if all(isinstance(v, ast.Name) and "rng" in name_words(v.id) for v in leaves):
        return "an RNG state (a few KB per call, not activations)"
    if leaves and all(isinstance(v, ast.Name) and _BOUNDARIES.match(v.id) for v in leaves):
        return "sequence boundaries (a few bytes per sequence, not activations)"
    if leaves and all(isinstance(v, ast.Name) and _ROTARY.match(v.id) for v in leaves):
        return "rotary position tables (positions x head size, most often the module's cache)"
    if leaves and all(isinstance(v, ast.Name) and _ALIBI.match(v.id) for v in leaves):
        return "ALiBi slopes (one number per attention head)"
    if few(value, names, bound):
        return "a tensor of a few numbers whatever the data (a constant size, or a full reduction)"
    if (
        _weight_named(attr)
        and leaves
        and all(isinstance(v, ast.Subscript) and isinstance(v.slice, ast.Slice) for v in leaves)
    ):
        return "the module's parameters (kept under a weights name), which live anyway"
    return None
