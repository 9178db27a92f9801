"""Hugging Face-style checkpoints of a small Llama-like and a GPT-2-like model,
with their real tensor names, sharded into several safetensors files, loaded
into Equinox models by rules, and run: the outputs match NumPy forward passes
computed straight from the PyTorch-named tensors."""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import eqx_ckpt

V, E, HEADS, LAYERS, T = 32, 16, 2, 2, 6
RNG = np.random.default_rng(1)


def _random(*shape, scale=0.2):
    return (scale * RNG.standard_normal(shape)).astype(np.float32)


def _save_sharded(directory, tensors, groups):
    """Write `tensors` as Hugging Face does: `model-0000i-of-0000n.safetensors` + index."""
    directory.mkdir()
    weight_map = {}
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    assert sorted(weight_map) == sorted(tensors)
    total = sum(t.nbytes for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return directory


def _attention_np(q, k, v):
    """Causal multi-head attention on (T, E) arrays, heads split as PyTorch views them."""
    split = lambda a: a.reshape(a.shape[0], HEADS, -1).transpose(1, 0, 2)
    q, k, v = split(q), split(k), split(v)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((len(scores[0]), len(scores[0])), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ v).transpose(1, 0, 2).reshape(-1, HEADS * q.shape[-1])


def _attention_jax(q, k, v):
    split = lambda a: a.reshape(a.shape[0], HEADS, -1).transpose(1, 0, 2)
    q, k, v = split(q), split(k), split(v)
    scores = q @ k.transpose(0, 2, 1) / jnp.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool)), scores, -jnp.inf)
    return (jax.nn.softmax(scores, axis=-1) @ v).transpose(1, 0, 2).reshape(-1, E)


# --- Llama-like ---------------------------------------------------------------


class LlamaBlock(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 7)
        self.attn_norm, self.mlp_norm = (eqx.nn.RMSNorm(E, eps=1e-6, use_bias=False) for _ in range(2))
        self.q, self.k, self.v, self.o = (eqx.nn.Linear(E, E, use_bias=False, key=k) for k in keys[:4])
        self.gate = eqx.nn.Linear(E, 2 * E, use_bias=False, key=keys[4])
        self.up = eqx.nn.Linear(E, 2 * E, use_bias=False, key=keys[5])
        self.down = eqx.nn.Linear(2 * E, E, use_bias=False, key=keys[6])

    def __call__(self, x):
        h = jax.vmap(self.attn_norm)(x)
        x = x + jax.vmap(self.o)(_attention_jax(jax.vmap(self.q)(h), jax.vmap(self.k)(h), jax.vmap(self.v)(h)))
        h = jax.vmap(self.mlp_norm)(x)
        return x + jax.vmap(self.down)(jax.nn.silu(jax.vmap(self.gate)(h)) * jax.vmap(self.up)(h))


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS + 2)
        self.embed = eqx.nn.Embedding(V, E, key=keys[0])
        self.blocks = [LlamaBlock(k) for k in keys[2:]]
        self.norm = eqx.nn.RMSNorm(E, eps=1e-6, use_bias=False)
        self.head = eqx.nn.Linear(E, V, use_bias=False, key=keys[1])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def _llama_tensors():
    t = {
        "model.embed_tokens.weight": _random(V, E),
        "model.norm.weight": 1 + _random(E),
        "lm_head.weight": _random(V, E),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + _random(E)
        t[p + "post_attention_layernorm.weight"] = 1 + _random(E)
        for name in "qkvo":
            t[p + f"self_attn.{name}_proj.weight"] = _random(E, E)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = _random(2 * E, E), _random(2 * E, E)
        t[p + "mlp.down_proj.weight"] = _random(E, 2 * E)
    return t


def _llama_np(t, tokens):
    rms = lambda x, w: x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * w
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q, k, v = (h @ t[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        x = x + _attention_np(q, k, v) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


LLAMA_RULES = [
    (r"^embed$", "model.embed_tokens"),
    (r"^blocks\.(\d+)\.attn_norm$", r"model.layers.\1.input_layernorm"),
    (r"^blocks\.(\d+)\.(q|k|v|o)$", r"model.layers.\1.self_attn.\2_proj"),
    (r"^blocks\.(\d+)\.mlp_norm$", r"model.layers.\1.post_attention_layernorm"),
    (r"^blocks\.(\d+)\.(gate|up|down)$", r"model.layers.\1.mlp.\2_proj"),
    (r"^norm$", "model.norm"),
    (r"^head$", "lm_head"),
]


def test_llama_like(tmp_path):
    t = _llama_tensors()
    layer = lambda i: [n for n in t if n.startswith(f"model.layers.{i}.")]
    groups = [
        ["model.embed_tokens.weight"],
        *(layer(i) for i in range(LAYERS)),
        ["model.norm.weight", "lm_head.weight"],
    ]
    directory = _save_sharded(tmp_path / "llama", t, groups)
    like = eqx.filter_eval_shape(Llama, jax.random.key(0))
    rename, transform = eqx_ckpt.torch_layout(like, rename=LLAMA_RULES)
    model = eqx_ckpt.tree_deserialise_leaves(directory, like, rename=rename, transform=transform, strict=True)
    tokens = np.array([3, 1, 4, 1, 5, 9])
    np.testing.assert_allclose(
        np.asarray(eqx.filter_jit(model)(jnp.asarray(tokens))), _llama_np(t, tokens), rtol=1e-4, atol=1e-5
    )
    # Lazily, and only the first block: the rest stay abstract.
    lazy = eqx_ckpt.tree_deserialise_leaves(
        directory, like, rename=rename, where=lambda m: m.blocks[0], lazy=True, transform=transform
    )
    assert isinstance(lazy.blocks[0].q.weight, eqx_ckpt.LazyArray)
    assert isinstance(lazy.blocks[1].q.weight, jax.ShapeDtypeStruct)
    np.testing.assert_array_equal(np.asarray(lazy.blocks[0].q.weight), t["model.layers.0.self_attn.q_proj.weight"])


# --- GPT-2-like ---------------------------------------------------------------


class GPT2Block(eqx.Module):
    ln_1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    ln_2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.ln_1, self.ln_2 = eqx.nn.LayerNorm(E), eqx.nn.LayerNorm(E)
        self.qkv, self.proj = eqx.nn.Linear(E, 3 * E, key=keys[0]), eqx.nn.Linear(E, E, key=keys[1])
        self.fc, self.out = eqx.nn.Linear(E, 4 * E, key=keys[2]), eqx.nn.Linear(4 * E, E, key=keys[3])

    def __call__(self, x):
        q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.ln_1)(x)), 3, axis=-1)
        x = x + jax.vmap(self.proj)(_attention_jax(q, k, v))
        return x + jax.vmap(self.out)(jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.ln_2)(x)), approximate=True))


class GPT2(eqx.Module):
    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    blocks: list
    ln_f: eqx.nn.LayerNorm

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS + 2)
        self.wte, self.wpe = eqx.nn.Embedding(V, E, key=keys[0]), eqx.nn.Embedding(8, E, key=keys[1])
        self.blocks = [GPT2Block(k) for k in keys[2:]]
        self.ln_f = eqx.nn.LayerNorm(E)

    def __call__(self, tokens):
        x = jax.vmap(self.wte)(tokens) + self.wpe.weight[: len(tokens)]
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.ln_f)(x) @ self.wte.weight.T


def _gpt2_tensors():
    t = {
        "wte.weight": _random(V, E),
        "wpe.weight": _random(8, E),
        "ln_f.weight": 1 + _random(E),
        "ln_f.bias": _random(E),
    }
    for i in range(LAYERS):
        p = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            t[p + f"{ln}.weight"], t[p + f"{ln}.bias"] = 1 + _random(E), _random(E)
        # GPT-2's Conv1D keeps its weight as (in, out), the transpose of nn.Linear's.
        for name, n_in, n_out in [
            ("attn.c_attn", E, 3 * E),
            ("attn.c_proj", E, E),
            ("mlp.c_fc", E, 4 * E),
            ("mlp.c_proj", 4 * E, E),
        ]:
            t[p + f"{name}.weight"], t[p + f"{name}.bias"] = _random(n_in, n_out), _random(n_out)
        # The causal-mask buffer old GPT-2 checkpoints carry: not a parameter.
        t[p + "attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
    return t


def _gpt2_np(t, tokens):
    ln = lambda x, p: (
        (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * t[p + ".weight"] + t[p + ".bias"]
    )
    conv1d = lambda x, p: x @ t[p + ".weight"] + t[p + ".bias"]
    gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    x = t["wte.weight"][tokens] + t["wpe.weight"][: len(tokens)]
    for i in range(LAYERS):
        p = f"h.{i}."
        q, k, v = np.split(conv1d(ln(x, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
        x = x + conv1d(_attention_np(q, k, v), p + "attn.c_proj")
        x = x + conv1d(gelu(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return ln(x, "ln_f") @ t["wte.weight"].T


GPT2_RULES = [
    (r"^blocks\.(\d+)\.qkv\.", r"h.\1.attn.c_attn."),
    (r"^blocks\.(\d+)\.proj\.", r"h.\1.attn.c_proj."),
    (r"^blocks\.(\d+)\.fc\.", r"h.\1.mlp.c_fc."),
    (r"^blocks\.(\d+)\.out\.", r"h.\1.mlp.c_proj."),
    (r"^blocks\.(\d+)\.", r"h.\1."),
]
GPT2_TRANSFORM = [(r"^blocks\.\d+\.(qkv|proj|fc|out)\.weight$", np.transpose)]


def test_gpt2_like(tmp_path):
    t = _gpt2_tensors()
    names = sorted(t)
    directory = _save_sharded(tmp_path / "gpt2", t, [names[: len(names) // 3], names[len(names) // 3 :]])
    like = eqx.filter_eval_shape(GPT2, jax.random.key(0))
    model = eqx_ckpt.tree_deserialise_leaves(directory, like, rename=GPT2_RULES, transform=GPT2_TRANSFORM)
    tokens = np.array([2, 7, 1, 8, 2, 8])
    np.testing.assert_allclose(
        np.asarray(eqx.filter_jit(model)(jnp.asarray(tokens))), _gpt2_np(t, tokens), rtol=1e-4, atol=1e-5
    )
    # Asked for, the unused mask buffers are reported, by name.
    with pytest.raises(eqx_ckpt.LeafError, match=re.escape("`h.0.attn.bias`: unexpected")) as info:
        eqx_ckpt.tree_deserialise_leaves(directory, like, rename=GPT2_RULES, transform=GPT2_TRANSFORM, strict=True)
    assert sorted(info.value.dotted) == ["h.0.attn.bias", "h.1.attn.bias"]
