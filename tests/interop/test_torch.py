"""`torch_layout`: stock eqx.nn layers loaded from tensors in PyTorch's names and
layouts give the outputs of NumPy implementations of PyTorch's formulas."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from arrays import tree_equal
from layers import NormAndGain
from safetensors.numpy import save_file

import eqx_ckpt

RNG = np.random.default_rng(0)


def _random(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _load(tmp_path, tensors, like, **kwargs):
    """Save `tensors` (PyTorch names and layouts) and load them into `like` by `torch_layout`."""
    save_file(tensors, str(tmp_path / "torch.safetensors"))
    rename, transform = eqx_ckpt.torch_layout(like, **kwargs)
    return eqx_ckpt.tree_deserialise_leaves(tmp_path / "torch.safetensors", like, rename=rename, transform=transform)


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def _conv_reference(x, w, b, padding):
    """PyTorch's ConvNd (stride 1, groups 1): cross-correlation plus bias."""
    nd = x.ndim - 1
    xp = np.pad(x, [(0, 0)] + [(padding, padding)] * nd)
    kernel = w.shape[2:]
    out_shape = [xp.shape[i + 1] - kernel[i] + 1 for i in range(nd)]
    out = np.zeros((w.shape[0], *out_shape), np.float32)
    for idx in np.ndindex(*out_shape):
        window = xp[(slice(None), *(slice(i, i + k) for i, k in zip(idx, kernel)))]
        out[(slice(None), *idx)] = np.tensordot(w, window, axes=(list(range(1, nd + 2)), list(range(nd + 1))))
    return out + b.reshape(-1, *([1] * nd))


def _conv_transpose_reference(x, w, b, stride, groups):
    """PyTorch's ConvTransposeNd (padding 0): each input element scatters `w`,
    whose shape is (in, out/groups, *k)."""
    cin, *size = x.shape
    per_in, per_out, kernel = cin // groups, w.shape[1], w.shape[2:]
    out_size = [(n - 1) * stride + k for n, k in zip(size, kernel)]
    out = np.zeros((per_out * groups, *out_size), np.float32)
    for ci in range(cin):
        g = ci // per_in
        for idx in np.ndindex(*size):
            region = tuple(slice(i * stride, i * stride + k) for i, k in zip(idx, kernel))
            out[(slice(g * per_out, (g + 1) * per_out), *region)] += x[(ci, *idx)] * w[ci]
    return out + b.reshape(-1, *([1] * len(size)))


def test_linear_embedding_layer_norm(tmp_path):
    like = {
        "fc": eqx.filter_eval_shape(eqx.nn.Linear, 5, 3, key=jax.random.key(0)),
        "emb": eqx.filter_eval_shape(eqx.nn.Embedding, 10, 4, key=jax.random.key(0)),
        "norm": eqx.filter_eval_shape(eqx.nn.LayerNorm, 4),
    }
    t = {
        "fc.weight": _random(3, 5),
        "fc.bias": _random(3),
        "embed.weight": _random(10, 4),
        "ln.weight": _random(4),
        "ln.bias": _random(4),
    }
    model = _load(tmp_path, t, like, rename=[(r"^emb$", "embed"), (r"^norm$", "ln")])
    x = _random(5)
    _close(model["fc"](jnp.asarray(x)), t["fc.weight"] @ x + t["fc.bias"])
    _close(model["emb"](jnp.asarray(7)), t["embed.weight"][7])
    y = _random(4)
    ref = (y - y.mean()) / np.sqrt(y.var() + 1e-5) * t["ln.weight"] + t["ln.bias"]
    _close(model["norm"](jnp.asarray(y)), ref)


def test_rms_norm_and_group_norm(tmp_path):
    like = {"rms": eqx.nn.RMSNorm(6, eps=1e-6), "gn": eqx.nn.GroupNorm(2, 6)}
    t = {"rms.weight": _random(6), "gn.weight": _random(6), "gn.bias": _random(6)}
    model = _load(tmp_path, t, like, rename=[(r"^rms$", "rms")])
    x = _random(6)
    _close(model["rms"](jnp.asarray(x)), x / np.sqrt((x**2).mean() + 1e-6) * t["rms.weight"])
    y = _random(6, 5)
    groups = y.reshape(2, -1)
    normed = ((groups - groups.mean(-1, keepdims=True)) / np.sqrt(groups.var(-1, keepdims=True) + 1e-5)).reshape(6, 5)
    _close(model["gn"](jnp.asarray(y)), normed * t["gn.weight"][:, None] + t["gn.bias"][:, None])


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv(tmp_path, nd):
    like = {"conv": eqx.filter_eval_shape(eqx.nn.Conv, nd, 2, 3, 3, padding=1, key=jax.random.key(0))}
    t = {"conv.weight": _random(3, 2, *([3] * nd)), "conv.bias": _random(3)}
    model = _load(tmp_path, t, like)
    assert model["conv"].bias.shape == (3, *([1] * nd))
    x = _random(2, *([5] * nd))
    _close(model["conv"](jnp.asarray(x)), _conv_reference(x, t["conv.weight"], t["conv.bias"], padding=1))


@pytest.mark.parametrize(("nd", "groups"), [(1, 1), (2, 2)])
def test_conv_transpose(tmp_path, nd, groups):
    make = lambda: eqx.nn.ConvTranspose(nd, 4, 6, 3, stride=2, groups=groups, key=jax.random.key(0))
    like = {"up": eqx.filter_eval_shape(make)}
    t = {"up.weight": _random(4, 6 // groups, *([3] * nd)), "up.bias": _random(6)}
    model = _load(tmp_path, t, like)
    x = _random(4, *([4] * nd))
    expected = _conv_transpose_reference(x, t["up.weight"], t["up.bias"], stride=2, groups=groups)
    _close(model["up"](jnp.asarray(x)), expected)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_multihead_attention_packed(tmp_path):
    heads, dim, seq = 2, 8, 5
    make = lambda: eqx.nn.MultiheadAttention(
        heads,
        dim,
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
        key=jax.random.key(0),
    )
    like = {"attn": eqx.filter_eval_shape(make)}
    t = {
        "attn.in_proj_weight": _random(3 * dim, dim),
        "attn.in_proj_bias": _random(3 * dim),
        "attn.out_proj.weight": _random(dim, dim),
        "attn.out_proj.bias": _random(dim),
    }
    model = _load(tmp_path, t, like)
    x = _random(seq, dim)
    # PyTorch: project with the packed weight, split heads, scaled dot product, out_proj.
    qkv = x @ t["attn.in_proj_weight"].T + t["attn.in_proj_bias"]
    q, k, v = (a.reshape(seq, heads, dim // heads).transpose(1, 0, 2) for a in np.split(qkv, 3, axis=-1))
    weights = _softmax(q @ k.transpose(0, 2, 1) / np.sqrt(dim // heads))
    out = (weights @ v).transpose(1, 0, 2).reshape(seq, dim)
    expected = out @ t["attn.out_proj.weight"].T + t["attn.out_proj.bias"]
    _close(model["attn"](jnp.asarray(x), jnp.asarray(x), jnp.asarray(x)), expected)


def test_multihead_attention_separate_kv_sizes(tmp_path):
    heads, dim, kdim, vdim = 2, 4, 3, 5
    make = lambda: eqx.nn.MultiheadAttention(heads, dim, key_size=kdim, value_size=vdim, key=jax.random.key(0))
    like = {"attn": eqx.filter_eval_shape(make)}
    t = {
        "attn.q_proj_weight": _random(dim, dim),
        "attn.k_proj_weight": _random(dim, kdim),
        "attn.v_proj_weight": _random(dim, vdim),
        "attn.out_proj.weight": _random(dim, dim),
    }
    model = _load(tmp_path, t, like)
    q_in, k_in, v_in = _random(3, dim), _random(6, kdim), _random(6, vdim)
    split = lambda a: a.reshape(a.shape[0], heads, dim // heads).transpose(1, 0, 2)
    q, k, v = (
        split(q_in @ t["attn.q_proj_weight"].T),
        split(k_in @ t["attn.k_proj_weight"].T),
        split(v_in @ t["attn.v_proj_weight"].T),
    )
    out = (_softmax(q @ k.transpose(0, 2, 1) / np.sqrt(dim // heads)) @ v).transpose(1, 0, 2).reshape(3, dim)
    got = model["attn"](jnp.asarray(q_in), jnp.asarray(k_in), jnp.asarray(v_in))
    _close(got, out @ t["attn.out_proj.weight"].T)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def test_lstm_cell(tmp_path):
    n_in, hidden = 3, 4
    like = {"rnn": eqx.filter_eval_shape(eqx.nn.LSTMCell, n_in, hidden, key=jax.random.key(0))}
    t = {
        "lstm.weight_ih": _random(4 * hidden, n_in),
        "lstm.weight_hh": _random(4 * hidden, hidden),
        "lstm.bias_ih": _random(4 * hidden),
        "lstm.bias_hh": _random(4 * hidden),
    }
    model = _load(tmp_path, t, like, rename=[(r"^rnn$", "lstm")])
    x, h, c = _random(n_in), _random(hidden), _random(hidden)
    gates = t["lstm.weight_ih"] @ x + t["lstm.bias_ih"] + t["lstm.weight_hh"] @ h + t["lstm.bias_hh"]
    i, f, g, o = np.split(gates, 4)
    c2 = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
    h2 = _sigmoid(o) * np.tanh(c2)
    got_h, got_c = model["rnn"](jnp.asarray(x), (jnp.asarray(h), jnp.asarray(c)))
    _close(got_h, h2)
    _close(got_c, c2)


def test_gru_cell(tmp_path):
    n_in, hidden = 3, 4
    like = {"rnn": eqx.filter_eval_shape(eqx.nn.GRUCell, n_in, hidden, key=jax.random.key(0))}
    t = {
        "gru.weight_ih": _random(3 * hidden, n_in),
        "gru.weight_hh": _random(3 * hidden, hidden),
        "gru.bias_ih": _random(3 * hidden),
        "gru.bias_hh": _random(3 * hidden),
    }
    model = _load(tmp_path, t, like, rename=[(r"^rnn$", "gru")])
    x, h = _random(n_in), _random(hidden)
    xi = np.split(t["gru.weight_ih"] @ x + t["gru.bias_ih"], 3)
    hh = np.split(t["gru.weight_hh"] @ h + t["gru.bias_hh"], 3)
    r, z = _sigmoid(xi[0] + hh[0]), _sigmoid(xi[1] + hh[1])
    n = np.tanh(xi[2] + r * hh[2])
    _close(model["rnn"](jnp.asarray(x), jnp.asarray(h)), (1 - z) * n + z * h)


@pytest.mark.parametrize("mode", ["ema", "batch"])
def test_batch_norm_running_statistics_into_state(tmp_path, mode):
    make = lambda: eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode=mode, inference=True)
    like = eqx.filter_eval_shape(make)
    t = {
        "bn.weight": _random(3),
        "bn.bias": _random(3),
        "bn.running_mean": _random(3),
        "bn.running_var": np.abs(_random(3)) + 0.5,
        "bn.num_batches_tracked": np.array(7),
    }
    save_file(t, str(tmp_path / "bn.safetensors"))
    rename, transform = eqx_ckpt.torch_layout(like, rename=[(r"^$", "bn")])
    # The step counter (or first-time flag) is not in PyTorch's state dict: initialised.
    model, state = eqx_ckpt.load_or_initialise(tmp_path / "bn.safetensors", make, rename=rename, transform=transform)
    x = _random(2, 3, 4)
    out, _ = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(jnp.asarray(x), state)
    shape = (1, 3, 1)
    expected = (x - t["bn.running_mean"].reshape(shape)) / np.sqrt(t["bn.running_var"].reshape(shape) + 1e-5)
    _close(out, expected * t["bn.weight"].reshape(shape) + t["bn.bias"].reshape(shape))


def test_layers_inside_a_model_and_leaves_outside_layers(tmp_path):
    class Net(eqx.Module):
        blocks: list
        scale: jax.Array

        def __init__(self, key):
            self.blocks = [eqx.nn.Linear(2, 2, key=k) for k in jax.random.split(key, 2)]
            self.scale = jnp.ones(2)

    like = eqx.filter_eval_shape(Net, jax.random.key(0))
    t = {f"h.{i}.fc.{p}": _random(2, 2) if p == "weight" else _random(2) for i in range(2) for p in ("weight", "bias")}
    t["ln_f.g"] = _random(2)
    model = _load(tmp_path, t, like, rename=[(r"^blocks\.(\d+)", r"h.\1.fc"), (r"^scale$", "ln_f.g")])
    for i in range(2):
        _close(model.blocks[i].weight, t[f"h.{i}.fc.weight"])
    _close(model.scale, t["ln_f.g"])


def test_a_rule_to_none_skips_the_layer_and_a_bad_rule_is_explained(tmp_path):
    like = {"a": eqx.nn.Linear(2, 2, key=jax.random.key(0)), "b": eqx.nn.Linear(2, 2, key=jax.random.key(1))}
    t = {"a.weight": _random(2, 2), "a.bias": _random(2)}
    model = _load(tmp_path, t, like, rename=[(r"^b$", None)])
    _close(model["a"].weight, t["a.weight"])
    assert model["b"] is like["b"] or tree_equal(model["b"], like["b"])
    with pytest.raises(
        eqx_ckpt.CheckpointValueError, match=re.escape("`rename` rules must be `(pattern, replacement)`")
    ):
        eqx_ckpt.torch_layout(like, rename=["a"])


def _norm_and_gain_state_dict(tmp_path):
    t = {
        "bn.weight": _random(3),
        "bn.bias": _random(3),
        "bn.running_mean": _random(3),
        "bn.running_var": np.abs(_random(3)) + 0.5,
        "scale": _random(3),
    }
    save_file(t, str(tmp_path / "net.safetensors"))
    return tmp_path / "net.safetensors", t


def test_rules_mean_the_same_paths_for_layers_and_bare_leaves_of_a_model_and_state(tmp_path):
    """Issue 40, item 4: with `like = (model, state)`, `^gain$` once met `0.gain`
    and matched nothing, and `load_or_initialise` kept the initial gain."""
    path, t = _norm_and_gain_state_dict(tmp_path)
    make = lambda: eqx.nn.make_with_state(NormAndGain)()
    like = eqx.filter_eval_shape(make)
    rename, transform = eqx_ckpt.torch_layout(like, rename=[(r"^norm$", "bn"), (r"^gain$", "scale")])
    model, state = eqx_ckpt.load_or_initialise(path, make, rename=rename, transform=transform)
    np.testing.assert_array_equal(np.asarray(model.gain), t["scale"])
    np.testing.assert_array_equal(np.asarray(model.norm.weight), t["bn.weight"])
    mean, var = state.get(model.norm.ema_state_index)
    np.testing.assert_array_equal(np.asarray(mean), t["bn.running_mean"])
    np.testing.assert_array_equal(np.asarray(var), t["bn.running_var"])
    # A bare leaf no rule renames is the tensor of its path inside the model (PyTorch names no `0.`).
    save_file({**t, "gain": t["scale"] * 2}, str(path))
    rename, transform = eqx_ckpt.torch_layout(like, rename=[(r"^norm$", "bn")])
    model, _ = eqx_ckpt.tree_deserialise_leaves(path, like, rename=rename, transform=transform, missing="keep")
    np.testing.assert_array_equal(np.asarray(model.gain), t["scale"] * 2)


@pytest.mark.parametrize("tupled", [True, False], ids=["model_and_state", "model"])
def test_a_torch_layout_rule_that_matches_no_path_is_refused(tmp_path, tupled):
    path, _ = _norm_and_gain_state_dict(tmp_path)
    make = (lambda: eqx.nn.make_with_state(NormAndGain)()) if tupled else NormAndGain
    like = eqx.filter_eval_shape(make)
    # The whole tuple's paths, a typo, and a rule an earlier one shadows: none matches a path of the model.
    rules = [(r"^norm$", "bn"), (r"^0\.gain$", "scale"), (r"^gian$", "scale"), (r"^no", "x")]
    with pytest.raises(eqx_ckpt.CheckpointValueError) as info:
        eqx_ckpt.torch_layout(like, rename=rules)
    message = str(info.value)
    said = "3 `rename` rules of `torch_layout` match no path (or only paths an earlier rule takes): "
    assert re.search(re.escape(said + "('^0\\\\.gain$', 'scale'); ('^gian$', 'scale'); ('^no', 'x')."), message)
    inside = "inside the model (`like[0]`: `norm`, not `0.norm`)" if tupled else "of `like`"
    assert re.search(re.escape(f"dotted paths {inside}, of stock layers and of leaves outside them alike"), message)
    assert re.search(re.escape("The model's layers: `norm`; its leaves outside layers: `gain`."), message)
    # Refused before any load starts: `load_or_initialise` never keeps `gain`'s initial value for it.
    with pytest.raises(eqx_ckpt.CheckpointValueError, match=re.escape("`rename` rule of `torch_layout` matches")):
        eqx_ckpt.load_or_initialise(path, make, rename=eqx_ckpt.torch_layout(like, rename=[(r"^gian$", "scale")])[0])
