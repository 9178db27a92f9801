"""MkDocs hooks of the documentation site (mkdocs.yml's `hooks:`).

- The notebooks of `notebooks/` become pages of the site (`notebooks/<name>/`),
  as they are stored: Markdown cells as Markdown, code cells as Python blocks,
  the outputs saved with them as text or images; each page links to its
  `.ipynb`, which the site also serves. No notebook is run by the build and no
  plugin is needed: `tests/docs/test_notebooks.py` runs them.
- The build refuses to run without ruff or black, which wrap signatures.
- The footer names the package version (and the site links to the repository
  when `pyproject.toml` has a `[project.urls]` `Repository`), read from
  `pyproject.toml`, the one place they are written.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).parent
NOTEBOOKS = ROOT / "notebooks"


def on_config(config: Any) -> Any:
    if importlib.util.find_spec("ruff") is None and importlib.util.find_spec("black") is None:
        # mkdocstrings would leave every signature one long line, with a scrollbar.
        raise PluginError(
            "Signatures are wrapped by ruff (or black), and neither is installed: "
            'install the docs extra (`pip install -c constraints.txt -e ".[docs]"`).'
        )
    project = _project()
    version = project.get("version")
    if version:
        license_name = (project.get("license") or {}).get("text")
        config.copyright = f"eqx_ckpt {version}" + (f" · {license_name} license" if license_name else "")
    repository = (project.get("urls") or {}).get("Repository")
    if repository and not config.repo_url:
        config.repo_url = repository
    return config


def on_files(files: Files, config: Any) -> Files:
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(File.generated(config, f"notebooks/{notebook.stem}.md", content=page(notebook)))
        files.append(File.generated(config, f"notebooks/{notebook.name}", content=notebook.read_bytes()))
    return files


def page(notebook: pathlib.Path) -> str:
    """The Markdown page of a notebook (an `.ipynb`: JSON, never executed here)."""
    cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
    parts = []
    for cell in cells:
        source = _text(cell.get("source", ""))
        if cell.get("cell_type") == "markdown":
            parts.append(source)
        elif cell.get("cell_type") == "code" and source.strip():
            parts.append(_fenced("python", source))
            parts.extend(filter(None, (_output(output) for output in cell.get("outputs", []))))
    # After the title, where the first cell has one.
    link = f"[Download this notebook]({notebook.name}) (`notebooks/{notebook.name}` in the repository)."
    at = 1 if parts and parts[0].lstrip().startswith("# ") else 0
    if at:
        title, _, rest = parts[0].lstrip().partition("\n")
        parts[0:1] = [title, link, rest] if rest.strip() else [title, link]
    else:
        parts.insert(0, link)
    return "\n\n".join(part.strip("\n") for part in parts) + "\n"


def _output(output: dict[str, Any]) -> str | None:
    kind = output.get("output_type")
    if kind == "stream":
        return _fenced("text", _text(output.get("text", "")))
    if kind in ("execute_result", "display_data"):
        data = output.get("data", {})
        if "image/png" in data:
            return f"![output](data:image/png;base64,{_text(data['image/png']).strip()})"
        if "text/plain" in data:
            return _fenced("text", _text(data["text/plain"]))
    return None  # errors and kinds a static page cannot show


def _text(value: str | list[str]) -> str:
    return value if isinstance(value, str) else "".join(value)


def _fenced(language: str, text: str) -> str:
    # A fence longer than any run of backticks inside.
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", text)), default=0))
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def _project() -> dict[str, Any]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:  # Python 3.10: the version line is enough
        match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
        return {"version": match.group(1)} if match else {}
    return tomllib.loads(text).get("project", {})
