"""Training data a user can trust: any common format in, packed rows with exact loss masks out.

``load_dataset(source, tokenizer, DataOptions(seq_len=...))`` reads JSON Lines (plain or ``.gz``), a JSON
array, Parquet, a ``datasets`` directory or a Hub name; detects each record's kind (text, chat messages,
ShareGPT, prompt/completion, Alpaca, token ids); masks chat turns exactly (the template's generation
markers, prefix renders verified token by token, or each reply found in the final render; a refusal naming
the record and the message only when the template loses one); packs whole documents
into rows whose position ids restart per document; and keeps the rows as int32 files, cached by content.
:class:`Batches` hands out seeded :class:`MicroBatch` es for training and :func:`eval_batches` the rows in
order; several sources are prepared as one dataset with a :class:`SourcePart` each and, with weights,
sampled in proportion (:mod:`~slide_hf.data.mixture`). docs/data.md describes the formats and rules for users.
"""

from slide_hf.data.batches import Batches, DataPosition, MicroBatch, eval_batches
from slide_hf.data.dataset import Dataset, DataStats, SourcePart, load_dataset, load_split, open_source, preview
from slide_hf.data.encode import Document, EncodedRecord
from slide_hf.data.options import IGNORE, DataOptions
from slide_hf.data.readers import bundled_text_path
from slide_hf.data.templates import BUNDLED_TEMPLATES

__all__ = [
    "BUNDLED_TEMPLATES",
    "IGNORE",
    "Batches",
    "DataOptions",
    "DataPosition",
    "DataStats",
    "Dataset",
    "Document",
    "EncodedRecord",
    "MicroBatch",
    "SourcePart",
    "bundled_text_path",
    "eval_batches",
    "load_dataset",
    "load_split",
    "open_source",
    "preview",
]
