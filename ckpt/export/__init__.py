"""Export: a sharded checkpoint consolidated into full tensors in one process, written as a
``.pt`` file, a ``.safetensors`` file or a Hugging Face folder.

``_consolidate`` (:func:`consolidate`, :func:`export`), ``_select`` (key selection, dtype
casts, nesting), ``_files`` (output checks before anything is read; attachment files),
``_hf`` (the Hugging Face folder: shards, index, attachments), ``_optim``
(:func:`to_torch_optimizer_state`: an exported optimizer state as torch's own).
"""

from ckpt.export._consolidate import export
from ckpt.export._files import check_out_dir, check_out_file
from ckpt.export._hf import HF_CONFIG_NAME, HF_EXPORT_NAME, HF_INDEX_NAME, HF_WEIGHTS_NAME
from ckpt.export._optim import to_torch_optimizer_state
from ckpt.export._select import parse_dtype, select_keys

__all__ = [
    "export", "to_torch_optimizer_state", "parse_dtype", "select_keys", "check_out_dir",
    "check_out_file", "HF_WEIGHTS_NAME",
    "HF_INDEX_NAME", "HF_CONFIG_NAME", "HF_EXPORT_NAME",
]
