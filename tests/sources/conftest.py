"""Fixtures of the tests of other sources: model families."""

import pathlib

import pytest
from families import BASES, Family, _base_tree, _finetuned, _make_base

import eqx_ckpt


@pytest.fixture(scope="session")
def compiled(tmp_path_factory) -> pathlib.Path:
    """A folder where the Hub tests' processes keep what JAX compiled for the
    next one (`hub_client.Client(..., compiled=)`), for this session."""
    return tmp_path_factory.mktemp("jax-compiled")


@pytest.fixture(params=BASES)
def family(request, tmp_path) -> Family:
    """A base of each kind and a head-only fine-tune exported against it."""
    if request.param == "checkpoint-unpacked":
        request.getfixturevalue("unpacked")
    base, tree = tmp_path / "base", _base_tree()
    _make_base(request.param, base, tree)
    if request.param == "checkpoint":
        assert {"packed.float32", "packed.bfloat16", "packed.uint32"} <= {p.name for p in base.iterdir()}
    elif request.param == "checkpoint-unpacked":
        assert not list(base.glob("packed.*"))
    elif request.param == "sharded":
        assert len(list(base.glob("model-*.safetensors"))) > 1
    finetuned = _finetuned(tree)
    shard = 200 if request.param == "sharded" else "5GB"
    eqx_ckpt.export_safetensors(tmp_path / "ft", finetuned, base=base, max_shard_size=shard)
    return Family(request.param, base, tmp_path / "ft", tree, finetuned)
