"""Deterministic, resumable training data whose order does not depend on the dp degree.

Contract
--------
* A dataset maps a *global sample index* ``i`` (0, 1, 2, ...) to ``seq_len + 1`` tokens, as a
  pure function of ``(data.seed, i)``: no hidden state, no global RNG, no dependence on rank.
* Global batch ``b`` is samples ``[b * B, (b + 1) * B)`` with ``B = training.global_batch_size``.
  dp rank ``r`` of ``D`` takes the contiguous slice ``[r * B / D, (r + 1) * B / D)`` of it, so
  the concatenation over dp ranks is the same global batch for every ``D`` and a job resumed
  on another dp degree continues the same sequence of global batches. Under HSDP ``r`` and
  ``D`` are the whole dp rank and degree (``dp_replicate * dp_shard``; ``trainer.mesh.dp_mesh``):
  replicas see different data, as every DDP/FSDP rank does.
* Inputs are ``tokens[:, :-1]``, targets ``tokens[:, 1:]`` (int64).
* :meth:`BatchLoader.state_dict` is JSON-safe (ints and strings). Every dp rank calls
  ``next_batch`` once per optimizer step; the state is identical on every rank, so rank 0's
  copy is enough to resume all of them. It holds nothing per-rank (each rank's slice comes
  from the ``(dp_rank, dp_size)`` it is constructed with), so it is checkpointed under one
  shared key, and ckpt refuses a save in which ranks' copies differ (docs/store.md,
  "Per-rank state").

Randomness is counter-based (SplitMix64 over ``(seed, stream, i, t)`` in numpy uint64), so it
is identical across machines and library versions.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

__all__ = [
    "DataError",
    "DataFileNotFoundError",
    "SyntheticMarkovDataset",
    "TokenFileDataset",
    "BatchLoader",
    "build_dataset",
    "build_loader",
    "split_microbatches",
]

_STATE_FORMAT = "trainer.data/1"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class DataError(ValueError):
    """A data file or loader state is unusable; the message names the file/key and the fix."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """``data.path`` does not exist."""


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _hash(*parts: Any) -> np.ndarray:
    """Hash integers/arrays (broadcast together) to uint64, order-sensitively."""
    h = np.zeros((), dtype=np.uint64)
    for p in parts:
        h = _splitmix64(h ^ np.asarray(p).astype(np.uint64))
    return h


def _uniform(*parts: Any) -> np.ndarray:
    """Float64 in [0, 1) from :func:`_hash` (53 random bits)."""
    return (_hash(*parts) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _feistel_permute(j: np.ndarray, n: int, key: int) -> np.ndarray:
    """A bijection of ``[0, n)`` keyed by ``key``: 4-round Feistel plus cycle walking.
    Needs O(1) memory, so it scales to billions of windows."""
    half = max(1, (max(1, math.ceil(math.log2(max(n, 2)))) + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)

    def once(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for r in range(4):
            left, right = right, left ^ (_hash(key, r, right) & mask)
        return (left << shift) | right

    x = np.asarray(j, dtype=np.uint64)
    out = once(x)
    bad = out >= np.uint64(n)
    while bad.any():  # walk the cycle until back inside [0, n); expected < 4 rounds
        out[bad] = once(out[bad])
        bad = out >= np.uint64(n)
    return out.astype(np.int64)


class SyntheticMarkovDataset:
    """A learnable synthetic language: a fixed sparse first-order Markov chain.

    From ``seed``, each token ``s`` gets ``branching`` successor tokens with random
    probabilities; with probability ``noise`` the next token is instead uniform. Sample ``i``
    starts at a token drawn from ``(seed, i)`` and walks ``seq_len`` steps. A model that learns
    the chain reaches :attr:`entropy_floor` nats/token (vs ``log(vocab_size)`` for guessing).
    """

    def __init__(self, vocab_size: int, seq_len: int, *, seed: int = 0, branching: int = 4,
                 noise: float = 0.05):
        if vocab_size < 2 or seq_len < 1 or branching < 1 or not 0 <= noise <= 1:
            raise DataError(f"synthetic dataset: bad parameters vocab_size={vocab_size}, "
                            f"seq_len={seq_len}, branching={branching}, noise={noise}")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.branching, self.noise = branching, noise
        states = np.arange(vocab_size)[:, None]
        slots = np.arange(branching)[None, :]
        self.successors = (_hash(seed, 101, states, slots) % np.uint64(vocab_size)).astype(np.int64)
        weights = -np.log1p(-_uniform(seed, 102, states, slots))  # Dirichlet(1) via exponentials
        self.probs = weights / weights.sum(axis=1, keepdims=True)
        self._cdf = np.cumsum(self.probs, axis=1)
        self.identity = (f"synthetic:V={vocab_size}:k={branching}:noise={noise!r}:L={seq_len}")

    def get(self, indices: np.ndarray) -> torch.Tensor:
        """Tokens of samples ``indices`` as an int64 tensor of shape ``(n, seq_len + 1)``."""
        idx = np.asarray(indices, dtype=np.int64)[:, None]
        steps = np.arange(self.seq_len + 1)[None, :]
        pick = _uniform(self.seed, 1, idx, steps)
        is_noise = _uniform(self.seed, 2, idx, steps) < self.noise
        noise_tok = (_hash(self.seed, 3, idx, steps) % np.uint64(self.vocab_size)).astype(np.int64)
        out = np.empty((idx.shape[0], self.seq_len + 1), dtype=np.int64)
        cur = noise_tok[:, 0]
        out[:, 0] = cur
        for t in range(1, self.seq_len + 1):
            slot = np.minimum((pick[:, t, None] > self._cdf[cur]).sum(axis=1), self.branching - 1)
            cur = np.where(is_noise[:, t], noise_tok[:, t], self.successors[cur, slot])
            out[:, t] = cur
        return torch.from_numpy(out)

    def transition_matrix(self) -> np.ndarray:
        """Dense ``(V, V)`` next-token probabilities (for tests and small vocabularies)."""
        v = self.vocab_size
        p = np.full((v, v), self.noise / v)
        np.add.at(p, (np.repeat(np.arange(v), self.branching), self.successors.ravel()),
                  (1 - self.noise) * self.probs.ravel())
        return p

    @property
    def entropy_floor(self) -> float:
        """Entropy rate in nats/token under the chain's stationary distribution: the lowest
        mean cross-entropy any model can reach (the uniform start makes it approximate)."""
        v, eps = self.vocab_size, self.noise
        rows = np.repeat(np.arange(v), self.branching)
        cols, w = self.successors.ravel(), (1 - eps) * self.probs.ravel()
        pi = np.full(v, 1.0 / v)
        for _ in range(500):
            nxt = np.full(v, eps / v)
            np.add.at(nxt, cols, pi[rows] * w)
            done = np.abs(nxt - pi).sum() < 1e-12
            pi = nxt
            if done:
                break
        h = np.zeros(v)
        for s in range(v):
            q: dict[int, float] = {}
            for c, p in zip(self.successors[s], self.probs[s]):
                q[int(c)] = q.get(int(c), eps / v) + (1 - eps) * p
            qs = np.array(list(q.values()))
            h[s] = -(qs * np.log(qs)).sum()
            if eps > 0:
                h[s] -= (v - len(q)) * (eps / v) * math.log(eps / v)
        return float((pi * h).sum())


class TokenFileDataset:
    """Windows of ``seq_len + 1`` tokens from a memory-mapped ``.bin`` of uint16/uint32 ids.

    The file is cut into ``(n_tokens - 1) // seq_len`` windows at stride ``seq_len`` (adjacent
    windows share one boundary token). Sample ``i`` is window ``perm_e(i mod N)`` of epoch
    ``e = i // N``, with ``perm_e`` a keyed permutation of ``(seed, e)``. Ids ``>= vocab_size``
    raise :class:`DataError` naming the file and offset (checked per sample, plus a scan of
    the first million tokens on open).
    """

    _SCAN_TOKENS = 1 << 20

    def __init__(self, path: str, seq_len: int, vocab_size: int, *, token_dtype: str = "uint16",
                 seed: int = 0):
        if token_dtype not in ("uint16", "uint32"):
            raise DataError(f"data.token_dtype: must be 'uint16' or 'uint32', got {token_dtype!r}")
        if not os.path.isfile(path):
            raise DataFileNotFoundError(f"data.path: token file not found: {path}; point "
                                        "data.path at an existing .bin file")
        dtype = np.dtype(token_dtype).newbyteorder("<")
        size = os.path.getsize(path)
        if size % dtype.itemsize:
            raise DataError(f"{path}: size {size} bytes is not a multiple of {dtype.itemsize} "
                            f"({token_dtype}); is data.token_dtype right?")
        n_tokens = size // dtype.itemsize
        if n_tokens < seq_len + 1:
            raise DataError(f"{path}: holds {n_tokens} tokens, fewer than training.seq_len + 1 "
                            f"= {seq_len + 1}; use a bigger file or a shorter seq_len")
        self.path, self.seq_len, self.vocab_size, self.seed = path, seq_len, vocab_size, seed
        self.token_dtype, self.num_tokens = token_dtype, n_tokens
        self.num_windows = (n_tokens - 1) // seq_len
        self._tokens = np.memmap(path, dtype=dtype, mode="r")
        self._check(self._tokens[: self._SCAN_TOKENS], 0)
        self.identity = f"tokens:{os.path.basename(path)}:n={n_tokens}:{token_dtype}:L={seq_len}"

    def _check(self, window: np.ndarray, offset: int) -> None:
        if window.size and int(window.max()) >= self.vocab_size:
            pos = int(np.argmax(window >= self.vocab_size))
            other = "uint32" if self.token_dtype == "uint16" else "uint16"
            raise DataError(f"{self.path}: token id {int(window[pos])} at token offset "
                            f"{offset + pos} is >= model.vocab_size={self.vocab_size}; raise "
                            f"model.vocab_size or check data.token_dtype (maybe {other})")

    def window_starts(self, indices: np.ndarray) -> np.ndarray:
        """Token offset of each sample's window."""
        idx = np.asarray(indices, dtype=np.int64)
        epochs, within = np.divmod(idx, self.num_windows)
        out = np.empty_like(idx)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = _feistel_permute(within[sel], self.num_windows, int(_hash(self.seed, 7, e)))
        return out * self.seq_len

    def get(self, indices: np.ndarray) -> torch.Tensor:
        """Tokens of samples ``indices`` as an int64 tensor of shape ``(n, seq_len + 1)``."""
        starts = self.window_starts(indices)
        out = np.empty((len(starts), self.seq_len + 1), dtype=np.int64)
        for row, s in enumerate(starts):
            window = self._tokens[s: s + self.seq_len + 1]
            self._check(window, int(s))
            out[row] = window
        return torch.from_numpy(out)


class BatchLoader:
    """Yields this dp rank's slice of consecutive global batches; resumable via state dicts.

    Every dp rank constructs it with the same dataset and ``global_batch_size`` and its own
    ``(dp_rank, dp_size)``, and calls :meth:`next_batch` once per optimizer step.
    """

    def __init__(self, dataset: SyntheticMarkovDataset | TokenFileDataset,
                 global_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        if global_batch_size % dp_size:
            raise DataError(f"training.global_batch_size: {global_batch_size} is not divisible "
                            f"by the dp degree {dp_size}; use a multiple of it")
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._next = 0

    @property
    def global_batch_index(self) -> int:
        """Index of the global batch the next :meth:`next_batch` call returns."""
        return self._next

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    def sample_indices(self, batch_index: int) -> np.ndarray:
        """Global sample indices of this rank's slice of global batch ``batch_index``."""
        start = batch_index * self.global_batch_size + self.dp_rank * self.local_batch_size
        return np.arange(start, start + self.local_batch_size, dtype=np.int64)

    def batch(self, batch_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank's slice of any global batch; does not advance."""
        tokens = self.dataset.get(self.sample_indices(batch_index))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 ``(global_batch_size / dp_size, seq_len)``; advances."""
        out = self.batch(self._next)
        self._next += 1
        return out

    def seek(self, batch_index: int) -> None:
        """Make ``batch_index`` the global batch the next :meth:`next_batch` returns (a
        fault-tolerant job sets it from the batches its replica groups committed)."""
        if batch_index < 0:
            raise DataError(f"batch index {batch_index} is negative")
        self._next = int(batch_index)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe position: the next global batch, samples consumed, seed and dataset."""
        return {
            "format": _STATE_FORMAT,
            "next_batch": self._next,
            "samples_consumed": self._next * self.global_batch_size,
            "global_batch_size": self.global_batch_size,
            "seed": self.dataset.seed,
            "dataset": self.dataset.identity,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. Works across dp degrees; a different global batch size is
        accepted only when the samples consumed fall on one of its batch boundaries. Raises
        :class:`DataError` for another seed, dataset or format."""
        if state.get("format") != _STATE_FORMAT:
            raise DataError(f"data loader state has format {state.get('format')!r}, expected "
                            f"{_STATE_FORMAT!r}; it was not written by this loader")
        if int(state["seed"]) != self.dataset.seed:
            raise DataError(f"data.seed: the checkpoint was trained with seed {state['seed']}, "
                            f"this run uses {self.dataset.seed}; set --data.seed="
                            f"{state['seed']} to resume the same sample order")
        if state["dataset"] != self.dataset.identity:
            raise DataError(f"data: the checkpoint was trained on {state['dataset']!r}, this "
                            f"run reads {self.dataset.identity!r}; use the same data.* and "
                            "training.seq_len settings to resume")
        consumed = int(state["samples_consumed"])
        if consumed % self.global_batch_size:
            raise DataError(f"training.global_batch_size: the checkpoint consumed {consumed} "
                            f"samples, not a whole number of batches of {self.global_batch_size}"
                            f"; resume with global_batch_size={state['global_batch_size']}")
        self._next = consumed // self.global_batch_size


def build_dataset(cfg) -> SyntheticMarkovDataset | TokenFileDataset:
    """The dataset described by ``cfg.data`` for ``cfg.training.seq_len`` and
    ``cfg.model.vocab_size`` (``cfg`` is a :class:`trainer.config.Config`)."""
    d, seq_len, vocab = cfg.data, cfg.training.seq_len, cfg.model.vocab_size
    if d.kind == "synthetic":
        return SyntheticMarkovDataset(vocab, seq_len, seed=d.seed, branching=d.synthetic_branching,
                                      noise=d.synthetic_noise)
    return TokenFileDataset(d.path, seq_len, vocab, token_dtype=d.token_dtype, seed=d.seed)


def build_loader(cfg, dp_rank: int = 0, dp_size: int = 1,
                 global_batch_size: int | None = None) -> BatchLoader:
    """A :class:`BatchLoader` over :func:`build_dataset` for one dp rank. ``global_batch_size``
    defaults to ``training.global_batch_size`` (a replica group's loader reads its group's
    share of it: see ``trainer.train``)."""
    return BatchLoader(build_dataset(cfg), global_batch_size or cfg.training.global_batch_size,
                       dp_rank, dp_size)


def split_microbatches(inputs: torch.Tensor, targets: torch.Tensor,
                       num_chunks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a local batch into ``num_chunks`` equal (inputs, targets) micro-batches along
    dim 0, in order (for gradient accumulation). Raises :class:`DataError` if uneven."""
    n = inputs.shape[0]
    if num_chunks < 1 or n % num_chunks:
        raise DataError(f"training.grad_accum_steps: a local batch of {n} sequences does not "
                        f"split into {num_chunks} equal micro-batches; make "
                        "global_batch_size / dp a multiple of it")
    return list(zip(inputs.chunk(num_chunks), targets.chunk(num_chunks)))
