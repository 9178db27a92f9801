"""`push_to_hub`: a tree or a checkpoint, exported and published to the Hugging Face Hub in one commit."""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from collections.abc import Sequence
from typing import Any

from .._base._errors import CheckpointTypeError, CheckpointValueError, option
from .._base._location import HUB_SCHEME, location
from .._base._progress import Progress
from .._load._checkpoint import Checkpoint
from .._ondisk import _published
from .._ondisk._format import MAX_MANIFEST_BYTES
from .._sources import _hub
from .._store import _storage
from ._export import ExportOptions, export


def push_to_hub(
    tree_or_checkpoint_path: Any,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str = "Upload model with eqx_ckpt",
    metadata: dict[str, Any] | None = None,
    prefix: str | None = None,
    license: str | None = None,
    base_model: str | Sequence[str] | None = None,
    code: str | None = None,
    tag: str | None = None,
    base: Any = None,
    standalone: bool = False,
    max_shard_size: int | str = "5GB",
    progress: Progress = None,
) -> Commit:
    """Publish a model to the Hugging Face Hub, in one commit, as files anyone can read.

    1. The tree (or the checkpoint at a path, read leaf by leaf) is exported
        with [`eqx_ckpt.export_safetensors`][] into a temporary folder:
        safetensors, `eqx_ckpt.json` holding its structure, a model card. Host
        memory is bounded as the export's: a shard at a time.
    2. It is committed through `huggingface_hub` (the optional extra `hub`:
        `pip install "eqx_ckpt[hub]"`). The repository is made where there is
        none, and the files are uploaded and committed together. A push that
        made the repository and fails (or is interrupted) before its commit
        deletes it again while it is empty; where it cannot, its error says so.

    Load it back from `hf://owner/name@<revision>` where a checkpoint path is read ([docs/sharing.md](../sharing.md)).

    **Arguments:**

    - `tree_or_checkpoint_path`: a PyTree of arrays, a checkpoint's path (any
        source [`eqx_ckpt.Checkpoint`][] opens, a `CheckpointManager` step
        included), or a `Checkpoint`.
    - `repo_id`: `"owner/name"` (not `hf://owner/name`; a revision is `revision=`).
    - `token`: a Hub token with write access; `None` takes `HF_TOKEN` or the
        one `hf auth login` saved.
    - `private`: make a new repository private (an existing one is left as it is).
    - `revision`: the branch to commit to (made from the default branch
        where there is none); `None`: the default branch.
    - `commit_message`: the commit's message.
    - `metadata`: `info` of [`eqx_ckpt.export_safetensors`][]: your own metadata (a
        `"description"`, hyperparameters, metrics; `"name"` titles the card), kept in
        `eqx_ckpt.json`, shown on the card, and given back by `Checkpoint("hf://owner/name").info`.
        A `CheckpointManager` step pushed without `"metrics"` shows the metrics saved with it.
    - `prefix`: publish only the sub-tree at this dotted path (`"model"`,
        leaving `"opt_state"` out), so that it loads as that sub-tree.
    - `license`, `base_model`, `code`: as for [`eqx_ckpt.export_safetensors`][]: the card's
        license (a Hub license id, `"apache-2.0"`), the repositories it was made from
        (`"owner/name"` or a list), where the classes it trusts come from (a pip requirement or a URL).
    - `tag`: a tag to put on the commit (`"v1.0"`), so that
        `hf://owner/name@v1.0` loads it.
    - `base`: publish a fine-tune as what changed: the `hf://owner/name[@rev]`
        it was fine-tuned from. Only the leaves that differ from it are
        uploaded; loads read the others from it, pinned to its commit, through
        the Hub's cache. The card's `base_model` names it. A push that would
        take under both 10% of its bytes and 1 MiB from the base publishes
        every leaf; the returned commit's `report` says which. A fine-tune
        exported against an `hf://` base is pushed against it without `base=`.
    - `standalone`: publish every leaf, the base's too (see
        [`eqx_ckpt.export_safetensors`][]).
    - `max_shard_size`: as for [`eqx_ckpt.export_safetensors`][].
    - `progress`: the export's progress, as for [`eqx_ckpt.export_safetensors`][];
        the upload shows `huggingface_hub`'s own bars (`HF_HUB_DISABLE_PROGRESS_BARS=1` hides them).

    **Returns:**

    The commit's id (a `str` of 40 hex digits): pass it as
    `hf://owner/name@<id>` to load exactly this version, whatever is pushed
    later. Its attribute `report` says, of a push against a base, what it
    stored and what it took from the base, or that it was written standalone
    (the line `eqx-ckpt push` prints; `None` without a base); `changed` is
    `False` where the branch held this export already and nothing was committed.

    **Warns:**

    [`eqx_ckpt.NeedsCodeWarning`][] naming each part that a load without
    `like` cannot rebuild without the model's code, as the export does.

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt

        model = eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0))
        commit = eqx_ckpt.push_to_hub(model, "me/my-mlp")
        loaded = eqx_ckpt.Checkpoint(f"hf://me/my-mlp@{commit}").load(trust=[])  # no MLP constructor run
        ```
    """
    options = PushOptions(
        repo_id,
        private=private,
        revision=revision,
        commit_message=commit_message,
        tag=tag,
        export=ExportOptions(
            max_shard_size=max_shard_size,
            info=metadata,
            prefix=prefix,
            license=license,
            base_model=base_model,
            code=code,
            base=base,
            standalone=standalone,
            token=token,
            progress=progress,
        ),
    )
    published, report = publish(tree_or_checkpoint_path, options)
    return Commit(published.commit, report=report, changed=published.changed)


class Commit(str):
    """What [`eqx_ckpt.push_to_hub`][] returns: the commit's id (a `str` of 40
    hex digits), with what the push did. `report`: against a base (`base=`),
    the sentence saying what it stored and what it took from the base (or
    that it was written standalone); `None` otherwise. `changed`: `False`
    where the branch held exactly this export already and nothing was committed."""

    report: str | None
    changed: bool

    def __new__(cls, commit: str, *, report: str | None = None, changed: bool = True) -> Commit:
        made = super().__new__(cls, commit)
        made.report, made.changed = report, changed
        return made

    def __reduce__(self) -> tuple[Any, ...]:
        return str, (str(self),)  # (pickled as the plain id it is)


@dataclasses.dataclass(frozen=True)
class PushOptions:
    """A push's options, made once at each public entry: where it commits, and
    the export it commits (its `token` is the push's; its `card_path` the repository's)."""

    repo_id: str
    private: bool = False
    revision: str | None = None
    commit_message: str = "Upload model with eqx_ckpt"
    tag: str | None = None
    export: ExportOptions = dataclasses.field(default_factory=ExportOptions)


def publish(tree_or_checkpoint_path: Any, options: PushOptions) -> tuple[_hub.Published, str | None]:
    """`push_to_hub`, saying also whether it committed (`eqx-ckpt push` says
    "unchanged"), and, against a base, what it stored and took (`Exported.report`)."""
    _check_repo_id(options.repo_id)
    _hub.library()  # the install hint before anything is exported
    token = options.export.token
    reports: list[str | None] = [None]

    def write(folder: str) -> list[str]:
        tree = tree_or_checkpoint_path
        if isinstance(tree, (str, os.PathLike)):  # (a published model read with the token)
            tree = Checkpoint(os.fspath(tree), token=token)
        # The card loads the model by the name it is pushed to: at its branch, quoted as a Hub path spells it.
        at = "" if options.revision is None else "@" + urllib.parse.quote(options.revision, safe="")
        written = export(folder, tree, dataclasses.replace(options.export, card_path=f"hf://{options.repo_id}{at}"))
        given = options.export.base
        if given is None and isinstance(tree, Checkpoint):
            given = tree.base
        _refuse_local_base(folder, given.path if isinstance(given, Checkpoint) else given)
        reports[0] = written.report
        return written.names

    return _hub.publish(write, options, token), reports[0]


def _check_repo_id(repo_id: Any) -> None:
    """`repo_id` is `owner/name`; a Hub path's `hf://` or `@revision` is an error saying what to pass."""
    if isinstance(repo_id, str) and (repo_id.startswith(HUB_SCHEME) or "@" in repo_id):
        name, at, revision = repo_id.removeprefix(HUB_SCHEME).partition("@")
        fix = f'repo_id="{name}", revision="{revision}"' if at else f'repo_id="{name}"'
        what = "a Hub path" if repo_id.startswith(HUB_SCHEME) else "with a revision"
        raise CheckpointValueError(
            f"`repo_id` must be the repository's `owner/name`, not {what} ({repo_id!r}): pass `{fix}`."
        )
    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise CheckpointTypeError(f"`repo_id` must be a string `owner/name`, not {repo_id!r}.")


def _refuse_local_base(folder: str, given: Any) -> None:
    """Refuse a base off the Hub, which a load from the Hub does not read. The
    base is named as `given` (the record's path is relative to the temporary `folder`)."""
    data = _storage.read_file(location(folder), _published.NAME, limit=MAX_MANIFEST_BYTES)
    family = None if data is None else _published.parse(data, where=folder).family
    if family is not None and not family.base.path.startswith(HUB_SCHEME):
        shown = os.fspath(given) if isinstance(given, (str, os.PathLike)) else family.base.path
        push_base = option('`base="hf://owner/base"`', "`--base hf://owner/base`")
        raise CheckpointValueError(
            f"This fine-tune is stored against the base {shown!r}, which is not on the Hub: no one who "
            f"loads it from the Hub could read that. Push the base first and pass {push_base}, or publish every "
            f"leaf with {option('`standalone=True`', '`--standalone`')}."
        )
