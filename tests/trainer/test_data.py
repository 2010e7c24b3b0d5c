"""Data: determinism, dp-independent order, resumable JSON state, learnable synthetic data,
memory-mapped token files and their errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from trainer.config import load_config
from trainer.data import (
    BatchLoader,
    DataError,
    DataFileNotFoundError,
    SyntheticMarkovDataset,
    TokenFileDataset,
    _feistel_permute,
    build_loader,
    split_microbatches,
)

V, L, B = 64, 16, 8


def _synthetic(seed: int = 0) -> SyntheticMarkovDataset:
    return SyntheticMarkovDataset(V, L, seed=seed)


def _token_file(tmp_path, n_tokens: int = 1000, dtype=np.uint16, vocab: int = V) -> str:
    path = tmp_path / "tokens.bin"
    (np.arange(n_tokens) % vocab).astype(dtype).tofile(path)
    return str(path)


def _concat_dp(make, dp: int, batch_index: int):
    parts = [BatchLoader(make(), B, r, dp).batch(batch_index) for r in range(dp)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def test_samples_are_pure_functions_of_seed_and_index():
    ds = _synthetic()
    batch = ds.get(np.arange(10))
    assert batch.shape == (10, L + 1) and batch.dtype == torch.int64
    assert torch.equal(_synthetic().get(np.array([7, 3])), batch[[7, 3]])
    assert not torch.equal(_synthetic(seed=1).get(np.arange(10)), batch)
    assert int(batch.max()) < V and int(batch.min()) >= 0


def test_inputs_and_targets_are_shifted():
    tokens = _synthetic().get(np.arange(B))
    x, y = BatchLoader(_synthetic(), B).next_batch()
    assert torch.equal(x, tokens[:, :-1]) and torch.equal(y, tokens[:, 1:])


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_dp_slices_concatenate_to_the_global_batch(dp):
    for b in (0, 3):
        full = BatchLoader(_synthetic(), B).batch(b)
        x, y = _concat_dp(_synthetic, dp, b)
        assert torch.equal(x, full[0]) and torch.equal(y, full[1])


def test_resume_on_another_dp_degree_continues_the_same_order():
    reference = BatchLoader(_synthetic(), B)
    expected = [reference.next_batch() for _ in range(6)]
    first = BatchLoader(_synthetic(), B, 0, 2)
    for _ in range(3):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = []
    for rank in range(4):
        loader = BatchLoader(_synthetic(), B, rank, 4)
        loader.load_state_dict(state)
        assert loader.global_batch_index == 3
        resumed.append([loader.next_batch() for _ in range(3)])
    for k in range(3):
        x = torch.cat([resumed[r][k][0] for r in range(4)])
        assert torch.equal(x, expected[3 + k][0])


def test_state_is_json_safe_and_round_trips():
    loader = BatchLoader(_synthetic(), B)
    for _ in range(5):
        loader.next_batch()
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert all(isinstance(v, (int, str)) for v in state.values())
    other = BatchLoader(_synthetic(), B)
    other.load_state_dict(json.loads(json.dumps(state)))
    assert other.global_batch_index == 5
    assert torch.equal(other.next_batch()[0], loader.next_batch()[0])


def test_state_mismatches_are_rejected():
    state = BatchLoader(_synthetic(), B).state_dict()
    with pytest.raises(DataError, match="data.seed: the checkpoint was trained with seed 0"):
        BatchLoader(_synthetic(seed=1), B).load_state_dict(state)
    with pytest.raises(DataError, match="the checkpoint was trained on"):
        BatchLoader(SyntheticMarkovDataset(V, L + 1), B).load_state_dict(state)
    with pytest.raises(DataError, match="format"):
        BatchLoader(_synthetic(), B).load_state_dict({**state, "format": "x"})


def test_global_batch_size_change_on_a_boundary():
    loader = BatchLoader(_synthetic(), B)
    for _ in range(4):  # 32 samples
        loader.next_batch()
    bigger = BatchLoader(_synthetic(), 2 * B)
    bigger.load_state_dict(loader.state_dict())
    assert bigger.global_batch_index == 2
    loader.next_batch()  # 40 samples: not a multiple of 16
    with pytest.raises(DataError, match="global_batch_size"):
        BatchLoader(_synthetic(), 2 * B).load_state_dict(loader.state_dict())


def test_synthetic_data_is_learnable_not_noise():
    ds = SyntheticMarkovDataset(256, 64, seed=0)
    floor = ds.entropy_floor
    assert floor < 0.4 * math.log(256)
    tokens = ds.get(np.arange(200)).numpy()
    prev, nxt = tokens[:, :-1].ravel(), tokens[:, 1:].ravel()
    in_support = (ds.successors[prev] == nxt[:, None]).any(axis=1).mean()
    assert in_support > 0.9  # uniform noise would give ~branching / vocab = 1.6%
    nll = -np.log(ds.transition_matrix()[prev, nxt]).mean()
    assert nll == pytest.approx(floor, rel=0.1)
    assert np.allclose(ds.transition_matrix().sum(axis=1), 1.0)


def test_loader_rejects_bad_dp():
    with pytest.raises(DataError, match="global_batch_size: 8 is not divisible by the dp degree 3"):
        BatchLoader(_synthetic(), 8, 0, 3)
    with pytest.raises(DataError, match="outside"):
        BatchLoader(_synthetic(), 8, 2, 2)


@pytest.mark.parametrize("n", [1, 2, 5, 64, 1000, 4097])
def test_feistel_is_a_permutation(n):
    perm = _feistel_permute(np.arange(n), n, key=12345)
    assert sorted(perm.tolist()) == list(range(n))


@pytest.mark.parametrize("dtype,name", [(np.uint16, "uint16"), (np.uint32, "uint32")])
def test_token_file_windows(tmp_path, dtype, name):
    path = _token_file(tmp_path, 1000, dtype)
    ds = TokenFileDataset(path, L, V, token_dtype=name, seed=3)
    assert ds.num_windows == (1000 - 1) // L
    tokens = ds.get(np.arange(ds.num_windows)).numpy()
    raw = np.fromfile(path, dtype=dtype).astype(np.int64)
    starts = ds.window_starts(np.arange(ds.num_windows))
    assert sorted(starts.tolist()) == [w * L for w in range(ds.num_windows)]  # one epoch
    for row, s in zip(tokens, starts):
        assert np.array_equal(row, raw[s: s + L + 1])
    # the next epoch is another order of the same windows
    nxt = ds.window_starts(np.arange(ds.num_windows, 2 * ds.num_windows))
    assert sorted(nxt.tolist()) == sorted(starts.tolist()) and nxt.tolist() != starts.tolist()


def test_token_file_order_is_dp_independent(tmp_path):
    path = _token_file(tmp_path)
    make = lambda: TokenFileDataset(path, L, V)  # noqa: E731
    full = BatchLoader(make(), B).batch(2)
    assert torch.equal(_concat_dp(make, 4, 2)[0], full[0])


def test_token_file_errors(tmp_path):
    with pytest.raises(DataFileNotFoundError, match="missing.bin") as e:
        TokenFileDataset(str(tmp_path / "missing.bin"), L, V)
    assert isinstance(e.value, FileNotFoundError)
    small = _token_file(tmp_path, L)  # needs L + 1
    with pytest.raises(DataError, match=r"tokens.bin: holds 16 tokens, fewer than"):
        TokenFileDataset(small, L, V)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 101)
    with pytest.raises(DataError, match="odd.bin: size 101 bytes is not a multiple of 2"):
        TokenFileDataset(str(odd), L, V)
    big = _token_file(tmp_path, 1000, vocab=200)
    with pytest.raises(DataError, match=r"tokens.bin: token id 64 at token offset 64 is >= "
                                        r"model.vocab_size=64"):
        TokenFileDataset(big, L, V)


def test_out_of_range_token_past_the_scan_is_caught_per_sample(tmp_path, monkeypatch):
    path = _token_file(tmp_path, 1000)
    raw = np.fromfile(path, dtype=np.uint16)
    raw[900] = 60000
    raw.tofile(path)
    monkeypatch.setattr(TokenFileDataset, "_SCAN_TOKENS", 100)
    ds = TokenFileDataset(path, L, V)
    with pytest.raises(DataError, match=r"token id 60000 at token offset 900.*uint32"):
        ds.get(np.arange(ds.num_windows))


def test_build_loader_from_config(tmp_path):
    path = _token_file(tmp_path)
    cfg = load_config(None, ["--data.kind=tokens", f"--data.path={path}", "--model.vocab_size=64",
                             "--training.seq_len=16", "--training.global_batch_size=8"])
    x, y = build_loader(cfg, 1, 2).next_batch()
    assert x.shape == (4, 16) and y.shape == (4, 16)
    x, _ = build_loader(load_config(None, []), 0, 1).next_batch()
    assert x.shape == (16, 32)


def test_split_microbatches():
    x, y = BatchLoader(_synthetic(), B).next_batch()
    chunks = split_microbatches(x, y, 4)
    assert len(chunks) == 4 and chunks[0][0].shape == (2, L)
    assert torch.equal(torch.cat([c[0] for c in chunks]), x)
    with pytest.raises(DataError, match="grad_accum_steps"):
        split_microbatches(x, y, 3)
