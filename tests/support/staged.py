"""What a save stages: `Staged(faults)` records every (bytes staged, budget) the fault
point `save.staged` reports (tests/save/test_staging.py, tests/hosts/test_gpu.py)."""

import threading

MIB = 1 << 20


class Staged:
    """What `save.staged` reports: every (bytes staged, budget), in order."""

    def __init__(self, faults):
        self.seen: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        faults("save.staged", self._record)

    def _record(self, nbytes, budget):
        with self._lock:
            self.seen.append((nbytes, budget))

    @property
    def peak(self) -> int:
        return max(n for n, _ in self.seen)
