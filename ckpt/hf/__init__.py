"""Import: a Hugging Face folder's weights straight into a model of any layout, each rank
reading only the byte ranges of its own shards (the inverse of ``ckpt export --format hf``).

``_safetensors`` (the header, parsed and bounded here: never pickle, no safetensors
library), ``_folder`` (:class:`HFFolder`: ``config.json``, the index, the weights files,
tokenizer and generation files, on any storage), ``_load`` (:func:`load_hf`: the plan, the
ranged reads, the casts). docs/store.md, "Import from Hugging Face".
"""

from ckpt.hf._folder import HF_EXTRA_NAMES, HFFolder
from ckpt.hf._load import HFLoadReport, load_hf
from ckpt.hf._safetensors import (
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    SafetensorsHeader,
    TensorEntry,
    parse_header,
    read_header,
)

__all__ = ["load_hf", "HFLoadReport", "HFFolder", "HF_EXTRA_NAMES", "MAX_HEADER_BYTES",
           "SAFETENSORS_DTYPES", "SafetensorsHeader", "TensorEntry", "parse_header",
           "read_header"]
