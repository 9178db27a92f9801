"""What a checkpoint directory holds, byte for byte, for tests that it was left untouched."""

import os


def snapshot(root):
    """Every file below `root`, relative path -> bytes."""
    out = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out
