"""A process that reaches a local Hub server (tests/support/hub_server.py) as
the Hugging Face Hub, for every test that publishes or loads `hf://` paths:
`Client(url, home).run(code)` runs `code` in a new process (forked from a
template that imported JAX once, `prefork`) with `HF_ENDPOINT` pointing at
the server and a cache of its own, and returns what it `emit`ted.

`Client(url, home, compiled=folder)` has each of its processes keep what JAX
compiles in `folder` and take there what an earlier one compiled (JAX's
persistent compilation cache, every program kept however fast it compiled):
a test of many processes that make and compare the same models compiles
each program once, not once a process (seconds each). What a process
computes is the same; only where its compiled programs come from differs."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import textwrap

import jax.numpy as jnp
import places
import prefork

import eqx_ckpt

# A model family's trees, as code a `Client` runs (`exec`ed to get them here).
FAMILY = """
body = {"w": np.arange(1 << 18, dtype=np.float32).reshape(512, 512), "b": np.ones(512, np.float32)}
base = {"body": body, "head": np.zeros((512, 4), np.float32)}
tuned = {"body": body, "head": np.full((512, 6), 0.5, np.float32)}
"""


PRELUDE = """
import json, os, sys
import numpy as np, jax, jax.numpy as jnp, equinox as eqx, eqx_ckpt
def emit(value):
    print("RESULT " + json.dumps(value), flush=True)
def raised(call):
    try:
        call()
    except Exception as e:
        return [type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e)]
    return None
"""

# Run first in each process of a `Client` given `compiled` (the folder).
COMPILED = """
jax.config.update("jax_compilation_cache_dir", {folder!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
"""


class Client:
    """Runs code in a new process that reaches the server `url` as the Hub, with its cache at `home`."""

    def __init__(self, url: str, home: pathlib.Path, *, compiled: pathlib.Path | None = None):
        self.url, self.home = url, home
        self.prelude = PRELUDE + ("" if compiled is None else COMPILED.format(folder=str(compiled)))
        prefork.start(self.env())  # (its imports overlap with what the test does first)

    def env(self, **extra: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(
            HF_ENDPOINT=self.url,
            HF_HOME=str(self.home),
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_TOKEN="writer",
            JAX_PLATFORMS="cpu",
            PYTHONPATH=os.pathsep.join([str(places.ROOT), str(places.SUPPORT)]),
        )
        for key, value in extra.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def run(self, code: str, **env: str | None) -> object:
        """What `code` (after `PRELUDE`) `emit`ted last, run as `python -c` in a new process."""
        done = prefork.run(
            ["-c", self.prelude + textwrap.dedent(code)], env=self.env(**env), cwd=self.home.parent, timeout=300
        )
        results = [line[len("RESULT ") :] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and results, done.stdout[-3000:] + done.stderr[-6000:]
        return json.loads(results[-1])

    def cli(self, *args: str, **env: str | None) -> subprocess.CompletedProcess:
        """`eqx-ckpt ARGS`, run as `python -m eqx_ckpt._tools._cli ARGS` in a new process."""
        return prefork.run(["-m", "eqx_ckpt._tools._cli", *args], env=self.env(**env), timeout=300)

    def clis(self, *commands: list[str], **env: str | None) -> list[subprocess.CompletedProcess]:
        """`eqx-ckpt ARGS` for each `ARGS` of `commands`, in order, in one new
        process: each the CLI's `main(ARGS)` (what `python -m
        eqx_ckpt._tools._cli ARGS` runs), its exit code and output as
        `cli` gives them. For commands whose answers do not depend on a new
        process: what one leaves in the process, the next one meets."""
        code = """
            import contextlib, io
            from eqx_ckpt._tools._cli import main
            done = []
            for args in COMMANDS:
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    code = main(args)
                done.append([code, out.getvalue(), err.getvalue()])
            emit(done)
        """.replace("COMMANDS", repr([list(map(str, args)) for args in commands]))
        return [
            subprocess.CompletedProcess(["eqx-ckpt", *args], code, out, err)
            for args, (code, out, err) in zip(commands, self.run(code, **env))  # type: ignore[arg-type]
        ]


def tree(scale: float = 1.0) -> dict:
    return {
        "embed": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) * scale,
        "blocks": [
            {"w": jnp.full((128, 64), i + scale, jnp.float32), "b": jnp.arange(64, dtype=jnp.int32)} for i in range(3)
        ],
        "head": jnp.ones((64, 8), jnp.bfloat16) * scale,
    }


def push(client: Client, repo: str, scale: float, tmp: pathlib.Path, **options: object) -> str:
    """Push `tree(scale)` (saved first as a local checkpoint at `tmp/name`) and return the commit."""
    if not (tmp / f"local-{scale}").exists():  # (saved again, it would be another checkpoint: its own time)
        eqx_ckpt.tree_serialise_leaves(tmp / f"local-{scale}", tree(scale))
    args = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return str(
        client.run(
            f"emit(eqx_ckpt.push_to_hub({str(tmp / f'local-{scale}')!r}, {repo!r}{', ' + args if args else ''}))"
        )
    )
