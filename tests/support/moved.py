"""Where every test that existed before the tests moved into folders (issue 89) is now.

    python tests/support/moved.py

collects the tests of `BEFORE`, the last commit with every test in one flat
folder (in a temporary git worktree of it), and the tests of this checkout,
and prints each test of then that has no place now: its file is mapped by
`MOVED`, a test merged into another or renamed by `REPLACED`, a test of a
block of a docs page (named by the block's first line, which moves as the
page is edited) by its rank among that page's blocks. It exits 1 if any has
none. (tests/package/test_layout.py checks the table against the tree on
every run; this script, which collects two suites, is run by hand.)"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Collection, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]
BEFORE = "1bdaad95a1a6100fbe00dfa7b5e435db60a77780"

# tests/<old file> -> tests/<new place>
MOVED = {
    "test_serialise.py": "save/test_serialise.py",
    "test_async.py": "save/test_async.py",
    "test_cast.py": "save/test_cast.py",
    "test_partial.py": "save/test_partial.py",
    "test_incremental.py": "save/test_incremental.py",
    "test_pack.py": "save/test_pack.py",
    "test_records.py": "save/test_records.py",
    "test_staging.py": "save/test_staging.py",
    "test_write.py": "save/test_write.py",
    "test_compression.py": "save/test_compression.py",
    "test_pinned_save.py": "save/test_pinned_save.py",
    "test_progress.py": "save/test_progress.py",
    "test_deserialise.py": "load/test_deserialise.py",
    "test_lazy.py": "load/test_lazy.py",
    "test_checkpoint.py": "load/test_checkpoint.py",
    "test_select.py": "load/test_select.py",
    "test_nested.py": "load/test_nested.py",
    "test_read.py": "load/test_read.py",
    "test_direct.py": "load/test_direct.py",
    "test_pinned_load.py": "load/test_pinned_load.py",
    "test_window.py": "load/test_window.py",
    "test_properties.py": "load/test_properties.py",
    "test_hub.py": "sources/test_hub.py",
    "test_hub_cache.py": "sources/test_hub_cache.py",
    "test_hub_mirror.py": "sources/test_hub_mirror.py",
    "test_hub_ranges.py": "sources/test_hub_ranges.py",
    "test_families.py": "sources/test_families.py",
    "test_family_day.py": "sources/test_family_day.py",
    "test_family_missing.py": "sources/test_family_missing.py",
    "test_family_told.py": "sources/test_family_told.py",
    "test_finetune.py": "sources/test_finetune.py",
    "test_block_digests.py": "sources/test_block_digests.py",
    "test_load_names.py": "sources/test_load_names.py",
    "test_verify_sources.py": "sources/test_verify_sources.py",
    "test_published.py": "sources/test_published.py",
    "test_s3.py": "store/test_s3.py",
    "test_gcs.py": "store/test_gcs.py",
    "test_commit.py": "store/test_commit.py",
    "test_share.py": "store/test_share.py",
    "test_direct_write.py": "store/test_direct_write.py",
    "test_local_paths.py": "store/test_local_paths.py",
    "test_ocdbt.py": "store/test_ocdbt.py",
    "test_concurrency.py": "store/test_concurrency.py",
    "test_manager.py": "manage/test_manager.py",
    "test_preemption.py": "manage/test_preemption.py",
    "test_initialise.py": "manage/test_initialise.py",
    "test_iterators.py": "manage/test_iterators.py",
    "test_multiprocess.py": "hosts/test_multiprocess.py",
    "test_sharding.py": "hosts/test_sharding.py",
    "test_heartbeat.py": "hosts/test_heartbeat.py",
    "test_gpu.py": "hosts/test_gpu.py",
    "test_host_memory.py": "hosts/test_host_memory.py",
    "test_cli.py": "tools/test_cli.py",
    "test_export.py": "tools/test_export.py",
    "test_migrate.py": "tools/test_migrate.py",
    "test_manifest.py": "ondisk/test_manifest.py",
    "test_compat.py": "ondisk/test_compat.py",
    "test_keypath.py": "ondisk/test_keypath.py",
    "test_dtypes.py": "ondisk/test_dtypes.py",
    "test_structure.py": "ondisk/test_structure.py",
    "test_integrity.py": "ondisk/test_integrity.py",
    "test_safetensors.py": "interop/test_safetensors.py",
    "test_orbax.py": "interop/test_orbax.py",
    "test_torch.py": "interop/test_torch.py",
    "test_hf_models.py": "interop/test_hf_models.py",
    "test_equinox_compat.py": "interop/test_equinox_compat.py",
    "test_hostile.py": "hostile/test_hostile.py",
    "test_hostile_files.py": "hostile/test_hostile_files.py",
    "test_hub_hostile.py": "hostile/test_hub_hostile.py",
    "test_family_hostile.py": "hostile/test_family_hostile.py",
    "test_crash.py": "interrupts/test_crash.py",
    "test_faults.py": "interrupts/test_faults.py",
    "test_faults_seam.py": "interrupts/test_faults_seam.py",
    "test_transaction.py": "interrupts/test_transaction.py",
    "test_threads.py": "interrupts/test_threads.py",
    "test_doc_examples.py": "docs/test_doc_examples.py",
    "test_docs.py": "docs/test_docs.py",
    "test_notebooks.py": "docs/test_notebooks.py",
    "test_readme.py": "docs/test_readme.py",
    "test_public.py": "package/test_public.py",
    "test_architecture.py": "package/test_architecture.py",
    "test_state.py": "package/test_state.py",
    "test_benchmarks.py": "bench/test_benchmarks.py",
}

# A test of then (its id with the old file) -> the test of now that covers it,
# where it was merged, renamed or rewritten rather than moved as it was.
REPLACED: dict[str, str] = {
    # 15 kB of JSON containers where there were 15 MB: the same count refuses both.
    **{
        f"tests/test_published.py::test_eqx_ckpt_json_is_parsed_as_untrusted_input[{shard}-{data}-JSON containers "
        f"(objects and arrays) in 15000007 bytes, more than one]": "tests/sources/test_published.py::"
        f"test_eqx_ckpt_json_is_parsed_as_untrusted_input[{shard}-{data}-JSON containers (objects and arrays) "
        "in 15007 bytes, more than one]"
        for shard in ("single", "sharded")
        for data in ("data3", "data4")
    },
    # Now at two moments after the imports: while JAX compiles, and (as before, 3 s) in the training.
    "tests/test_cli.py::test_ctrl_c_prints_one_line_and_exits_130": (
        "tests/tools/test_cli.py::test_ctrl_c_prints_one_line_and_exits_130[3.0]"
    ),
    # One run of the processes saves and loads a local directory's checkpoints and S3's, each checked and named.
    **{
        f"tests/test_multiprocess.py::TestProcessMatrix::test_save_and_load[{shape}-{storage}]": (
            f"tests/hosts/test_multiprocess.py::TestProcessMatrix::test_save_and_load[{shape}-local+s3]"
        )
        for shape in ("2-2", "4-1")
        for storage in ("local", "s3")
    },
    # Renamed as every source got its own parameter; the HTTP case kept its own test.
    "tests/test_block_digests.py::test_a_rewritten_block_served_over_http_is_refused_by_every_read": (
        "tests/sources/test_block_digests.py::test_rewritten_bytes_served_over_http_are_refused_by_every_read"
    ),
    # An export writes the current version (6: BLAKE3 digests of blocks of whole rows), where it wrote 4.
    "tests/test_families.py::test_an_export_without_a_base_is_version_4_with_every_digest": (
        "tests/sources/test_families.py::test_an_export_without_a_base_is_the_current_version_with_every_digest"
    ),
    **{
        f"tests/test_families.py::test_a_damaged_or_hostile_record_is_corrupt[version 4 {case}]": (
            f"tests/sources/test_families.py::test_a_damaged_or_hostile_record_is_corrupt[version 5 {case}]"
        )
        for case in ("taking leaves without a base", "with blocks missing")
    },
    # The same preempted run, now read with a Grain worker process; beside it, two `jax.distributed` processes.
    "tests/test_iterators.py::test_a_preempted_run_resumes_its_data_and_ends_bit_for_bit": (
        "tests/manage/test_iterators.py::test_a_preempted_run_resumes_its_data_and_ends_bit_for_bit"
        "[one-process-a-grain-worker]"
    ),
}


def collect(folder: pathlib.Path) -> list[str]:
    """The ids of the tests pytest collects in `folder`'s checkout."""
    env = {**os.environ, "PYTHONPATH": str(folder), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    if done.returncode != 0 or not ids:
        raise SystemExit(f"collecting the tests in {folder} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return ids


# A test of a block of a docs page is named by the block's first line, which
# moves as the page is edited: it is the same test as the block of the same
# rank among that page's blocks of the test now.
_BLOCK = re.compile(r"(?P<test>.+)\[(?P<page>docs/[^:\]]+|README\.md):(?P<line>\d+)\]")


def new_place(test: str, before: Sequence[str] = (), now: Collection[str] = frozenset()) -> str:
    """Where the test `test` (an id of `BEFORE`'s, among `before`) is now
    (among `now`), by the tables, and a block of a page by its rank."""
    if test in REPLACED:
        return REPLACED[test]
    file, _, rest = test.partition("::")
    name = file.removeprefix("tests/")
    moved = f"tests/{MOVED[name]}::{rest}" if name in MOVED else test
    found = _BLOCK.fullmatch(moved)
    if moved in now or found is None:
        return moved
    old = _BLOCK.fullmatch(test)
    assert old is not None
    ranked = lambda ids, match: sorted(
        (int(m["line"]), i)
        for i, m in ((i, _BLOCK.fullmatch(i)) for i in ids)
        if m and m["test"] == match["test"] and m["page"] == match["page"]
    )
    then, there = ranked(before, old), ranked(now, found)
    rank = [line for line, _ in then].index(int(old["line"]))
    return there[rank][1] if len(then) == len(there) else moved


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        old = pathlib.Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(old), BEFORE], cwd=ROOT, check=True)
        try:
            before = collect(old)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    now = set(collect(ROOT))
    lost = [test for test in before if new_place(test, before, now) not in now]
    for test in lost:
        print(f"{test}: no test at {new_place(test, before, now)}")
    kept = len(before) - len(lost)
    print(f"{kept} of the {len(before)} tests of {BEFORE[:12]} are in this checkout ({len(now)} in all)")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
