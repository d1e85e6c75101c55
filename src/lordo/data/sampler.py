"""Deterministic, resumable batch sampling from token memmaps (nanoGPT style random windows).

Batch number ``i`` of worker ``rank`` depends only on (seed, rank, i), so a sampler resumes exactly from
its ``position`` and every worker draws from its own contiguous, disjoint shard of the train tokens.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import DataError


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


class BatchSampler:
    def __init__(
        self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        shard = len(tokens) // world_size
        self.lo, self.hi = rank * shard, (rank + 1) * shard
        if shard < seq_len + 2:
            raise DataError(
                f"each of {world_size} workers gets {shard} train tokens, fewer than one sequence of "
                f"{seq_len + 1}; use fewer workers or a shorter model.seq_len"
            )
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.rank = seed, rank
        self.position = 0
        # a memmapped file that shrinks under a running job would kill it with SIGBUS at the next read (no
        # message, no stop checkpoint): its size is checked before each batch, one stat call
        filename = getattr(tokens, "filename", None) if isinstance(tokens, np.memmap) else None
        self._file = (filename, int(getattr(tokens, "offset", 0)) + tokens.nbytes) if filename else None

    def starts(self, position: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.rank, position])
        return rng.integers(self.lo, self.hi - self.seq_len - 1, size=self.batch_size, endpoint=True)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch_size, seq_len) int64; advances the position by one."""
        if self._file is not None:
            self._check_file(*self._file)
        batch = _windows(self.tokens, self.starts(self.position), self.seq_len)
        self.position += 1
        return batch

    @staticmethod
    def _check_file(filename: str, needed: int) -> None:
        try:
            size = os.stat(filename).st_size
        except OSError as exc:
            raise DataError(f"the token file {filename} is gone while training ({exc.strerror}); restore it (or "
                            "prepare the corpus again) and resume from the last checkpoint") from None
        if size < needed:
            raise DataError(f"the token file {filename} shrank while training ({needed:,} bytes, now {size:,}); "
                            "restore it (or prepare the corpus again) and resume from the last checkpoint")

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches: windows evenly spaced over the whole split."""
    last = len(tokens) - seq_len - 1
    if last < 0:
        raise DataError(f"validation split has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")
    starts = np.linspace(0, last, n_batches * batch_size).astype(np.int64)
    return [_windows(tokens, starts[i * batch_size : (i + 1) * batch_size], seq_len) for i in range(n_batches)]
