"""Import: a Hugging Face folder's weights straight into a model of any layout, each rank
reading only the byte ranges of its own shards (the inverse of ``ckpt export --format hf``).

``_safetensors`` (the header, parsed and bounded here: never pickle, no safetensors
library), ``_folder`` (:class:`HFFolder`: ``config.json``, the index, the weights files,
tokenizer and generation files, on any storage), ``_load`` (:func:`load_hf`: the plan, the
ranged reads, the casts). docs/store.md, "Import from Hugging Face".
"""

from ckpt.hf._folder import HFFolder
from ckpt.hf._load import HFLoadReport, load_hf

__all__ = [
    "load_hf", "HFLoadReport", "HFFolder",
]
