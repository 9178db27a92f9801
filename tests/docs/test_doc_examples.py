"""Every ```python block of README.md and docs/*.md runs as written.

A page's blocks run in order, as one script (later blocks use what earlier ones
define), in a fresh process (tests/support/doc_runner.py) whose working directory is a
fresh empty folder, with warnings as errors. A page added to docs/ is picked
up. A comment before a block (a blank line between) marks the few that need more:

- `<!-- doc-test: s3 -->`: runs against the S3 server the tests start
  (tests/s3_server.py): `AWS_ENDPOINT_URL` and test credentials are set for the
  page, the buckets the block names are created, and the example endpoint
  `http://minio.internal:9000` is replaced by the server's;
- `<!-- doc-test: http -->`: the page's working directory is served over HTTP
  (tests/support/http_server.py) at the example host `https://models.example.com`;
- `<!-- doc-test: hub -->`: reaches the Hugging Face Hub: the page runs with
  `HF_ENDPOINT` pointing at the local Hub server the tests start
  (tests/support/hub_server.py), with a cache of its own and a token;
- `<!-- doc-test: file: NAME -->`: written to the file NAME in the page's
  working directory (a module later blocks import: docs/structure.md's
  `mymodels.py`), not run;
- `<!-- doc-test: skip: REASON -->`: not run here, for the reason given
  (several processes, a cluster, a script another test runs); each is
  reported as a skipped test with its reason.
"""

import dataclasses
import json
import os
import pathlib
import re
import urllib.request

import equinox as eqx
import http_server
import hub_server
import jax
import jax.numpy as jnp
import numpy as np
import places
import prefork
import pytest

import eqx_ckpt

ROOT = places.ROOT
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- doc-test: (s3|http|hub|skip|file)(?:: (.+?))? -->$", re.M)
# The example hosts the pages name, and the test servers that stand in for them.
S3_HOST = "http://minio.internal:9000"
HTTP_HOST = "https://models.example.com"
AWS_SDK_LOG = re.compile(r"[EW]\d{4} [\d:.]+ +\d+ AuthCredentialsProvider:\d+\] ")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the block's first line of code
    code: str
    marker: str  # "" (plain), "s3", "http", "hub", "file" or "skip"
    reason: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: pathlib.Path) -> list[Block]:
    """The ```python blocks of `page`, each with the marker on the line before it."""
    text = page.read_text()
    found = []
    for fence in re.finditer(r"^```python\n(.*?)^```$", text, re.M | re.S):
        before = text[: fence.start()].rstrip("\n").rpartition("\n")[2]
        marker = MARKER.fullmatch(before)
        line = text.count("\n", 0, fence.start(1)) + 1
        kind, reason = (marker.group(1), marker.group(2) or "") if marker else ("", "")
        found.append(Block(str(page.relative_to(ROOT)), line, fence.group(1), kind, reason))
    return found


ALL = [block for page in PAGES for block in blocks(page)]
RUN = sorted({block.page for block in ALL if block.marker != "skip"})
SKIPPED = [block for block in ALL if block.marker == "skip"]


def test_every_marker_stands_before_a_python_block():
    """A marker that no longer precedes a block (the block moved, or the fence
    changed) would silently run a block it was not meant for, or none."""
    for page in PAGES:
        text = page.read_text()
        written = re.findall(r"^<!-- doc-test.*", text, re.M)
        assert len(written) == len(MARKER.findall(text)), (
            f"{page.name}: a marker is not as the docstring says: {written}"
        )
        for marker in MARKER.finditer(text):
            after = text[marker.end() :]
            assert after.startswith("\n\n```python\n"), (
                f"{page.name}: {marker.group(0)} is not followed by a python block"
            )
            assert marker.group(1) != "skip" or marker.group(2), f"{page.name}: {marker.group(0)} gives no reason"
            assert marker.group(1) != "file" or re.fullmatch(r"\w+\.py", marker.group(2) or ""), (
                f"{page.name}: {marker.group(0)} names no module file"
            )


# `python -W error doc_runner.py BLOCKS.json`, as `prefork` runs it.
RUN_PAGE = (
    "import sys, warnings\n"
    "warnings.simplefilter('error')\n"
    f"sys.path.insert(0, {str(places.SUPPORT)!r})\n"
    "import doc_runner\n"
    "del sys.path[0]\n"
    "sys.exit(doc_runner.main(['doc_runner.py', *sys.argv[1:]]))\n"
)


@pytest.mark.parametrize("page", RUN)
def test_page_runs(page, tmp_path, request):
    runnable = [b for b in ALL if b.page == page and b.marker != "skip"]
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    env.pop("XLA_FLAGS", None)  # the page runs as a user's script would, with one CPU device
    if any(b.marker == "s3" for b in runnable):
        runnable = _against_s3(runnable, request.getfixturevalue("s3"), env)
    with http_server.serving(work) as url, hub_server.serving() as (hub_url, _):
        if any(b.marker == "hub" for b in runnable):
            env.update(HF_ENDPOINT=hub_url, HF_HOME=str(tmp_path / "hf"), HF_TOKEN="writer", HF_HUB_DISABLE_XET="1")
            env.update(HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1")
        runnable = [_against_http(b, url) for b in runnable]
        (tmp_path / "blocks.json").write_text(
            json.dumps({"page": page, "blocks": [dataclasses.asdict(b) for b in runnable]})
        )
        # A new process per page, forked from one that imported JAX (`prefork`): what a page's
        # script would be run as, with warnings as errors from its first line (`-W error`).
        done = prefork.run(["-c", RUN_PAGE, str(tmp_path / "blocks.json")], env=env, cwd=work, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # Nothing said on the side (no warning, no unclosed file), except the AWS
    # SDK's own log lines about the configuration files it looks for.
    said = [line for line in done.stderr.splitlines() if not AWS_SDK_LOG.match(line)]
    assert said == [], done.stderr
    assert done.stdout.splitlines()[-1] == f"ran {len(runnable)} blocks"


def _against_s3(runnable: list[Block], s3, env: dict) -> list[Block]:
    """The page's s3 blocks pointed at the test server, their buckets created."""
    env.update(AWS_ENDPOINT_URL=s3.endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        env.pop(name, None)
    result = []
    for block in runnable:
        if block.marker == "s3":
            for named, url in re.findall(r'"bucket": "([^"]+)"|s3://([^/"]+)', block.code):
                bucket = named or url
                # moto takes unsigned requests; an existing bucket is answered 200 as well.
                urllib.request.urlopen(urllib.request.Request(f"{s3.endpoint}/{bucket}", method="PUT")).close()
            block = dataclasses.replace(block, code=block.code.replace(S3_HOST, s3.endpoint))
        result.append(block)
    return result


def _against_http(block: Block, url: str) -> Block:
    if block.marker != "http":
        return block
    assert HTTP_HOST in block.code, f"{block.name} is marked http but names no {HTTP_HOST}"
    return dataclasses.replace(block, code=block.code.replace(HTTP_HOST, url))


@pytest.mark.parametrize("block", SKIPPED, ids=lambda b: b.name)
def test_skipped_block(block):
    pytest.skip(f"{block.name} is not run here: {block.reason}")


def test_the_reader_without_eqx_ckpt_reads_what_eqx_ckpt_loads(tmp_path, monkeypatch):
    """docs/format.md's reader (json and tensorstore alone) on a default
    checkpoint that was overwritten once (so its data root is a `gen.` folder),
    with packed leaves of several dtypes and a large leaf in a folder of its own:
    every leaf, with the dtype and values eqx_ckpt loads."""
    page = ROOT / "docs" / "format.md"
    heading = page.read_text().splitlines().index("## Reading a checkpoint without eqx_ckpt") + 1
    reader = next(b for b in blocks(page) if b.line > heading)
    assert "eqx_ckpt" not in reader.code
    monkeypatch.chdir(tmp_path)
    tree = {
        "model": eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)),
        "embed": np.arange(600 * 512, dtype=np.float32).reshape(600, 512),  # 1.2 MB: its own folder
        "table": np.linspace(0, 1, 12).reshape(4, 3).astype(jnp.bfloat16),
        "mask": np.array([True, False, True]),
        "counts": jnp.arange(5, dtype=jnp.int8),
        "lr": 0.5,
        "step": 99,
    }
    eqx_ckpt.tree_serialise_leaves("ckpt", tree)
    eqx_ckpt.tree_serialise_leaves("ckpt", {**tree, "step": 100})
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["data_root"].startswith("gen.")
    assert {leaf["path"] for leaf in manifest["leaves"] if "pack" not in leaf} == {"embed"}
    assert [pack["name"] for pack in manifest["packs"]] == [
        f"packed.{t}" for t in ["bfloat16", "bool", "float32", "float64", "int64", "int8"]
    ]
    namespace: dict = {}
    exec(compile("\n" * (reader.line - 1) + reader.code, reader.page, "exec"), namespace)
    arrays = namespace["arrays"]
    ckpt = eqx_ckpt.Checkpoint("ckpt")
    assert sorted(arrays) == list(ckpt)
    for path in ckpt:
        loaded = ckpt[path]
        expected = np.asarray(loaded.read() if isinstance(loaded, eqx_ckpt.LazyArray) else loaded)
        assert arrays[path].dtype == expected.dtype and arrays[path].shape == expected.shape, path
        np.testing.assert_array_equal(arrays[path], expected, err_msg=path)
    assert arrays["step"] == 100
