"""Instruction encoding for the tiny VLA: words as bags of hashed character trigrams, then a small transformer.

Every word maps to the hashed ids of its trigrams (with boundary marks) plus one id for the whole word, so
a word never seen in training ("dish", "transfer") still shares subwords with known ones, and nothing needs a
vocabulary file or a download. Hashing uses CRC32, which is stable across processes (Python's `hash` is not).
"""

from __future__ import annotations

import re
import zlib

import torch
from torch import Tensor, nn

MAX_NGRAMS_PER_WORD = 12
_WORD = re.compile(r"[a-z0-9]+")


def word_ngrams(word: str, buckets: int) -> list[int]:
    """Ids (1..buckets-1; 0 is padding) of a word's character trigrams and of the word itself."""
    marked = f"<{word}>"
    grams = [marked] + [marked[i : i + 3] for i in range(len(marked) - 2)]
    ids = [1 + zlib.crc32(g.encode()) % (buckets - 1) for g in grams]
    return ids[:MAX_NGRAMS_PER_WORD]


class HashTokenizer:
    """Instructions to (ids (B, W, G), word mask (B, W)); lower-cased, punctuation dropped."""

    def __init__(self, buckets: int, max_words: int) -> None:
        self.buckets, self.max_words = buckets, max_words
        self._cache: dict[str, list[list[int]]] = {}
        self._rows: dict[str, Tensor] = {}  # each instruction's (max_words, ngrams) ids, built once

    def __getstate__(self) -> dict:
        """Pickled (a policy sent to rollout workers) without its caches: they are rebuilt on use."""
        return {**self.__dict__, "_cache": {}, "_rows": {}}

    def words(self, text: str) -> list[list[int]]:
        if text not in self._cache:
            words = _WORD.findall(text.lower())[: self.max_words] or [""]
            self._cache[text] = [word_ngrams(w, self.buckets) for w in words]
        return self._cache[text]

    def __call__(self, texts: list[str], device: torch.device | str = "cpu", *, filler_words: float = 0.0) -> tuple[Tensor, Tensor]:
        """`filler_words` (training): the share of instructions that get one or two random letter strings inserted
        at random places, so that the encoder learns to pass over words it does not know ("could you", "dish")."""
        rows = []
        for text in texts:
            if filler_words and torch.rand(()) < filler_words:
                rows.append(self._ids(self._with_fillers(self.words(text))))
            else:
                if text not in self._rows:
                    self._rows[text] = self._ids(self.words(text))
                rows.append(self._rows[text])
        ids = torch.stack(rows) if rows else torch.zeros(0, self.max_words, MAX_NGRAMS_PER_WORD, dtype=torch.long)
        mask = ids[:, :, 0] > 0
        return ids.to(device), mask.to(device)

    def _ids(self, words: list[list[int]]) -> Tensor:
        ids = torch.zeros(self.max_words, MAX_NGRAMS_PER_WORD, dtype=torch.long)
        for w, grams in enumerate(words):
            ids[w, : len(grams)] = torch.tensor(grams)
        return ids

    def _with_fillers(self, words: list[list[int]]) -> list[list[int]]:
        words = list(words)
        for _ in range(min(int(torch.randint(1, 3, ())), self.max_words - len(words))):
            letters = torch.randint(0, 26, (int(torch.randint(3, 8, ())),)).tolist()
            filler = word_ngrams("".join(chr(ord("a") + i) for i in letters), self.buckets)
            words.insert(int(torch.randint(0, len(words) + 1, ())), filler)
        return words


class TextEncoder(nn.Module):
    """(ids, mask) -> per-word features (B, W, D) and a pooled instruction feature (B, D).

    `positions` says how a word knows where it sits: "absolute", a learned embedding per slot; "relative", no slot at
    all, each word's embedding joined by a width-3 convolution over its neighbours (left and right apart), so the
    features, and what reads them, depend on word order but not on where in the sentence a phrase starts."""

    def __init__(self, buckets: int, dim: int, layers: int, max_words: int, *, positions: str = "absolute") -> None:
        super().__init__()
        if positions not in ("absolute", "relative"):
            raise ValueError(f"TextEncoder positions must be 'absolute' or 'relative'; got {positions!r}")
        self.embed = nn.EmbeddingBag(buckets, dim, mode="mean", padding_idx=0)
        self.position = nn.Parameter(torch.zeros(max_words, dim)) if positions == "absolute" else None
        self.neighbours = nn.Conv1d(dim, dim, kernel_size=3, padding=1) if positions == "relative" else None
        if self.position is not None:
            nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False) if layers else None
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: Tensor, mask: Tensor, *, jitter_positions: bool = False) -> tuple[Tensor, Tensor]:
        """`jitter_positions` (training, absolute positions): each instruction's words take the positions from a
        random start in 0..max_words − its length, so that the encoder learns word order rather than which slot a
        word sits in (a paraphrase that moves the object two words on is then still read)."""
        B, W, G = ids.shape
        words = self.embed(ids.reshape(B * W, G)).reshape(B, W, -1)
        if self.neighbours is not None:
            words = words * mask[..., None]  # padding is no neighbour
            words = words + self.neighbours(words.transpose(1, 2)).transpose(1, 2)
        else:
            slots = torch.arange(W, device=ids.device).expand(B, W)
            if jitter_positions:
                room = (self.position.shape[0] - mask.sum(1, keepdim=True)).clamp(min=0)
                start = (torch.rand(B, 1, device=ids.device) * (room + 1)).long()
                slots = (slots + start).clamp(max=self.position.shape[0] - 1)
            words = words + self.position[slots]
        if self.encoder is not None:
            words = self.encoder(words, src_key_padding_mask=~mask)
        words = self.norm(words) * mask[..., None]
        pooled = words.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return words, pooled
