"""Writing manifests as an attacker (or an older eqx_ckpt) would: edited JSON,
signed again so that only the library's own checks can refuse it."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np

from eqx_ckpt._ondisk import _manifest


def sign(body: Any) -> bytes:
    """`body` as a current (version 4) manifest with a valid digest; anything
    but a JSON object is written as it is."""
    if not isinstance(body, dict):
        return json.dumps(body).encode()
    body = dict(body)
    body.pop("digest", None)
    leaves = body.pop("leaves")
    if not isinstance(leaves, list):  # as a damaged manifest has it
        text = _manifest._head(body) + json.dumps(leaves).encode()
        return text + _manifest._tail(hashlib.sha256(text))
    return _manifest._encoded(body, _manifest._records_text(leaves, None))


def as_version(body: dict[str, Any], version: int) -> bytes:
    """`body` (read from a version 4 manifest) as version `version` < 4 wrote it:
    every leaf field spelled out, `nbytes` included, the digest over the content
    with keys sorted."""
    body = dict(body, format_version=version)
    leaves = []
    for leaf in body["leaves"]:
        full = dict(leaf)
        full.setdefault("stored_shape", leaf["shape"])
        full.setdefault("stored_dtype", leaf["dtype"])
        full.setdefault("encoding", "plain")
        full.setdefault("impl", "")
        full.setdefault("chunks", [max(1, n) for n in full["stored_shape"]])
        itemsize = _manifest_itemsize(full["stored_dtype"])
        full["nbytes"] = math.prod(full["stored_shape"]) * itemsize
        leaves.append(full)
    body["leaves"] = leaves
    body.pop("digest", None)
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["digest"] = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    return json.dumps(body, indent=1).encode()


def _manifest_itemsize(name: str) -> int:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, name)).itemsize
