"""PyTorch state-dict names and layouts of the stock `eqx.nn` layers.

`torch_layout(like)` gives the rename rules and transforms that load into
every stock layer of `like` the tensors PyTorch's matching module saves
(`state_dict()` names and shapes). Layouts, Equinox <- PyTorch:

- `Linear`, `Embedding`, `LayerNorm`, `RMSNorm`, `GroupNorm`: same names, same
  shapes (PyTorch's `RMSNorm` has no bias: Equinox's keeps `like`'s value).
- `Conv1d/2d/3d`: same weight; the bias `(out,)` becomes `(out, 1, ...)`.
- `ConvTranspose1d/2d/3d`: PyTorch's weight `(in, out/groups, *k)` has its
  channel axes swapped (per group) and its kernel flipped, as Equinox's
  docstring says.
- `MultiheadAttention`: `in_proj_weight`/`in_proj_bias` (or `q_proj_weight`...
  when key and value sizes differ) split into `query_proj`, `key_proj`,
  `value_proj`; `out_proj` is `output_proj`.
- `LSTMCell`: `bias = bias_ih + bias_hh` (same gate order i, f, g, o).
- `GRUCell`: `bias = bias_ih + (bias_hh's r and z parts, 0)`, `bias_n = bias_hh`'s n part.
- `BatchNorm`: `weight`, `bias`, and `running_mean`/`running_var` into the
  layer's `eqx.nn.State`. The state's step counter or first-time flag keeps
  `like`'s value, so inference uses the running statistics as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._base import _keypath, _select
from .._base._errors import CheckpointValueError

# (leaf path relative to the layer, PyTorch name(s) relative to the module, transform or None)
Entry = tuple[str, Any, Any]

_SAME = (eqx.nn.Linear, eqx.nn.Embedding, eqx.nn.LayerNorm, eqx.nn.RMSNorm, eqx.nn.GroupNorm)
_STOCK = (
    *_SAME,
    eqx.nn.Conv,
    eqx.nn.ConvTranspose,
    eqx.nn.MultiheadAttention,
    eqx.nn.LSTMCell,
    eqx.nn.GRUCell,
    eqx.nn.BatchNorm,
)


def torch_layout(
    like: PyTree, *, rename: Sequence[tuple[str, Any]] = ()
) -> tuple[list[tuple[str, Any]], list[tuple[str, Callable[..., Any]]]]:
    """Rename rules and transforms that load a PyTorch state dict into the stock
    `eqx.nn` layers of `like`.

    **Arguments:**

    - `like`: the Equinox tree to load into (concrete or from
        `eqx.filter_eval_shape`); for `BatchNorm`, a tuple `(model, state)` as
        `eqx.nn.make_with_state` gives, so its running statistics go into `state`.
    - `rename`: `(pattern, replacement)` rules from a dotted path inside the
        model to its PyTorch name (`[(r"^blocks\\.(\\d+)\\.attn", r"h.\\1.attn")]`):
        a stock layer's path to its module name, another leaf's to its tensor
        name. The first match wins; a replacement of `None` skips it. The paths
        are those of `like`, or of `model` in a `(model, state)` tuple (`norm`,
        not `0.norm`).

    **Returns:**

    `(rename, transform)`, to pass as `rename=` and `transform=` to
    [`eqx_ckpt.tree_deserialise_leaves`][] or [`eqx_ckpt.load_or_initialise`][].

    **Raises:**

    `CheckpointValueError`, before anything is loaded, for a `rename` rule that
    is the first match of no path.

    !!! example

        ```python
        import equinox as eqx, jax, numpy as np
        from safetensors.numpy import save_file
        import eqx_ckpt

        save_file({"conv.weight": np.ones((4, 3, 3, 3), np.float32),
                   "conv.bias": np.zeros(4, np.float32)}, "conv.safetensors")
        like = {"features": eqx.nn.Conv2d(3, 4, 3, key=jax.random.key(0))}
        rename, transform = eqx_ckpt.torch_layout(like, rename=[(r"^features", "conv")])
        model = eqx_ckpt.tree_deserialise_leaves("conv.safetensors", like, rename=rename, transform=transform)
        ```
    """
    table = list(rename)
    to_torch = _select.rules(table, what="rename")
    model, state = like if _is_model_and_state(like) else (like, None)
    paths = {id(leaf): _keypath.dotted(kp) for kp, leaf in jtu.tree_flatten_with_path(like)[0]}
    prefix = (_keypath.segment(jtu.SequenceKey(0)),) if state is not None else ()
    names: list[tuple[str, Any]] = []
    transforms: list[tuple[str, Callable[..., Any]]] = []
    # Every path the rules are matched against: inside the model, layer or not.
    layers, bare = [], []
    for keypath, node in jtu.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, _STOCK))[0]:
        inside = _keypath.dotted(keypath)
        where = _keypath.join_dotted(*prefix, inside)
        module = to_torch(inside)
        if not isinstance(node, _STOCK):
            bare.append(inside)
            if module != where:  # unchanged needs no rule (and its own path is its name)
                names.append(("^" + re.escape(where) + "$", _literal(module)))
            continue
        layers.append(inside)
        if isinstance(module, tuple):
            raise CheckpointValueError(f"`rename` must give one PyTorch module name for `{where}`, not {module}.")
        entries = _entries(node, state, paths, where)
        # Python scalars of a layer (dropout's `p`, `inference` flags) are not in a state dict.
        done = {leaf for leaf, _, _ in entries}
        entries += [(leaf, None, None) for leaf in _leaf_paths(node, where) if leaf not in done]
        for leaf, torch_name, fn in entries:
            names.append(("^" + re.escape(leaf) + "$", _literal(_torch_names(module, torch_name))))
            if fn is not None:
                transforms.append(("^" + re.escape(leaf) + "$", fn))
    _refuse_unused(table, layers, bare, state is not None)
    return names, transforms


def _literal(target: Any) -> Any:
    """A name as the replacement of a rule (`re.sub` reads `\\` in it as an escape)."""
    if isinstance(target, tuple):
        return tuple(_literal(t) for t in target)
    return target if target is None else target.replace("\\", "\\\\")


def _refuse_unused(table: list[Any], layers: list[str], bare: list[str], tupled: bool) -> None:
    """Raise for a rule that is the first match of no path inside the model: it
    would leave its leaf under a name PyTorch never wrote."""
    patterns = [re.compile(rule[0]) for rule in table]
    used = {next((i for i, p in enumerate(patterns) if p.search(path)), None) for path in layers + bare}
    unused = [table[i] for i in range(len(table)) if i not in used]
    if not unused:
        return
    shown = lambda paths: (
        ", ".join(f"`{p}`" if p else "the model itself (path ``)" for p in paths[:5])
        + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    )
    said = "; ".join(f"({getattr(r[0], 'pattern', r[0])!r}, {r[1]!r})" for r in unused)
    example = next((path for path in layers + bare if path), "")
    inside = f"inside the model (`like[0]`{f': `{example}`, not `0.{example}`' if example else ''})"
    inside = inside if tupled else "of `like`"
    raise CheckpointValueError(
        f"{len(unused)} `rename` {'rules' if len(unused) > 1 else 'rule'} of `torch_layout` "
        f"{'match' if len(unused) > 1 else 'matches'} no path (or only paths an earlier rule takes): {said}. "
        f"Rules are matched against the dotted paths {inside}, of stock layers and of leaves outside them "
        f"alike. The model's layers: "
        f"{shown(layers) or '(none)'}; its leaves outside layers: {shown(bare) or '(none)'}. Fix or remove the rule."
    )


def _leaf_paths(layer: Any, where: str) -> list[str]:
    return [_keypath.join_dotted(where, _keypath.dotted(kp)) for kp, _ in jtu.tree_flatten_with_path(layer)[0]]


def _is_model_and_state(like: Any) -> bool:
    return isinstance(like, tuple) and len(like) == 2 and isinstance(like[1], eqx.nn.State)


def _torch_names(module: str | None, names: Any) -> Any:
    if module is None or names is None:
        return None
    if isinstance(names, tuple):
        return tuple(_keypath.join_dotted(module, n) for n in names)
    return _keypath.join_dotted(module, names)


def _entries(layer: Any, state: Any, paths: dict[int, str], where: str) -> list[Entry]:
    """Each array leaf of `layer` (as a dotted path of `like`), its PyTorch
    name(s) below the module, and the transform it needs."""
    own = jtu.tree_flatten_with_path(layer)[0]
    arrays = {_keypath.dotted(kp): leaf for kp, leaf in own if hasattr(leaf, "shape") and hasattr(leaf, "dtype")}
    full = lambda name: _keypath.join_dotted(where, name)
    if isinstance(layer, eqx.nn.RMSNorm):
        # PyTorch's RMSNorm has no bias: Equinox's optional one keeps `like`'s value.
        return [(full(name), name if name == "weight" else None, None) for name in arrays]
    if isinstance(layer, _SAME):
        return [(full(name), name, None) for name in arrays]
    if isinstance(layer, eqx.nn.Conv):
        return [(full("weight"), "weight", None), *_bias(arrays, full)]
    if isinstance(layer, eqx.nn.ConvTranspose):
        return [(full("weight"), "weight", _transposed(layer.groups)), *_bias(arrays, full)]
    if isinstance(layer, eqx.nn.MultiheadAttention):
        return _attention(arrays, full)
    if isinstance(layer, (eqx.nn.LSTMCell, eqx.nn.GRUCell)):
        out: list[Entry] = [(full("weight_ih"), "weight_ih", None), (full("weight_hh"), "weight_hh", None)]
        if "bias" not in arrays:
            return out
        if isinstance(layer, eqx.nn.LSTMCell):
            return [*out, (full("bias"), ("bias_ih", "bias_hh"), np.add)]
        return [*out, (full("bias"), ("bias_ih", "bias_hh"), _gru_bias), (full("bias_n"), "bias_hh", _gru_bias_n)]
    return _batch_norm(layer, state, paths, arrays, full)


def _bias(arrays: dict[str, Any], full: Callable[[str], str]) -> list[Entry]:
    if "bias" not in arrays:
        return []
    shape = tuple(arrays["bias"].shape)
    return [(full("bias"), "bias", lambda b: np.reshape(b, shape))]


def _transposed(groups: int) -> Callable[[np.ndarray], np.ndarray]:
    """PyTorch's `(in, out/groups, *k)` -> Equinox's `(out, in/groups, *k)`, kernel flipped."""

    def fn(w: np.ndarray) -> np.ndarray:
        inputs, per_group, *kernel = w.shape
        w = w.reshape(groups, inputs // groups, per_group, *kernel).swapaxes(1, 2)
        w = w.reshape(groups * per_group, inputs // groups, *kernel)
        return np.flip(w, axis=tuple(range(2, w.ndim))).copy()

    return fn


def _attention(arrays: dict[str, Any], full: Callable[[str], str]) -> list[Entry]:
    sizes = {arrays[f"{p}_proj.weight"].shape[1] for p in ("query", "key", "value")}
    packed = len(sizes) == 1
    out: list[Entry] = []
    start = 0
    for i, part in enumerate(("query", "key", "value")):
        rows = arrays[f"{part}_proj.weight"].shape[0]
        cut = _rows(start, start + rows)
        if packed:
            out.append((full(f"{part}_proj.weight"), "in_proj_weight", cut))
        else:
            out.append((full(f"{part}_proj.weight"), f"{'qkv'[i]}_proj_weight", None))
        if f"{part}_proj.bias" in arrays:
            out.append((full(f"{part}_proj.bias"), "in_proj_bias", cut))
        start += rows
    out.append((full("output_proj.weight"), "out_proj.weight", None))
    if "output_proj.bias" in arrays:
        out.append((full("output_proj.bias"), "out_proj.bias", None))
    return out


def _rows(lo: int, hi: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: w[lo:hi]


def _gru_bias(bias_ih: np.ndarray, bias_hh: np.ndarray) -> np.ndarray:
    hidden = bias_hh.shape[0] // 3
    return bias_ih + np.concatenate([bias_hh[: 2 * hidden], np.zeros_like(bias_hh[2 * hidden :])])


def _gru_bias_n(bias_hh: np.ndarray) -> np.ndarray:
    return bias_hh[2 * (bias_hh.shape[0] // 3) :]


def _batch_norm(layer: Any, state: Any, paths: dict[int, str], arrays: dict[str, Any], full: Any) -> list[Entry]:
    out: list[Entry] = [(full(name), name, None) for name in arrays]
    if state is None:
        return out
    index = layer.ema_state_index if layer.mode == "ema" else layer.batch_state_index
    mean, var = state.get(index)
    out += [(paths[id(mean)], "running_mean", None), (paths[id(var)], "running_var", None)]
    # The first-time flag (ema) or step counter (batch) is not in PyTorch's state dict.
    for other in (getattr(layer, "ema_first_time_index", None), getattr(layer, "batch_counter", None)):
        if other is not None:
            out.append((paths[id(state.get(other))], None, None))
    return out
