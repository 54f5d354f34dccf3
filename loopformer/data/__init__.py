"""Datasets on disk for the token tasks: `write_dataset` (parallel, deterministic, de-duplicated generation),
`write_splits` (given arrays, e.g. the public Sudoku CSVs read by `loopformer.tasks.sudoku.import_csv`),
`open_dataset` (memory-mapped loading that rebuilds the task from the manifest) and `shard_indices` (rows per
data-parallel rank). See `loopformer.data.dataset`."""

from loopformer.data.dataset import (
                                     FORMAT_VERSION,
                                     open_dataset,
                                     read_manifest,
                                     row_hashes,
                                     shard_indices,
                                     write_dataset,
                                     write_splits,
)

__all__ = ["FORMAT_VERSION", "write_dataset", "write_splits", "open_dataset", "read_manifest", "shard_indices",
           "row_hashes"]
