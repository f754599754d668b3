"""Per-sequence key/value cache: one growable tensor holding every layer's keys and values."""

from __future__ import annotations

import torch


class SequenceKVCache:
    """Keys and values of one sequence, [layers, 2, kv_heads, capacity, head_dim], grown by doubling."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_len: int):
        self.shape = (num_layers, 2, num_kv_heads)
        self.head_dim, self.dtype, self.max_len = head_dim, dtype, max_len
        self.kv = torch.empty(0)
        self.length = 0  # tokens whose keys/values are stored
        self._start = self._count = 0

    def begin(self, count: int) -> None:
        """Make room for `count` new tokens written by the next forward."""
        need = self.length + count
        if need > self.kv.shape[3] if self.kv.dim() == 5 else True:
            cap = min(self.max_len, max(64, 1 << (need - 1).bit_length()))
            grown = torch.empty(*self.shape, max(cap, need), self.head_dim, dtype=self.dtype)
            if self.length:
                grown[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
            self.kv = grown
        self._start, self._count = self.length, count

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store this forward's k/v ([T, kv_heads, head_dim]); return all keys/values and the attention mask."""
        s, t = self._start, k.shape[0]
        end = s + t
        self.kv[layer, 0, :, s:end] = k.transpose(0, 1)
        self.kv[layer, 1, :, s:end] = v.transpose(0, 1)
        keys, values = self.kv[layer, 0, :, :end], self.kv[layer, 1, :, :end]
        if t == 1:
            return keys, values, None, False
        if s == 0:
            return keys, values, None, True
        q_pos = torch.arange(s, end).unsqueeze(1)
        mask = torch.arange(end).unsqueeze(0) <= q_pos
        return keys, values, mask, False

    def commit(self) -> None:
        self.length = self._start + self._count

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)
