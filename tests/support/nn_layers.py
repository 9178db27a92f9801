"""Every public class of `eqx.nn`, built with sensible arguments (not a test
module): the table `tests/ondisk/test_structure.py` walks `eqx.nn` against. A class a
future Equinox adds with no entry here fails that test, naming it."""

import equinox as eqx
import jax
import jax.numpy as jnp

_K = jax.random.key(0)


def _stateful(make):
    """A stateful layer as Equinox builds it: `eqx.nn.make_with_state`."""
    return lambda: eqx.nn.make_with_state(make)()


def _shared():
    embed, linear = eqx.nn.Embedding(4, 3, key=_K), eqx.nn.Linear(3, 4, key=_K)
    return eqx.nn.Shared((embed, linear), lambda pair: pair[1].weight, lambda pair: pair[0].weight)


LAYERS = {
    "PReLU": lambda: eqx.nn.PReLU(),
    "MultiheadAttention": lambda: eqx.nn.MultiheadAttention(2, 4, key=_K),
    "BatchNorm": _stateful(lambda: eqx.nn.BatchNorm(3, "batch", mode="ema")),
    "BatchNorm (no make_with_state)": lambda: eqx.nn.BatchNorm(3, "batch", mode="ema"),
    "Conv": lambda: eqx.nn.Conv(1, 2, 3, 3, key=_K),
    "Conv1d": lambda: eqx.nn.Conv1d(2, 3, 3, key=_K),
    "Conv2d": lambda: eqx.nn.Conv2d(2, 3, 3, key=_K),
    "Conv3d": lambda: eqx.nn.Conv3d(2, 3, 3, key=_K),
    "ConvTranspose": lambda: eqx.nn.ConvTranspose(1, 2, 3, 3, key=_K),
    "ConvTranspose1d": lambda: eqx.nn.ConvTranspose1d(2, 3, 3, key=_K),
    "ConvTranspose2d": lambda: eqx.nn.ConvTranspose2d(2, 3, 3, key=_K),
    "ConvTranspose3d": lambda: eqx.nn.ConvTranspose3d(2, 3, 3, key=_K),
    "Dropout": lambda: eqx.nn.Dropout(0.1),
    "Embedding": lambda: eqx.nn.Embedding(5, 3, key=_K),
    "RotaryPositionalEmbedding": lambda: eqx.nn.RotaryPositionalEmbedding(4),
    "Identity": lambda: eqx.nn.Identity(),
    "Linear": lambda: eqx.nn.Linear(3, 2, key=_K),
    "MLP": lambda: eqx.nn.MLP(2, 2, 4, 2, key=_K),
    "GroupNorm": lambda: eqx.nn.GroupNorm(2, 4),
    "LayerNorm": lambda: eqx.nn.LayerNorm(4),
    "RMSNorm": lambda: eqx.nn.RMSNorm(4),
    "AdaptiveAvgPool1d": lambda: eqx.nn.AdaptiveAvgPool1d(2),
    "AdaptiveAvgPool2d": lambda: eqx.nn.AdaptiveAvgPool2d(2),
    "AdaptiveAvgPool3d": lambda: eqx.nn.AdaptiveAvgPool3d(2),
    "AdaptiveMaxPool1d": lambda: eqx.nn.AdaptiveMaxPool1d(2),
    "AdaptiveMaxPool2d": lambda: eqx.nn.AdaptiveMaxPool2d(2),
    "AdaptiveMaxPool3d": lambda: eqx.nn.AdaptiveMaxPool3d(2),
    "AdaptivePool": lambda: eqx.nn.AdaptivePool(2, 1, jnp.mean),
    "AvgPool1d": lambda: eqx.nn.AvgPool1d(2),
    "AvgPool2d": lambda: eqx.nn.AvgPool2d(2),
    "AvgPool3d": lambda: eqx.nn.AvgPool3d(2),
    "MaxPool1d": lambda: eqx.nn.MaxPool1d(2),
    "MaxPool2d": lambda: eqx.nn.MaxPool2d(2),
    "MaxPool3d": lambda: eqx.nn.MaxPool3d(2),
    "Pool": lambda: eqx.nn.Pool(-jnp.inf, jax.lax.max, 1, 2),
    "GRUCell": lambda: eqx.nn.GRUCell(2, 3, key=_K),
    "LSTMCell": lambda: eqx.nn.LSTMCell(2, 3, key=_K),
    "Lambda": lambda: eqx.nn.Lambda(jax.nn.relu),
    "Sequential": lambda: eqx.nn.Sequential([eqx.nn.Linear(2, 2, key=_K), eqx.nn.Lambda(jax.nn.relu)]),
    "Shared": _shared,
    "SpectralNorm": _stateful(lambda: eqx.nn.SpectralNorm(eqx.nn.Linear(3, 3, key=_K), "weight", key=_K)),
    "State": lambda: eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="ema")[1],
    "SpectralNorm (no make_with_state)": lambda: eqx.nn.SpectralNorm(eqx.nn.Linear(3, 3, key=_K), "weight", key=_K),
    "StateIndex": lambda: eqx.nn.StateIndex(jnp.zeros(3)),
    "WeightNorm": lambda: eqx.nn.WeightNorm(eqx.nn.Linear(3, 3, key=_K)),
}
# Classes with no instance a saved tree holds, by reason.
ABSTRACT = {"StatefulLayer": "an abstract base: `Sequential` asks a layer whether it is one"}
# Layers that do not rebuild without `like`, with the documented reason.
_MARKER = "its `StateIndex` marker is a bare `object()`, whose identity is the state's key"
EXCEPTIONS = {
    "BatchNorm (no make_with_state)": _MARKER,
    "SpectralNorm (no make_with_state)": _MARKER,
    "StateIndex": "its marker is a bare `object()`, whose identity is the state's key",
    "Shared": "it holds the `where` and `get` lambdas and `SharedNode` placeholders",
    "WeightNorm": "it holds a `functools.partial` of a private function",
}
