"""Import from a Hugging Face folder: ``ckpt.load_hf`` and the trainer's
``checkpoint.initial_load``, against transformers itself.

A tiny ``LlamaForCausalLM`` (random init, grouped-query attention, norms not all ones) is
saved with ``save_pretrained`` in several shards, once per module. It is imported on one
process, dp2 (FSDP2), tp2, pp2 and dp2 x tp2, and from S3 (moto on loopback): the imported
model's first forward gives transformers' logits, each rank reads only the rows of its own
shards, and an export of the step 0 the trainer commits is the folder's tensors bit for bit.
Crafted safetensors headers are refused in one line having read a bounded number of bytes;
a pickle folder is refused without being unpickled.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pickle
import struct
import tracemalloc
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

import ckpt
from ckpt.errors import CorruptCheckpointError, StateMismatchError
from ckpt.hf import load_hf
from ckpt.hf._safetensors import MAX_HEADER_BYTES, read_header
from tests.ckpt._hf_llama import MODEL, MODEL_ARGS, TOKENIZER, save_tiny_llama
from tests.dist import run_ranks
from trainer.config import ModelConfig
from trainer.hf import hf_names
from trainer.model import Transformer

pytestmark = pytest.mark.timeout(300)

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the `test` extra of pyproject.toml)")

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The folder (several shards and an index), its weights, its logits for ``tokens``."""
    return save_tiny_llama(tmp_path_factory.mktemp("llama") / "hf")


# -- safetensors headers ------------------------------------------------------------------
def _safetensors(path, header, data: bytes = b"", length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _t(dtype="F32", shape=(4,), offsets=(0, 16)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


CRAFTED = {
    "offsets past the end": ({"a": _t()}, b"\0" * 8, "past the end of the file"),
    "overlapping": ({"a": _t(), "b": _t(offsets=(8, 24))}, b"\0" * 24, "overlap"),
    "huge shape": ({"a": _t(shape=(2**40, 2**40))}, b"\0" * 16,
                   "bytes but its data_offsets span 16"),
    "shape and bytes disagree": ({"a": _t(shape=(3,))}, b"\0" * 16, "is 12 bytes"),
    "non-JSON": (b"{not json", b"", "not valid JSON"),
    "not an object": (b"[1, 2]", b"", "not an object"),
    "duplicate keys": (b'{"a": ' + json.dumps(_t()).encode() + b', "a": '
                       + json.dumps(_t()).encode() + b"}", b"\0" * 16, "duplicate key"),
    "deep nesting": (b"[" * 5000 + b"]" * 5000, b"", "nested deeper"),
    "unknown dtype": ({"a": _t(dtype="F4")}, b"\0" * 16, "has dtype 'F4'"),
    "extra field": ({"a": {**_t(), "x": 1}}, b"\0" * 16, "is not {"),
    "negative dim": ({"a": _t(shape=(-4,))}, b"\0" * 16, "non-negative integers"),
    "boolean dim": ({"a": {**_t(), "shape": [True]}}, b"\0" * 16, "non-negative integers"),
    "reversed offsets": ({"a": _t(offsets=(16, 0))}, b"\0" * 16, "0 <= begin <= end"),
    "bad metadata": ({"__metadata__": {"k": 1}, "a": _t()}, b"\0" * 16, "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_header_is_refused_in_one_line(tmp_path, case):
    header, data, phrase = CRAFTED[case]
    _safetensors(tmp_path / "model.safetensors", header, data)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError) as err:
            load_hf({"a": torch.zeros(4)}, str(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert phrase in message and "model.safetensors" in message, message
    assert "\n" not in message, message
    assert peak < 8 << 20, f"{peak} bytes allocated to refuse a {case} header"


@pytest.mark.parametrize("claimed,size,phrase", [
    (MAX_HEADER_BYTES + 1, MAX_HEADER_BYTES + 100, "more than the 100 MiB allowed"),
    (2**63, 64, "more than the 100 MiB allowed"),
    (1000, 40, "past the end of the file"),
    (None, 5, "shorter than the 8-byte header length"),
])
def test_header_length_is_bounded_before_it_is_read(tmp_path, claimed, size, phrase):
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:  # sparse: a large file costs nothing
        if claimed is not None:
            f.write(struct.pack("<Q", claimed))
        f.truncate(size)
    reads = []

    def read(start: int, end: int) -> bytes:
        reads.append(end - start)
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    with pytest.raises(CorruptCheckpointError, match=phrase) as err:
        read_header(read, size, str(path))
    assert "\n" not in str(err.value)
    assert sum(reads) <= 64 << 10, reads


def test_zero_size_tensors_and_metadata_are_valid(tmp_path):
    header = {"__metadata__": {"format": "pt"}, "empty": _t(shape=(0, 3), offsets=(0, 0)),
              "a": _t(), "scalar": _t(shape=(), offsets=(16, 20))}
    _safetensors(tmp_path / "model.safetensors", header,
                 struct.pack("<4f", 1, 2, 3, 4) + struct.pack("<f", 7))
    state = {"a": torch.zeros(4), "empty": torch.zeros(0, 3), "scalar": torch.zeros(())}
    report = load_hf(state, str(tmp_path))
    assert state["a"].tolist() == [1, 2, 3, 4] and float(state["scalar"]) == 7
    assert sorted(report.loaded) == ["a", "empty", "scalar"]


def test_a_key_named_by_a_list_stacks_those_tensors(tmp_path):
    """Mixtral's per-expert weights into a model's stacked ones: row e from the e-th name;
    a count that is not the first dimension, or a missing expert, is named in one line."""
    header = {f"e.{i}": _t(shape=(2,), offsets=(8 * i, 8 * i + 8)) for i in range(3)}
    _safetensors(tmp_path / "model.safetensors", header, struct.pack("<6f", *range(6)))
    state = {"w": torch.zeros(3, 2)}
    report = load_hf(state, str(tmp_path), names={"w": ["e.0", "e.1", "e.2"]})
    assert state["w"].tolist() == [[0, 1], [2, 3], [4, 5]] and report.loaded == ["w"]
    with pytest.raises(StateMismatchError, match=r"w: 2 folder tensors stacked on the first "
                                                 r"dimension, but its shape is \[3, 2\]"):
        load_hf({"w": torch.zeros(3, 2)}, str(tmp_path), names={"w": ["e.0", "e.1"]})
    with pytest.raises(StateMismatchError, match=r"w \(as e\.9\)"):
        load_hf({"w": torch.zeros(3, 2)}, str(tmp_path), names={"w": ["e.0", "e.1", "e.9"]})


# -- folders ------------------------------------------------------------------------------
class _Planted:
    """Unpickling this writes a marker file: proof that nothing was unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_folder_is_refused_and_never_unpickled(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Planted(str(marker))))
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError) as err:
        load_hf({"a": torch.zeros(1)}, str(folder))
    message = str(err.value)
    assert "pytorch_model.bin" in message and "save_pretrained" in message, message
    assert "\n" not in message and not marker.exists()


def test_empty_or_missing_folder_says_what_it_needs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist or is empty"):
        load_hf({}, str(tmp_path / "nowhere"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="holds neither model.safetensors"):
        load_hf({}, str(tmp_path / "other"))


@needs_transformers
def test_loads_into_transformers_and_casts(llama):
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(llama.folder, local_files_only=True)
    for dtype in (torch.float32, torch.bfloat16):
        model = LlamaForCausalLM(config).to(dtype)
        report = ckpt.load_hf(model, llama.folder)
        for key, value in model.state_dict().items():
            assert value.dtype == dtype and torch.equal(value, llama.weights[key].to(dtype)), key
        assert not report.missing and not report.unexpected
        assert report.tensor_bytes_read == sum(v.nbytes for v in llama.weights.values())


@needs_transformers
def test_reference_model_takes_the_folder_under_the_export_names(llama):
    model = Transformer(MODEL).eval()
    names = hf_names(MODEL)
    load_hf(model, llama.folder, names=names)
    for key, value in model.state_dict().items():
        assert torch.equal(value, llama.weights[names[key]]), key
    with torch.no_grad():
        torch.testing.assert_close(model(llama.tokens), llama.logits, rtol=1e-5, atol=1e-5)


@needs_transformers
def test_missing_unexpected_and_misshaped_keys_are_named_in_one_line(llama):
    names = hf_names(MODEL)
    state = Transformer(MODEL).state_dict()
    del state["norm.weight"]
    state["extra.weight"] = torch.zeros(3)
    with pytest.raises(StateMismatchError) as err:
        load_hf(state, llama.folder, names=names)
    message = str(err.value)
    assert "\n" not in message, message
    assert err.value.missing == ["extra.weight"] and err.value.unexpected == ["model.norm.weight"]
    report = load_hf(state, llama.folder, names=names, strict=False)
    assert report.missing == ["extra.weight"] and report.unexpected == ["model.norm.weight"]
    assert torch.equal(state["output.weight"], llama.weights["lm_head.weight"])
    # Without the names, every key is missing and every tensor unexpected: listed, bounded.
    with pytest.raises(StateMismatchError, match=r"and \d+ more; pass names=") as err:
        load_hf(Transformer(MODEL).state_dict(), llama.folder)
    assert "\n" not in str(err.value)
    # A shape or a dtype that cannot be cast is a mismatch, strict or not.
    wider = Transformer(ModelConfig(**{**MODEL.__dict__, "ffn_dim": 128})).state_dict()
    with pytest.raises(StateMismatchError, match=r"shape \[96, 64\] in the folder, \[128, 64\]"):
        load_hf(wider, llama.folder, names=names, strict=False)
    ints = {"tok_embeddings.weight": torch.zeros(128, 64, dtype=torch.int32)}
    with pytest.raises(StateMismatchError, match="only floating-point tensors are cast"):
        load_hf(ints, llama.folder, names=names, strict=False)


@needs_transformers
def test_a_cache_snapshot_of_links_is_read_through_them(llama, tmp_path):
    """The Hugging Face cache's snapshots are links into blobs/: they are followed."""
    snapshot, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in os.listdir(llama.folder):
        blob = blobs / f"blob-{name}"
        blob.write_bytes(open(os.path.join(llama.folder, name), "rb").read())
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    model = Transformer(MODEL)
    load_hf(model, str(snapshot), names=hf_names(MODEL))
    assert torch.equal(model.state_dict()["output.weight"], llama.weights["lm_head.weight"])


# -- the trainer's initial load, on every layout -------------------------------------------
LAYOUTS = {
    "dp2": (2, ("--parallel.dp=2",)),
    "tp2": (2, ("--parallel.tp=2", "--parallel.dp=1")),
    "pp2": (2, ("--parallel.pp=2", "--parallel.dp=1")),
    "dp2xtp2": (4, ("--parallel.dp=2", "--parallel.tp=2")),
}


def _import_job(rank: int, world: int, folder: str, root: str, extra: tuple,
                tokens: torch.Tensor) -> dict:
    """Build the trainer with checkpoint.initial_load, let it import and commit step 0,
    then report the bytes a second import reads and the first forward's logits."""
    import torch.distributed as dist

    from tests.e2e._jobs import TINY
    from trainer.config import load_config
    from trainer.distributed import DistEnv
    from trainer.hf import import_hf
    from trainer.train import Trainer

    cfg = load_config(str(TINY), [*MODEL_ARGS, f"--checkpoint.root={root}",
                                  f"--checkpoint.initial_load={folder}",
                                  "--checkpoint.async_save=false", "--checkpoint.keep_last=0",
                                  "--fault.handle_preemption=false", *extra])
    env = DistEnv(rank, world, rank, torch.device("cpu"), "gloo" if world > 1 else None, 0)
    trainer = Trainer(cfg, env)
    try:
        assert trainer.resume() == 0
        report, _ = import_hf(folder, cfg.model, trainer.model,
                              storage_options=cfg.checkpoint.storage_options or None,
                              process_group=trainer.ctl_group)
        expected = own = full = 0  # the rows of each shard, the shard, the whole tensors
        for value in trainer.model.model_state_dict().values():
            full += value.numel() * value.element_size()
            local, sizes = value, tuple(value.shape)
            if isinstance(value, DTensor):
                local, sizes = value.to_local(), tuple(value.__create_chunk_list__()[0].sizes)
            item = value.element_size()
            expected += sizes[0] * math.prod(value.shape[1:]) * item if sizes else item
            own += local.numel() * item
        pm = trainer.model
        with torch.no_grad():
            if pm.par.pp == 1:
                logits = pm.model_parts[0](tokens)
            elif rank == 0:  # pp2 on 2 ranks: stage 0 hands its hidden states to stage 1
                dist.send(pm.model_parts[0](tokens).contiguous(), 1)
                logits = None
            else:
                hidden = torch.empty(*tokens.shape, cfg.model.dim)
                dist.recv(hidden, 0)
                logits = pm.model_parts[0](hidden)
        # As numpy: a tensor would travel to the parent as shared memory of a process gone.
        return {"logits": None if logits is None else logits.numpy(),
                "read": report.tensor_bytes_read, "expected": expected, "own": own,
                "full": full}
    finally:
        trainer.manager.close()


def _check_logits(ours, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(torch.from_numpy(ours), theirs, rtol=1e-5, atol=1e-5)


def _check_export(llama, root: str, out, storage_options=None) -> None:
    """Step 0 exported as a Hugging Face folder: the imported tensors bit for bit (dtype
    included) under their names, and the folder's tokenizer files beside them."""
    from safetensors.torch import load_file

    from ckpt.export import export

    export(root, 0, str(out), format="hf", storage_options=storage_options)
    exported = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            exported.update(load_file(os.path.join(out, name)))
    assert exported.keys() == llama.weights.keys()
    for key, value in llama.weights.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key
    for name, data in TOKENIZER.items():
        assert (out / name).read_bytes() == data


@needs_transformers
def test_initial_load_in_one_process(llama, tmp_path):
    result = _import_job(0, 1, llama.folder, str(tmp_path / "root"), (), llama.tokens)
    _check_logits(result["logits"], llama.logits)
    assert result["read"] == result["expected"] == result["own"]
    _check_export(llama, str(tmp_path / "root"), tmp_path / "out")


@needs_transformers
def test_every_checkpoint_damaged_starts_over_from_the_folder(llama, tmp_path, caplog):
    """With checkpoint.allow_fresh_start_over_damaged, a fine-tuning job whose every
    checkpoint is damaged starts over from the folder (step 0 is the import), never from a
    random init, and commits that step 0 again."""
    from ckpt.root import CheckpointStore
    from tests.ckpt._helpers import flip_byte
    from tests.e2e._jobs import TINY
    from trainer.config import load_config
    from trainer.distributed import DistEnv
    from trainer.train import Trainer

    root = tmp_path / "root"

    def trainer(*extra: str) -> Trainer:
        cfg = load_config(str(TINY), [*MODEL_ARGS, f"--checkpoint.root={root}",
                                      f"--checkpoint.initial_load={llama.folder}",
                                      "--checkpoint.async_save=false",
                                      "--fault.handle_preemption=false", *extra])
        return Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))

    first = trainer()
    try:
        assert first.resume() == 0
    finally:
        first.manager.close()
    store = CheckpointStore(str(root))
    manifest = store.read_manifest(0, complete=True)
    loc = manifest.tensors[sorted(k for k in manifest.tensors if k.startswith("app."))[0]][
        "chunks"][0]["location"]
    flip_byte(str(root / "step_000000000" / loc.file), loc.offset + 1)

    again = trainer("--checkpoint.allow_fresh_start_over_damaged=true")
    try:
        with caplog.at_level("WARNING", logger="trainer"):
            assert again.resume() == 0
        names = hf_names(MODEL)
        for key, value in again.model.model_state_dict().items():
            assert torch.equal(value, llama.weights[names[key]]), key
    finally:
        again.manager.close()
    assert "imported from checkpoint.initial_load" in caplog.text, caplog.text
    assert store.committed_steps() == [0]
    store.verify(0)


@needs_transformers
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_initial_load_on_a_layout(llama, tmp_path, layout):
    world, extra = LAYOUTS[layout]
    root = str(tmp_path / "root")
    results = run_ranks(_import_job, world, llama.folder, root, extra, llama.tokens)
    for r in results:
        if r["logits"] is not None:
            _check_logits(r["logits"], llama.logits)
        assert r["read"] == r["expected"], r  # the rows of its own shards, nothing more
        if "tp" not in layout:  # every shard is a slice along dim 0: exactly its bytes
            assert r["read"] == r["own"], r
        if layout != "pp2":  # FSDP2 / TP shards: no rank holds or reads a whole tensor
            assert r["read"] < r["full"], r
    assert sum(r["logits"] is not None for r in results) == (1 if layout == "pp2" else world)
    _check_export(llama, root, tmp_path / "out")


MIXTRAL_ARGS = ("--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=48")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral folder as transformers saves one (``save_pretrained``: Mixtral's
    per-expert layout, several shards), the Llama fixture's sizes with 4 experts, top-2;
    its tensors and its logits for ``tokens``."""
    from safetensors.torch import load_file
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.ckpt._hf_llama import LLAMA

    torch.manual_seed(0)
    sizes = {**LLAMA, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2}
    model = MixtralForCausalLM(MixtralConfig(**sizes)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("mixtral") / "hf"
    model.save_pretrained(folder, max_shard_size="40KB")
    tokens = torch.randint(0, sizes["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
    weights = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            weights.update(load_file(folder / name))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in weights
    return SimpleNamespace(folder=str(folder), tokens=tokens, logits=logits, weights=weights)


@needs_transformers
def test_mixtral_folder_into_expert_parallel_shards(mixtral, tmp_path):
    """ep2 on 4 ranks (each expert FSDP-sharded over the 2 ranks holding it): every rank
    reads the rows of its own experts' shards, the logits are transformers', and step 0
    exports back to the folder's tensors, expert by expert."""
    from safetensors.torch import load_file

    from ckpt.export import export

    root = str(tmp_path / "root")
    extra = (*MIXTRAL_ARGS, "--parallel.dp=4", "--parallel.ep=2")
    for r in run_ranks(_import_job, 4, mixtral.folder, root, extra, mixtral.tokens):
        _check_logits(r["logits"], mixtral.logits)
        assert r["read"] == r["expected"] == r["own"], r
    out = tmp_path / "out"
    export(root, 0, str(out), format="hf")
    exported = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            exported.update(load_file(out / name))
    assert exported.keys() == mixtral.weights.keys()
    for key, value in mixtral.weights.items():
        assert torch.equal(exported[key], value), key


@needs_transformers
def test_initial_load_from_s3(llama, s3_server, tmp_path):
    s3 = s3_server.client()
    prefix = s3_server.new_root("hf-import").prefix
    for name in os.listdir(llama.folder):
        s3.upload_file(os.path.join(llama.folder, name), s3_server.bucket, f"{prefix}/hf/{name}")
    folder, root = f"s3://{s3_server.bucket}/{prefix}/hf", f"s3://{s3_server.bucket}/{prefix}/root"
    options = {"endpoint_url": s3_server.endpoint_url}
    try:
        extra = ("--parallel.dp=2",
                 f"--checkpoint.storage_options.endpoint_url={options['endpoint_url']}")
        results = run_ranks(_import_job, 2, folder, root, extra, llama.tokens)
        for r in results:
            _check_logits(r["logits"], llama.logits)
            assert r["read"] == r["expected"] == r["own"], r
        _check_export(llama, root, tmp_path / "out", storage_options=options)
    finally:
        s3_server.delete_prefix(prefix)
