"""Runs the code blocks of one documentation page, in order, in one namespace.

`python doc_runner.py BLOCKS.json` in the page's working directory, where the
file holds `{"page": "docs/x.md", "blocks": [{"line": 12, "code": "..."}, ...]}`
(what tests/docs/test_doc_examples.py extracts). Each block is compiled under the
page's name with its own line numbers, so a traceback points at the line of
the page that failed. A block marked `file` is written to the file its marker
names (a module the page's later blocks import) instead of being run. Prints
`ran N blocks` at the end, so the test knows that every block it sent was run.
"""

import json
import os
import sys


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        page = json.load(f)
    # As a script would run them: a reader pastes the blocks into one file.
    namespace = {"__name__": "__main__"}
    # A script's own folder comes first on its path: the modules a page writes import from there.
    sys.path.insert(0, os.getcwd())
    for block in page["blocks"]:
        if block.get("marker") == "file":
            with open(block["reason"], "w") as f:
                f.write(block["code"])
            continue
        padded = "\n" * (block["line"] - 1) + block["code"]
        exec(compile(padded, page["page"], "exec"), namespace)
    print(f"ran {len(page['blocks'])} blocks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
