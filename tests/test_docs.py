"""The documentation site: `mkdocs build --strict`, then the built site opened in
a real headless Chromium (Debian's `chromium` and `chromium-driver` packages).

Material's search runs in the browser (a web worker fetching the search index),
so the site is served over HTTP on 127.0.0.1, as a reader's browser would get it.
"""

import functools
import http.server
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import pytest

ROOT = pathlib.Path(__file__).parent.parent
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
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(ROOT / "eqx_ckpt", copy / "eqx_ckpt")
    (copy / "docs" / "loading.md").write_text("# Loads\n\nSee [the missing page](missing.md).\n")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "missing.md" in done.stderr


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
