"""The documentation site: `mkdocs build --strict`, then the built site opened in
a real headless Chromium (Debian's `chromium` and `chromium-driver` packages).

Material's search runs in the browser (a web worker fetching the search index),
so the site is served over HTTP on 127.0.0.1, as a reader's browser would get it.
"""

import functools
import html
import http.server
import inspect
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading

import markdown
import places
import pytest

import eqx_ckpt

ROOT = places.ROOT
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
NO_BROWSER = (
    "no headless browser: install Debian's Chromium and its driver "
    "(`apt-get install -y chromium chromium-driver`) to check the built site in a browser"
)


def _build(site: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    done = _build(site)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    return site


def test_site_builds_strictly(site):
    # Every page of docs/ and every API entry made it; the chart is published.
    for page in ["getting-started", "loading", "manager", "storage", "format", "benchmarks", "api/save-load"]:
        assert (site / page / "index.html").is_file(), page
    assert (site / "benchmarks.png").read_bytes() == (ROOT / "docs" / "benchmarks.png").read_bytes()
    assert 'src="../benchmarks.png"' in (site / "benchmarks" / "index.html").read_text()


def test_strict_build_fails_on_a_broken_link(tmp_path):
    """The strictness is real: one broken link fails the build."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copytree(ROOT / "notebooks", copy / "notebooks")
    for name in ["mkdocs.yml", "mkdocs_hooks.py", "pyproject.toml"]:
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "eqx_ckpt", copy / "eqx_ckpt")
    (copy / "docs" / "loading.md").write_text("# Loads\n\nSee [the missing page](missing.md).\n")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "missing.md" in done.stderr


# A citation of the benchmarks page: a link to one of its headings
# (`benchmarks.md#anchor`), or its path, maybe with a heading named in quotes
# (`docs/benchmarks.md, "GPU"`); `docs/benchmarks.md at <commit>` is the page
# as it was at that commit.
_CITATION = re.compile(
    r"benchmarks\.md#(?P<anchor>[\w-]+)|docs/benchmarks\.md(?: at (?P<commit>[0-9a-f]{7,40}))?"
    r"(?:(?:\]\(benchmarks\.md\))?[,;]?\s*\(?\"(?P<name>[^\"]{1,200})\")?"
)
CITING = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "eqx_ckpt").rglob("*.py")),
    *sorted((ROOT / "benchmarks").glob("*.py")),
    *sorted((ROOT / "tests").rglob("*.py")),
]


@functools.cache
def _headings(text: str) -> dict[str, str]:
    """The headings of a Markdown page (not the `#` lines of its code), each
    one's anchor to its text, as the site makes them (Python-Markdown's `toc`)."""
    page = markdown.Markdown(extensions=["toc", "attr_list", "fenced_code"])
    page.convert(text)
    found, tokens = {}, list(page.toc_tokens)
    while tokens:
        token = tokens.pop()
        found[token["id"]] = html.unescape(token["name"])
        tokens.extend(token["children"])
    return found


@functools.cache
def _benchmarks_page(commit: str | None) -> str | None:
    """docs/benchmarks.md now, or at `commit` ("" where git has no such commit;
    `None` where this checkout has no full history to ask)."""
    if commit is None:
        return (ROOT / "docs" / "benchmarks.md").read_text()
    git = ["git", "-C", str(ROOT)]
    shallow = subprocess.run([*git, "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        return None
    shown = subprocess.run([*git, "show", f"{commit}:docs/benchmarks.md"], capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else ""


def _citation_problems(text: str, page=_benchmarks_page) -> tuple[int, list[str]]:
    """How many citations of the benchmarks page `text` makes, and those that
    name no heading of it, or a commit without it: `line N: ...`. A heading may
    be named by the part before its colon ("GPU"). Comment markers of continued
    lines are read past."""
    text = re.sub(r"\n[ \t]*#[ \t]*(?=\S)", "\n", text)
    count, problems = 0, []
    for cited in _CITATION.finditer(text):
        found = page(cited["commit"])
        if found is None:
            continue
        count += 1
        headings, at = _headings(found), f" at {cited['commit']}" if cited["commit"] else ""
        line = text.count("\n", 0, cited.start()) + 1
        if not found:
            problems.append(f"line {line}: no docs/benchmarks.md{at}")
        elif cited["anchor"] and cited["anchor"] not in headings:
            problems.append(f"line {line}: no heading #{cited['anchor']} in docs/benchmarks.md")
        elif cited["name"]:
            name = " ".join(cited["name"].split())
            if name not in {n for h in headings.values() for n in (h, h.split(": ")[0])}:
                problems.append(f"line {line}: no heading {name!r} in docs/benchmarks.md{at}")
    return count, problems


def test_citations_of_the_benchmarks_page_name_its_headings():
    """Code and docs cite docs/benchmarks.md for the measurements behind a
    choice. The page is cut to today's figures, so a citation must name a
    section it still has, or the commit of the page that had it (issue 61)."""
    total, problems = 0, []
    for path in CITING:
        if path != pathlib.Path(__file__).resolve():
            count, found = _citation_problems(path.read_text())
            total += count
            problems += [f"{path.relative_to(ROOT)}, {problem}" for problem in found]
    assert not problems, "\n".join(problems)
    assert total >= 30  # the pattern still finds them


def test_a_citation_of_a_missing_heading_is_found():
    page = "# Benchmarks\n\n## GPU: a 4 GiB state\n\n```bash\n# not a heading\n```\n"
    text = (
        'See [it](benchmarks.md#gpu-a-4-gib-state), (docs/benchmarks.md, "GPU")\n'
        '    # and docs/benchmarks.md,\n    # "GPU: a 4 GiB state"; [a cut section](benchmarks.md#cpu)\n'
        '(docs/benchmarks.md, "not a heading"), docs/benchmarks.md at 1234567, "GPU".\n'
        "docs/benchmarks.md at 89abcde; the docs/benchmarks.md page\n"
    )
    pages = {None: page, "1234567": "# Benchmarks\n", "89abcde": ""}
    assert _citation_problems(text, pages.get) == (
        8,
        [
            "line 3: no heading #cpu in docs/benchmarks.md",
            "line 4: no heading 'not a heading' in docs/benchmarks.md",
            "line 4: no heading 'GPU' in docs/benchmarks.md at 1234567",
            "line 5: no docs/benchmarks.md at 89abcde",
        ],
    )


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _signatures(page: str) -> list[str]:
    """The text of each signature block of a built API page."""
    blocks = re.findall(r'<div class="doc-signature highlight"><pre><span></span><code>(.*?)</code></pre>', page, re.S)
    return [html.unescape(re.sub(r"<[^>]+>", "", block)) for block in blocks]


def test_signatures_are_separate_and_wrapped(site):
    """Issue 40, item 17: a signature was one unwrapped line under the heading,
    with a horizontal scrollbar. Each is now a block of its own, one parameter
    a line once it is long."""
    signatures = [s for page in (site / "api").glob("*/index.html") for s in _signatures(page.read_text())]
    assert len(signatures) >= 30
    assert max(len(line) for s in signatures for line in s.splitlines()) <= 80
    (save,) = [s for s in signatures if s.startswith("tree_serialise_leaves(")]
    assert "\n    pytree: PyTree,\n" in save and "\n    *,\n" in save


def test_the_notebooks_are_pages_of_the_site(site):
    """Issue 40, item 17: the notebooks were not on the site. Each is a page
    (in the navigation) with its cells and saved outputs, and links to its
    `.ipynb`, which the site serves."""
    home = (site / "index.html").read_text()
    assert len(NOTEBOOKS) == 5
    for notebook in NOTEBOOKS:
        cells = json.loads(notebook.read_text())["cells"]
        page = (site / "notebooks" / notebook.stem / "index.html").read_text()
        title = "".join(cells[0]["source"]).splitlines()[0].removeprefix("# ")
        text = html.unescape(re.sub(r"<[^>]+>", "", page))
        assert title.replace("`", "") in text, notebook.name
        assert f'href="../{notebook.name}"' in page
        assert (site / "notebooks" / notebook.name).read_bytes() == notebook.read_bytes()
        assert f'href="notebooks/{notebook.stem}/"' in home, notebook.name  # in the navigation
        code = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
        assert code.splitlines()[-1] in text
    # Outputs saved with a notebook are shown: inspect.ipynb's `print(ckpt)`.
    inspected = html.unescape((site / "notebooks" / "inspect" / "index.html").read_text())
    cells = json.loads((ROOT / "notebooks" / "inspect.ipynb").read_text())["cells"]
    printed = next(c for c in cells if "print(ckpt)" in "".join(c["source"]))
    summary = "".join(printed["outputs"][0]["text"])
    assert summary.startswith("Checkpoint 'ckpt'") and summary in inspected


def test_the_site_names_the_version_and_links_docstring_pages(site):
    """Issue 40, item 17: no version on the site, and docstrings named
    `docs/*.md` as plain text."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert f"eqx_ckpt {version}" in (site / "index.html").read_text()
    page = (site / "api" / "save-load" / "index.html").read_text()
    for target, text in [("../../storage/", "docs/storage.md"), ("../../format/#small-leaves-packs", "docs/format.md")]:
        assert f'<a href="{target}">{text}</a>' in page


def _public_docstrings():
    for name in sorted(n for n in dir(eqx_ckpt) if not n.startswith("_")):
        value = getattr(eqx_ckpt, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            yield name, inspect.getdoc(value) or ""
            for attr, member in vars(value).items() if inspect.isclass(value) else ():
                if not attr.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                    yield f"{name}.{attr}", inspect.getdoc(member) or ""


def test_public_docstrings_link_the_pages_they_name():
    """A docstring naming `docs/<page>.md` links it, relative to the API pages
    (docs/api/), so that the site's link works and `help()` still shows the
    path; the page (and its heading) exist."""
    mentions = 0
    for name, doc in _public_docstrings():
        for mention in re.finditer(r"docs/([\w-]+)\.md", doc):
            mentions += 1
            link = re.compile(
                r"\[docs/" + mention.group(1) + r"\.md[^\]]*\]\(\.\./" + mention.group(1) + r"\.md(#[\w-]+)?\)"
            )
            found = link.match(doc, doc.rfind("[", 0, mention.end()))
            assert found, f"{name}: `{mention.group(0)}` is not a link"
            page = ROOT / "docs" / f"{mention.group(1)}.md"
            assert page.is_file(), f"{name}: {page.name} does not exist"
            anchor = (found.group(1) or "#")[1:]
            assert not anchor or anchor in _headings(page.read_text()), f"{name}: no heading #{anchor} in {page.name}"
    assert mentions >= 6


def test_a_notebook_page_shows_cells_and_outputs(tmp_path):
    """The hook's rendering of one notebook: Markdown as is, code fenced, text
    and image outputs shown, an error output left out."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (`pip install -e .[test]`)")
    sys.path.insert(0, str(ROOT))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(ROOT))
    cells = [
        {"cell_type": "markdown", "source": ["# A title\n", "\n", "Some text."]},
        {"cell_type": "code", "source": "print('x ```')", "outputs": [{"output_type": "stream", "text": ["x ```\n"]}]},
        {
            "cell_type": "code",
            "source": ["1 + 1"],
            "outputs": [
                {"output_type": "execute_result", "data": {"text/plain": ["2"]}},
                {"output_type": "display_data", "data": {"image/png": "iVBORw0K\n", "text/plain": "<Figure>"}},
                {"output_type": "error", "ename": "ValueError", "evalue": "no", "traceback": []},
            ],
        },
    ]
    notebook = tmp_path / "demo.ipynb"
    notebook.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert mkdocs_hooks.page(notebook) == (
        "# A title\n\n[Download this notebook](demo.ipynb) (`notebooks/demo.ipynb` in the repository).\n\n"
        "Some text.\n\n````python\nprint('x ```')\n````\n\n````text\nx ```\n````\n\n"
        "```python\n1 + 1\n```\n\n```text\n2\n```\n\n![output](data:image/png;base64,iVBORw0K)\n"
    )


@pytest.fixture(scope="module")
def served(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        if os.environ.get("CI"):  # (.ci/run installs them: a CI run without them checks less than it says)
            pytest.fail(NO_BROWSER)
        pytest.skip(NO_BROWSER)
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (`pip install -e .[test]`)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ["--headless=new", "--no-sandbox", "--window-size=1280,1000"]:
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def test_api_page_renders_arguments_and_example(browser, served):
    from selenium.webdriver.common.by import By

    browser.get(f"{served}/api/save-load/")
    entry = browser.find_element(By.ID, "eqx_ckpt.tree_deserialise_leaves")
    assert entry.text.startswith("eqx_ckpt.tree_deserialise_leaves")
    # The heading, its signature and its contents make one block of the page.
    block = entry.find_element(By.XPATH, "..")
    signature = block.find_element(By.CSS_SELECTOR, ".doc-signature").text
    assert signature.startswith("tree_deserialise_leaves(") and "lazy: bool = False" in signature
    body = block.find_element(By.CSS_SELECTOR, ".doc-contents")
    assert "Arguments:" in body.text
    for argument in ["path", "like", "filter_spec", "is_leaf", "where", "prefix", "rename", "missing", "lazy"]:
        assert any(item.text.startswith(f"{argument}:") for item in body.find_elements(By.CSS_SELECTOR, "li")), argument
    example = body.find_element(By.CSS_SELECTOR, ".admonition.example")
    assert example.find_element(By.CSS_SELECTOR, ".admonition-title").text == "Example"
    code = example.find_element(By.CSS_SELECTOR, "pre").text
    assert 'eqx_ckpt.tree_deserialise_leaves("mlp_ckpt", eqx.filter_eval_shape(make))' in code
    # Cross-references resolve to the pages documenting them.
    link = body.find_element(By.LINK_TEXT, "eqx_ckpt.LazyArray")
    assert link.get_attribute("href") == f"{served}/api/inspection/#eqx_ckpt.LazyArray"


def test_search_finds_it(browser, served):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{served}/")
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.click()  # as a reader does: the box in the header opens the search
    box.send_keys("tree_deserialise_leaves")
    target = f"{served}/api/save-load/?h=tree_deserialise_leaves#eqx_ckpt.tree_deserialise_leaves"

    def found(driver):
        links = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__link")
        return [link for link in links if link.get_attribute("href") == target]

    (link,) = WebDriverWait(browser, 30).until(found)
    assert "tree_deserialise_leaves" in link.text


LONGEST_SENTENCE = 60  # words; the pages' median is near 20
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _paragraphs(text: str):
    """The prose of a Markdown page, a paragraph or list item at a time:
    fenced code, tables, headings, images and HTML comments left out."""
    fence, lines = "", []
    for line in [*text.splitlines(), ""]:
        stripped = line.strip()
        opening = re.match(r"(`{3,}|~{3,})", stripped)
        if fence:
            fence = "" if opening and stripped == opening.group(1) and stripped.startswith(fence) else fence
            continue
        item = re.match(r"([-*+]|\d+\.)\s+", stripped)
        if opening or item or not stripped or stripped.startswith(("|", "#", "<!--", "![")):
            if lines:
                yield " ".join(lines)
            lines = []
            fence = opening.group(1) if opening else ""
            if not item:
                continue
            stripped = stripped[item.end() :]
        lines.append(stripped)


def _sentences(text: str):
    """Sentences end at `.`, `?` or `!` (or one closing a bracket or quote)
    before a space and a capital, digit, code or bracket; `e.g.` ends none."""
    for paragraph in _paragraphs(text):
        start = 0
        for end in re.finditer(r"(?:(?<=[.!?])|(?<=[.!?][)\"']))\s+(?=[A-Z0-9`*\[(\"'_])", paragraph):
            if not re.search(r"\b(e\.g|i\.e|etc|vs|cf)\.$", paragraph[start : end.start()], re.I):
                yield paragraph[start : end.start()]
                start = end.end()
        yield paragraph[start:]


def test_the_sentences_of_the_pages_are_short():
    """Issue 61, item 4: sentences a reader takes in at once. A long chain of
    clauses becomes a list or short sentences; this keeps every page of prose
    (README.md and docs/, code and tables aside) under a generous limit."""
    long = [
        f"{page.relative_to(ROOT)}: {len(sentence.split())} words: {sentence[:120]}..."
        for page in PAGES
        for sentence in _sentences(page.read_text())
        if len(sentence.split()) > LONGEST_SENTENCE
    ]
    assert not long, "\n".join(long)


def test_sentences_are_found_in_prose_only():
    page = (
        "# A heading that is not counted\n\nOne short sentence. Another, e.g. this one.\n"
        "(A third.) A fourth.\n- an item\n  over two lines\n\n| a | table |\n\n"
        "```python\nx = 1. + 2.  # Not prose\n```\n"
    )
    assert list(_sentences(page)) == [
        "One short sentence.",
        "Another, e.g. this one.",
        "(A third.)",
        "A fourth.",
        "an item over two lines",
    ]
