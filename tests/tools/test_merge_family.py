"""`merge` of a fine-tune family on the Hub (issue 87): what it reads, and
the result pushed as a fine-tune of the family's base.

A base and three fine-tunes, each pushed against it (`base=`) so that it
stores only the leaves it changed, on the local Hub server (`hub_server`).
Each merge runs in a new process (`hub_client.Client`); the server's log of
byte ranges (`Hub.ranges`) and of bytes sent (`Hub.sent`) says what each
merge read, tensor by tensor (each file's safetensors header gives where
each tensor's bytes lie)."""

from __future__ import annotations

import importlib.util
import json
import struct

import pytest
from hub_client import Client

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="needs the `hub` extra (huggingface_hub)"
)

MIB = 2**20

# The family, made the same way in every process: float32 leaves of 1 MiB
# (one block of the digests), 2 MiB (two) and small ones; an integer leaf.
# No fine-tune changes `body.norm` or `body.b`.
FAMILY = """
import os, shutil
rng = np.random.default_rng(0)
normal = lambda *shape: rng.standard_normal(shape, np.float32)
base = {"emb": normal(256, 1024), "body": {"w": normal(512, 1024), "b": normal(1024), "norm": normal(256, 1024)},
        "head": {"w": normal(1024, 256), "b": normal(256)}, "count": np.arange(8, dtype=np.int32)}
def tuned(**changed):
    tree = jax.tree.map(lambda x: x, base)
    for dotted, scale in changed.items():
        node, name = tree, dotted.split(".")
        for part in name[:-1]:
            node = node[part]
        node[name[-1]] = node[name[-1]] + np.float32(scale) * normal(*node[name[-1]].shape)
    return tree
TUNED = {"ft1": tuned(**{"head.w": 0.1, "head.b": 0.1}), "ft2": tuned(**{"body.w": 0.2}),
         "ft3": tuned(**{"emb": 0.3, "head.w": -0.1})}
INPUTS = ["hf://me/" + name for name in TUNED]
def local(root):
    # The same models as local checkpoints: the reference merge's inputs.
    for name, tree in {"base": base, **TUNED}.items():
        if not os.path.exists(os.path.join(root, name)):
            eqx_ckpt.tree_serialise_leaves(os.path.join(root, name), tree)
    return [os.path.join(root, name) for name in TUNED], os.path.join(root, "base")
def leaves(path):
    return {k: np.asarray(v) for k, v in eqx_ckpt.Checkpoint(path).items()}
def same_bytes(a, b):
    a, b = leaves(a), leaves(b)
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)
"""

# Each merge: the options, and the leaves it merges.
MERGES = {
    "task": ({"method": "task_arithmetic", "weights": [0.5, 0.3, 0.2]}, None),
    "ties": ({"method": "ties", "density": 0.4}, None),
    "where": ({"method": "task_arithmetic", "where": "head"}, ["head.b", "head.w"]),
}


def _files(state, repo):
    """The files of `repo` at the head of main, by path: their sha256 (the name
    LFS files' ranges are logged under)."""
    hub_repo = state.repos[repo]
    return hub_repo.commits[hub_repo.branches["main"]]


def _tensors(data: bytes) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes lie in a safetensors file."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    return {k: (8 + length + v["data_offsets"][0], 8 + length + v["data_offsets"][1]) for k, v in header.items()}


def _reads(state):
    """What was read of each safetensors file of each repository: {(repo,
    file): {tensor: bytes read of it}}, counting every range logged; and the
    bytes each file sent that no range asked for (a whole download)."""
    read, whole = {}, {}
    for repo in state.repos:
        for name, sha in _files(state, repo).items():
            if not name.endswith(".safetensors"):
                continue
            tensors = _tensors(state.blobs[sha])
            counts = dict.fromkeys(tensors, 0)
            ranged = 0
            for counted, start, end in state.ranges:
                if counted != sha:
                    continue
                ranged += end - start
                for tensor, (a, b) in tensors.items():
                    counts[tensor] += max(0, min(b, end) - max(a, start))
            read[(repo, name)] = {t: n for t, n in counts.items() if n}
            whole[(repo, name)] = state.sent.get(sha, 0) - ranged
    return read, whole


@pytest.fixture
def family(hub, tmp_path):
    """The family pushed (`me/base`, `me/ft1`..`me/ft3`); the client that merges, cold."""
    client, state = hub
    said = client.run(
        FAMILY
        + """
eqx_ckpt.push_to_hub(base, "me/base")
for name, tree in TUNED.items():
    eqx_ckpt.push_to_hub(tree, "me/" + name, base="hf://me/base")
emit([sorted(eqx_ckpt.Checkpoint(p).from_base()) for p in INPUTS])
"""
    )
    everything = ["body.b", "body.norm", "body.w", "count", "emb", "head.b", "head.w"]
    stored = {"ft1": ["head.b", "head.w"], "ft2": ["body.w"], "ft3": ["emb", "head.w"]}
    assert said == [sorted(set(everything) - set(s)) for s in stored.values()]
    for name in stored:
        assert "finetune.safetensors" in _files(state, f"me/{name}")
    return Client(client.url, tmp_path / "merger"), state, stored


@pytest.mark.parametrize("merge", MERGES)
def test_a_family_merged_from_the_hub_reads_only_what_it_needs(family, merge):
    """Each fine-tune's file is read only for the leaves it stores (and only
    those `where` selects), each stored block once; every leaf a fine-tune
    takes from the base, and the base's own, is read from the base once per
    merge, not once per input; leaves outside `where` only as the first
    input's; no file whole. The result is the merge of the same models saved
    locally, bit for bit (task arithmetic: the in-memory formula, too)."""
    client, state, stored = family
    options, selected = MERGES[merge]
    state.ranges.clear()
    state.sent.clear()
    result = client.run(
        FAMILY
        + f"""
options = {options!r}
eqx_ckpt.merge("merged", INPUTS, base="hf://me/base", **options)
inputs, base_path = local("local")
eqx_ckpt.merge("reference", inputs, base=base_path, **options)
formula = None
if options["method"] == "task_arithmetic" and "where" not in options:
    got, ins, b = leaves("merged"), [leaves(p) for p in inputs], leaves(base_path)
    ws = [np.float32(w) for w in options["weights"]]
    def want(k):
        total = ws[0] * (ins[0][k] - b[k])
        for x, w in zip(ins[1:], ws[1:]):
            total = total + w * (x[k] - b[k])
        return b[k] + total
    formula = all(got[k].tobytes() == (want(k) if k != "count" else ins[0][k]).tobytes() for k in got)
emit([same_bytes("merged", "reference"), formula])
"""
    )
    assert result[0] is True, result
    assert result[1] in (True, None), result
    read, whole = _reads(state)
    assert all(n == 0 for n in whole.values()), whole  # nothing downloaded whole
    chosen = lambda leaves: [k for k in leaves if selected is None or k in selected]
    sizes = {"emb": MIB, "body.w": 2 * MIB, "body.b": 4096, "body.norm": MIB, "head.w": MIB, "head.b": 1024}
    for name, own in stored.items():
        got = read.get((f"me/{name}", "finetune.safetensors"), {})
        # Only the stored leaves the merge merges, each read once (TIES too: a
        # window of a leaf up to 64 MiB is the whole leaf, kept for both passes).
        want = {k: sizes[k] for k in chosen(own)}
        assert got == want, (name, got)
    # The base: each merged leaf once, whoever takes it; the first input's
    # other leaves (outside `where`), which it takes from the base, once.
    base_read = read[("me/base", "model.safetensors")]
    want = dict(sizes)
    if selected is not None:
        want = {k: n for k, n in sizes.items() if k in selected or k not in stored["ft1"]}
    want["count"] = 32  # (not a float: the first input's, which takes it from the base)
    assert base_read == want, base_read


def test_a_merge_is_pushed_as_a_fine_tune_of_the_base_and_its_card_says_how_it_was_made(family):
    """The merge of the family, pushed against the family's base, stores only
    the leaves that differ from it and loads bit for bit with it, cold; its
    card names the method, each input at its commit with its weight, the
    base at its commit and the density, and its front matter lists the base
    and the inputs as the base models of a merge."""
    client, state, _ = family
    options = {"method": "ties", "density": 0.4, "weights": [1.0, 0.5, 0.25]}
    pushed = client.run(
        FAMILY
        + f"""
eqx_ckpt.merge("merged", INPUTS, base="hf://me/base", **{options!r})
emit(eqx_ckpt.push_to_hub("merged", "me/merged", base="hf://me/base"))
"""
    )
    files = _files(state, "me/merged")
    assert pushed == state.repos["me/merged"].branches["main"]
    assert "finetune.safetensors" in files and "model.safetensors" not in files
    record = json.loads(state.blobs[files["eqx_ckpt.json"]])
    taken = {leaf["path"] for leaf in record["leaves"] if "base" in leaf}
    assert taken == {"body.b", "body.norm", "count"}  # (no input changed them: the merge is the base there)
    stored = _tensors(state.blobs[files["finetune.safetensors"]])
    assert sorted(stored) == ["body.w", "emb", "head.b", "head.w"]
    # Cold, in a new process: the same model as the merge saved, bit for bit.
    loaded = Client(client.url, client.home.parent / "cold").run(
        FAMILY
        + """
eqx_ckpt.merge("again", INPUTS, base="hf://me/base", method="ties", density=0.4, weights=[1.0, 0.5, 0.25])
pushed, saved = eqx_ckpt.Checkpoint("hf://me/merged").load(trust=[]), eqx_ckpt.Checkpoint("again").load(trust=[])
emit([bool(eqx.tree_equal(pushed, saved, typematch=True)), eqx_ckpt.Checkpoint("hf://me/merged").base])
"""
    )
    commit = lambda repo: state.repos[repo].branches["main"]
    assert loaded == [True, f"hf://me/base@{commit('me/base')}"]
    card = state.blobs[files["README.md"]].decode()
    # The Hub draws the merge's parents in its model tree: the base, then each input.
    parents = "".join(f'- "me/{name}"\n' for name in ("base", "ft1", "ft2", "ft3"))
    front = f"base_model:\n{parents}base_model_relation: merge\ntags:\n- jax\n- equinox\n- merge\n---\n"
    assert front in card and "metrics:" not in card.split("---")[1], card
    said = (
        "A merge of 3 models by `ties`, made by `eqx_ckpt.merge`: "
        f"base `hf://me/base@{commit('me/base')}`, density `0.4`. "
    )
    assert said in card, card
    table = "| input | weight |\n|---|---:|\n" + "".join(
        f"| `hf://me/{name}@{commit(f'me/{name}')}` | {weight} |\n"
        for name, weight in zip(("ft1", "ft2", "ft3"), options["weights"])
    )
    assert table in card, card
