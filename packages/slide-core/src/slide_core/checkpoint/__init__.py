"""Training checkpoints: one format for every world size, written atomically, verified on load.

Layout of one checkpoint directory (``<output>/checkpoints/step-00000042``), written by N processes::

    state.json                  the manifest: format version, step, world size N, every array's dtype and
                                element count, per rank its shard file (size; per array its offset in the
                                file, the ranges of the whole array it holds, and a CRC32 per 256 MiB
                                block), the caller's ``extra`` (schedule, data position, RNG, run config),
                                and a SHA-256 checksum of all of that
    shard-00000-of-0000N.bin    rank 0's part of every array (the fp32 master, then each optimizer state
    ...                         array), raw little-endian: its shard [lo, hi) of every unit, in slab order

One process writes one shard that holds every array whole. Any number of processes reads a checkpoint
written by any other number: each reads the ranges it holds from whichever shards hold them. Checkpoints
of the layouts before this one (one file per array; a manifest over one folder per rank) load through the
same reader (legacy.py).

One job per module: :mod:`.arrays` (what is written and read), :mod:`.manifest` (``state.json``),
:mod:`.writer` (saving), :mod:`.background` (saving on a thread while training goes on), :mod:`.reader`
(loading and verifying), :mod:`.catalog` (a run's checkpoints), :mod:`.retention` (which of them stay),
:mod:`.legacy` (the older layouts), :mod:`.errors`.
"""

from .arrays import ArraySink, ArraySource, Shard
from .background import BackgroundSaver
from .catalog import find_latest, list_checkpoints, newest_intact
from .errors import CheckpointCorrupt, CheckpointWriteError
from .manifest import read_state
from .reader import load_checkpoint, verify_checkpoint
from .retention import prune, retained
from .writer import CheckpointGroup, checkpoint_nbytes, format_size, save_checkpoint

__all__ = [
    "ArraySink",
    "ArraySource",
    "BackgroundSaver",
    "CheckpointCorrupt",
    "CheckpointGroup",
    "CheckpointWriteError",
    "Shard",
    "checkpoint_nbytes",
    "find_latest",
    "format_size",
    "list_checkpoints",
    "load_checkpoint",
    "newest_intact",
    "prune",
    "read_state",
    "retained",
    "save_checkpoint",
    "verify_checkpoint",
]
