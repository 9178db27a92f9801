"""Equinox modules the tests of PyTorch layouts share (not a test module)."""

import equinox as eqx
import jax
import jax.numpy as jnp


class NormAndGain(eqx.Module):
    """A stock layer beside a bare parameter outside any layer."""

    norm: eqx.nn.BatchNorm
    gain: jax.Array

    def __init__(self):
        self.norm = eqx.nn.BatchNorm(3, "batch", mode="ema", inference=True)
        self.gain = jnp.full(3, -1.0)
