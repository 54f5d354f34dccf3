"""Datasets on disk for the token tasks: `write_dataset` (parallel, deterministic, de-duplicated generation),
`open_dataset` (memory-mapped loading that rebuilds the task from the manifest), `shard_indices` (rows per
data-parallel rank) and `import_sudoku` (the public Sudoku CSVs). See `loopformer.data.dataset`."""

from loopformer.data.dataset import (FORMAT_VERSION, import_sudoku, open_dataset, read_manifest, row_hashes,
                                     shard_indices, write_dataset, write_splits)

__all__ = ["FORMAT_VERSION", "write_dataset", "write_splits", "open_dataset", "read_manifest", "shard_indices",
           "import_sudoku", "row_hashes"]
