"""A plain-text corpus for language-model training: loading, tokens, per-rank windows, validation batches.

Corpus
------
* Default: Debian's ``fortunes`` package (``apt-get install -y fortunes``),
  about 2.5 MB of English text in the files *without* an extension under
  :data:`FORTUNES_DIR` (the ``*.dat`` index files and ``*.u8`` copies are
  skipped). Entries are separated by lines holding a single ``%``; each entry
  is stripped of terminal overstriking (``X<backspace>Y`` -> ``Y``) and
  surrounding blank lines. The entries of all files (in sorted file order)
  are shuffled once with a fixed seed (:data:`FORTUNES_SHUFFLE_SEED`, not the
  training seed, so every run sees the same corpus) and joined with a blank
  line: the validation split, the *last* tokens, is then a sample of entries
  from every file instead of the alphabetically last files.
* ``text_file``: any file, used as is (no shuffling). Char tokens need UTF-8
  text; byte tokens take any file.

Tokens
------
* ``"char"``: one token per Unicode character; the vocabulary is the sorted
  set of characters of the whole corpus (:attr:`TextCorpus.vocab`, saved in
  the training command's result so ids can be decoded).
* ``"byte"``: one token per byte of the UTF-8 encoding (the raw file bytes
  for ``text_file``); vocabulary size 256.

Splits and batches
------------------
The last ``val_fraction`` of the token stream is the validation split, the
rest the training split. :class:`TrainWindows` gives rank ``r`` of ``W`` the
``r``-th of ``W`` equal contiguous chunks of the training split (disjoint
shards) and draws random windows of ``block_size + 1`` tokens inside its chunk
from its own ``torch.Generator`` seeded from ``(seed, rank)`` (never the global
RNG). :func:`validation_batches` is a fixed set of windows evenly spaced over
the validation split, a function of the split and the sizes only: identical
on every rank and for every seed.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np
import torch

__all__ = [
    "FORTUNES_DIR",
    "FORTUNES_INSTALL",
    "FORTUNES_SHUFFLE_SEED",
    "TextCorpus",
    "read_fortunes",
    "load_corpus",
    "TrainWindows",
    "validation_batches",
]

FORTUNES_DIR = "/usr/share/games/fortunes"
"""Where Debian's ``fortunes`` package installs its text files."""

FORTUNES_INSTALL = "sudo apt-get install -y fortunes"
"""The command that installs the default corpus (quoted in the missing-corpus error)."""

FORTUNES_SHUFFLE_SEED = 0
"""Fixed seed of the one-time shuffle of fortune entries (independent of the training seed)."""

TOKENIZERS = ("char", "byte")

_OVERSTRIKE = re.compile(r".\x08", re.DOTALL)


@dataclass
class TextCorpus:
    """A tokenised corpus split into training and validation tokens.

    Attributes:
        name: ``"fortunes"`` or the text file's base name.
        source: the directory or file read.
        tokenizer: ``"char"`` or ``"byte"``.
        vocab: char tokens: the characters in id order (token ``i`` is
            ``vocab[i]``); byte tokens: ``None`` (token ``i`` is byte ``i``).
        vocab_size: number of token ids (``len(vocab)`` or 256).
        train: int32 ``[N_train]`` training tokens.
        val: int32 ``[N_val]`` validation tokens (the end of the stream).
    """

    name: str
    source: str
    tokenizer: str
    vocab: Optional[str]
    vocab_size: int
    train: torch.Tensor = field(repr=False)
    val: torch.Tensor = field(repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.train.numel() + self.val.numel())

    def decode(self, ids) -> str:
        """Text of a sequence of token ids (char: characters; byte: UTF-8 with replacement)."""
        ids = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        if self.vocab is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return "".join(self.vocab[i] for i in ids)


def _fortune_files(directory: str) -> List[str]:
    if not os.path.isdir(directory):
        return []
    names = sorted(n for n in os.listdir(directory) if not os.path.splitext(n)[1] and not n.startswith("."))
    return [os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))]


def read_fortunes(directory: str = FORTUNES_DIR) -> str:
    """The fortunes corpus as one string (see the module docstring for the cleaning and order).

    Args:
        directory: where the fortune files are (default :data:`FORTUNES_DIR`).

    Returns:
        the entries, shuffled with :data:`FORTUNES_SHUFFLE_SEED`, joined by
        ``"\\n\\n"``.

    Raises:
        FileNotFoundError: no fortune files there; the message gives the
            ``apt-get`` command and the ``--text-file`` alternative.
    """
    files = _fortune_files(directory)
    if not files:
        raise FileNotFoundError(
            f"no fortunes corpus in {directory} (the text files without an extension); install it with "
            f"`{FORTUNES_INSTALL}`, or pass --text-file PATH to train on another plain-text file")
    entries: List[str] = []
    for path in files:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        text = _OVERSTRIKE.sub("", text.replace("\r\n", "\n"))
        for entry in re.split(r"^%[ \t]*$", text, flags=re.MULTILINE):
            entry = entry.strip("\n")
            if entry.strip():
                entries.append(entry)
    random.Random(FORTUNES_SHUFFLE_SEED).shuffle(entries)
    return "\n\n".join(entries) + "\n"


def _char_tokens(text: str) -> Tuple[np.ndarray, str]:
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    if codes.size == 0:
        return np.zeros(0, dtype=np.int32), ""
    present = np.zeros(int(codes.max()) + 1, dtype=bool)  # code points < 0x110000: a small table
    present[codes] = True
    uniq = np.flatnonzero(present)
    lut = (np.cumsum(present) - 1).astype(np.int32)  # code point -> id, ids in code point order
    return lut[codes], "".join(chr(int(c)) for c in uniq)


def load_corpus(text_file: Optional[str] = None, tokens: str = "char", val_fraction: float = 0.05,
                fortunes_dir: str = FORTUNES_DIR) -> TextCorpus:
    """Load, tokenise and split a corpus.

    Args:
        text_file: a plain-text file (``--text-file``); ``None`` = the
            fortunes corpus from ``fortunes_dir``.
        tokens: ``"char"`` or ``"byte"`` (``--tokens``).
        val_fraction: share of the tokens, from the end, held out for
            validation; in ``(0, 0.5]``.
        fortunes_dir: where to look for the fortunes files.

    Returns:
        a :class:`TextCorpus`; ``val`` has ``max(1, round(N * val_fraction))``
        tokens.

    Raises:
        FileNotFoundError: ``text_file`` does not exist, or (no
            ``text_file``) the fortunes corpus is not installed (the message
            has the ``apt-get`` command).
        ValueError: unknown ``tokens``, ``val_fraction`` out of range, an
            empty corpus or one under 4 tokens, or a ``text_file`` that is
            not UTF-8 with ``tokens="char"``; each names the argument.
    """
    if tokens not in TOKENIZERS:
        raise ValueError(f"--tokens must be one of {', '.join(TOKENIZERS)}, got {tokens!r}")
    if not (isinstance(val_fraction, float) and 0.0 < val_fraction <= 0.5):
        raise ValueError(f"val_fraction must be a float in (0, 0.5], got {val_fraction!r}")
    if text_file is None:
        text = read_fortunes(fortunes_dir)
        raw = text.encode("utf-8")
        name, source = "fortunes", fortunes_dir
    else:
        if not os.path.isfile(text_file):
            raise FileNotFoundError(f"--text-file {text_file}: no such file")
        with open(text_file, "rb") as f:
            raw = f.read()
        name, source = os.path.basename(text_file), os.path.abspath(text_file)
        text = None
        if tokens == "char":
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"--text-file {text_file}: not UTF-8 text ({e}); use --tokens byte "
                                 "for arbitrary bytes") from None
    if tokens == "byte":
        ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int32)
        vocab, vocab_size = None, 256
    else:
        ids, vocab = _char_tokens(text)
        vocab_size = len(vocab)
    n = int(ids.size)
    if n < 4:
        where = f"--text-file {text_file}" if text_file is not None else fortunes_dir
        raise ValueError(f"{where}: the corpus has {n} tokens; need at least 4")
    n_val = max(1, int(round(n * val_fraction)))
    t = torch.from_numpy(ids)
    return TextCorpus(name=name, source=source, tokenizer=tokens, vocab=vocab, vocab_size=vocab_size,
                      train=t[: n - n_val].clone(), val=t[n - n_val:].clone())


def _rank_seed(seed: int, rank: int) -> int:
    h = hashlib.sha256(f"slimcomm.text:{int(seed)}:{int(rank)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


class TrainWindows:
    """Random training windows from one rank's disjoint shard of the training tokens.

    Rank ``rank`` owns tokens ``[rank * L, (rank + 1) * L)`` of ``train_tokens``
    with ``L = len(train_tokens) // world_size`` (the remainder is unused), so
    shards are disjoint and equal. Each call of :meth:`next_batch` draws
    ``batch_size`` window starts uniformly from ``[0, L - block_size - 1]``
    with this object's own generator, seeded from ``(seed, rank)``: the
    sequence of batches is a pure function of (tokens, sizes, seed, rank) and
    does not touch the global RNG.

    Args:
        train_tokens: int ``[N_train]`` token ids.
        block_size: tokens per input sequence ``T``.
        batch_size: sequences per batch ``B``.
        rank, world_size: this rank and the number of ranks.
        seed: data seed (the training command's ``--seed``).

    Raises:
        ValueError: bad sizes or rank, or a shard shorter than
            ``block_size + 1`` tokens (the message names ``--block-size``
            and the shard length).
    """

    def __init__(self, train_tokens: torch.Tensor, block_size: int, batch_size: int, rank: int,
                 world_size: int, seed: int = 0):
        for name, v in (("block_size", block_size), ("batch_size", batch_size), ("world_size", world_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if train_tokens.dim() != 1:
            raise ValueError(f"train_tokens must be 1-D, got shape {list(train_tokens.shape)}")
        shard_len = train_tokens.numel() // world_size
        if shard_len < block_size + 1:
            raise ValueError(
                f"--block-size {block_size}: each of the {world_size} ranks' training shards has {shard_len} "
                f"tokens, fewer than block_size + 1; use a larger corpus or a smaller --block-size")
        self.block_size, self.batch_size = block_size, batch_size
        self.rank, self.world_size = rank, world_size
        self.shard_start = rank * shard_len
        self.shard = train_tokens[self.shard_start:self.shard_start + shard_len]
        self._offsets = torch.arange(block_size + 1)
        self.generator = torch.Generator().manual_seed(_rank_seed(seed, rank))

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, both contiguous int64 ``[B, T]`` on the CPU, ``y`` = ``x`` shifted by one token."""
        starts = torch.randint(0, self.shard.numel() - self.block_size, (self.batch_size,),
                               generator=self.generator)
        w = self.shard[starts[:, None] + self._offsets].long()
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def validation_batches(val_tokens: torch.Tensor, block_size: int, batch_size: int,
                       num_batches: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of validation batches, identical on every rank and for every seed.

    ``num_batches * batch_size`` windows of ``block_size + 1`` tokens whose
    starts are evenly spaced over ``[0, len(val_tokens) - block_size - 1]``
    (they overlap only when the split is shorter than the windows together).

    Returns:
        ``num_batches`` pairs ``(x, y)`` of contiguous int64 ``[batch_size, block_size]``.

    Raises:
        ValueError: bad sizes, or a validation split shorter than
            ``block_size + 1`` tokens (naming ``--block-size``).
    """
    for name, v in (("block_size", block_size), ("batch_size", batch_size), ("num_batches", num_batches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    n = val_tokens.numel()
    if n < block_size + 1:
        raise ValueError(f"--block-size {block_size}: the validation split has {n} tokens, fewer than "
                         "block_size + 1; use a larger corpus or a smaller --block-size")
    count = num_batches * batch_size
    starts = torch.linspace(0, n - block_size - 1, count, dtype=torch.float64).round().long()
    w = val_tokens[starts[:, None] + torch.arange(block_size + 1)].long()
    return [(w[i:i + batch_size, :-1].contiguous(), w[i:i + batch_size, 1:].contiguous())
            for i in range(0, count, batch_size)]
