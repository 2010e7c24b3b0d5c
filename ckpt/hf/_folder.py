"""A Hugging Face folder on any storage: ``config.json``, the weights as ``model.safetensors``
or as shards listed by ``model.safetensors.index.json``, and the files beside them
(the tokenizer's, ``generation_config.json``).

:class:`HFFolder` lists the folder once and reads the index; a weights file's header is read
(and checked, :mod:`ckpt.hf._safetensors`) only when a tensor of that file is asked for.
Reads go through :class:`ckpt.storage.Storage` (retried, bounded); on local disk a file
that is a link, as in the Hugging Face cache's ``snapshots/`` folders, is read at the file
it names. Only safetensors are read: a folder holding only pickle weights
(``pytorch_model.bin`` and the like) is refused in one line that says how to convert it.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

from ckpt.errors import CorruptCheckpointError
from ckpt.export import HF_CONFIG_NAME, HF_INDEX_NAME, HF_WEIGHTS_NAME
from ckpt.format import jsonio
from ckpt.hf._safetensors import SafetensorsHeader, TensorEntry, read_header
from ckpt.storage import Storage

__all__ = ["HF_EXTRA_NAMES", "HFFolder"]

# Files a model folder holds beside its weights and config.json: the tokenizer's (and chat
# template), the generation defaults. An import attaches those present.
HF_EXTRA_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                  "chat_template.jinja", "chat_template.json", "generation_config.json")
_MAX_JSON_BYTES = 64 << 20  # config.json, the index (a 70B model's: ~60 KiB)
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

_CONVERT = ("convert it to safetensors first: python -c \"from transformers import "
            "AutoModelForCausalLM as M; M.from_pretrained('{src}').save_pretrained('OUT')\" "
            "(save_pretrained writes safetensors), then import OUT")


class HFFolder:
    """The weights of a Hugging Face folder at ``url`` (a local path or any fsspec URL).

    Lists the folder and reads the index at construction; ``FileNotFoundError`` when it
    holds no safetensors weights, ``ValueError`` when it holds pickle weights only,
    ``CorruptCheckpointError`` naming the file for a malformed index. Thread-safe.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        # A local folder by its real path (the Hugging Face cache links its snapshots).
        self.storage = Storage(Storage.location(url).rstrip("/") or "/", storage_options)
        self.url = self.storage.url
        self._local = self.storage.local_path("")
        self._sizes = {name: size for name, kind, size in self.storage.listdir("")
                       if kind == "file"}
        self._headers: dict[str, SafetensorsHeader] = {}
        self._targets: dict[str, tuple[Storage, str]] = {}  # links' targets, local disk
        self._lock = threading.Lock()
        self.bytes_read = 0  # by this object: index, headers, config and tensor data
        self.num_reads = 0
        self.weight_map = self._weight_map()

    def describe(self, name: str = "") -> str:
        return self.storage.describe(name)

    # -- what the folder holds -----------------------------------------------------------
    def _weight_map(self) -> dict[str, str]:
        """``{tensor name: weights file}``: the index's, or every tensor of the one file."""
        if HF_INDEX_NAME in self._sizes:
            where = self.describe(HF_INDEX_NAME)
            doc = jsonio.loads(self._read_whole(HF_INDEX_NAME), where)
            wmap = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
                raise CorruptCheckpointError(f"{where}: 'weight_map' is not an object of file "
                                             f"names; save the model again", path=where)
            for file in sorted(set(wmap.values())):
                if not _SHARD_NAME.match(file):
                    raise CorruptCheckpointError(
                        f"{where}: weight_map names {file[:200]!r}, not a .safetensors file "
                        f"of this folder; save the model again", path=where)
                if file not in self._sizes:
                    raise FileNotFoundError(f"{where} lists {file}, which is not in "
                                            f"{self.url}; download the folder again")
            return dict(wmap)
        if HF_WEIGHTS_NAME in self._sizes:
            return {name: HF_WEIGHTS_NAME for name in self.header(HF_WEIGHTS_NAME).tensors}
        pickles = sorted(n for n in self._sizes if n.endswith(_PICKLE_SUFFIXES))
        if pickles:
            raise ValueError(f"{self.url} holds {pickles[0]} (pickle weights, never read "
                             f"here: loading them runs code from the file) and no "
                             f"{HF_WEIGHTS_NAME}; " + _CONVERT.format(src=self.url))
        if not self._sizes:
            raise FileNotFoundError(f"{self.url} does not exist or is empty; give the folder "
                                    f"save_pretrained wrote (it holds {HF_CONFIG_NAME} and "
                                    f"{HF_WEIGHTS_NAME} or {HF_INDEX_NAME})")
        raise FileNotFoundError(f"{self.url} holds neither {HF_WEIGHTS_NAME} nor "
                                f"{HF_INDEX_NAME} (it has: {', '.join(sorted(self._sizes)[:8])})"
                                f"; give the folder save_pretrained wrote")

    def entry(self, name: str) -> TensorEntry:
        """Where tensor ``name`` lies; its file's header is read (once) and checked first.
        ``KeyError`` for a name the folder does not hold."""
        file = self.weight_map[name]
        entry = self.header(file).tensors.get(name)
        if entry is None:
            where = self.describe(HF_INDEX_NAME)
            raise CorruptCheckpointError(f"{where} puts {name!r} in {file}, whose header does "
                                         f"not hold it; download the folder again", path=where)
        return entry

    def header(self, file: str) -> SafetensorsHeader:
        with self._lock:
            cached = self._headers.get(file)
        if cached is None:
            cached = read_header(lambda a, b: self.read(file, a, b), self._size(file),
                                 self.describe(file))
            with self._lock:
                self._headers[file] = cached
        return cached

    def has(self, name: str) -> bool:
        return name in self._sizes

    def read_config(self) -> dict[str, Any]:
        """``config.json`` as a dict (``FileNotFoundError`` when the folder has none)."""
        if HF_CONFIG_NAME not in self._sizes:
            raise FileNotFoundError(f"{self.url} has no {HF_CONFIG_NAME}; give the folder "
                                    f"save_pretrained wrote")
        where = self.describe(HF_CONFIG_NAME)
        doc = jsonio.loads(self._read_whole(HF_CONFIG_NAME), where)
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(f"{where} is not a JSON object; save the model's "
                                         f"config again", path=where)
        return doc

    def extra_files(self) -> dict[str, bytes]:
        """The tokenizer and generation files the folder holds (:data:`HF_EXTRA_NAMES`),
        read whole (each at most 64 MiB)."""
        return {name: self._read_whole(name) for name in HF_EXTRA_NAMES if name in self._sizes}

    # -- reads ---------------------------------------------------------------------------
    def _where(self, name: str) -> tuple[Storage, str]:
        """The storage and name ``name`` is read at: on local disk a link's target."""
        if self._local is None:
            return self.storage, name
        with self._lock:
            target = self._targets.get(name)
        if target is None:
            path = os.path.join(self._local, name)
            target = (self.storage, name)
            if os.path.islink(path):
                real = os.path.realpath(path)
                target = (Storage(os.path.dirname(real)), os.path.basename(real))
            with self._lock:
                self._targets[name] = target
        return target

    def _size(self, name: str) -> int:
        storage, rel = self._where(name)
        return storage.size(rel) if storage is not self.storage else self._sizes[name]

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.num_reads += 1

    def _read_whole(self, name: str) -> bytes:
        storage, rel = self._where(name)
        data = storage.read_bytes(rel, max_bytes=_MAX_JSON_BYTES)
        self._count(len(data))
        return data

    def read(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of file ``name``: one ranged read."""
        storage, rel = self._where(name)
        data = storage.read_bytes(rel, start, end)
        self._count(len(data))
        return data

    def open_local(self, name: str):
        """An unbuffered file object of local file ``name`` (None off local disk), for reads
        straight into a tensor's memory; the caller closes it and counts what it reads."""
        if self._local is None:
            return None
        storage, rel = self._where(name)
        return storage.open_local(rel)

    def count(self, nbytes: int) -> None:
        """Count a read made through :meth:`open_local`."""
        self._count(nbytes)
