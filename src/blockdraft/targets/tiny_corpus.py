"""The training corpus of the `tiny` target: the Python standard library's own source.

Every machine that runs blockdraft has it, so the embedded target needs no download.
Selection is deterministic: the top-level `*.py` files of `sysconfig`'s stdlib dir,
sorted by name, optionally capped in total size; every `heldout_every`-th file is held
out for the evaluation loss. The corpus hash (names + contents) enters the cache key,
so a different Python version (different stdlib) builds a different model.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Corpus:
    """Selected stdlib files, split into training and held-out documents."""

    root: Path
    train_files: list[str]
    heldout_files: list[str]
    train_texts: list[str]
    heldout_texts: list[str]
    digest: str

    @property
    def num_chars(self) -> int:
        return sum(map(len, self.train_texts)) + sum(map(len, self.heldout_texts))


def stdlib_dir() -> Path:
    """Directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(
    max_chars: int | None = None, heldout_every: int = 20, root: Path | None = None
) -> Corpus:
    """Read the deterministic stdlib subset; raise a clear error if it is not there."""
    root = Path(root) if root is not None else stdlib_dir()
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise FileNotFoundError(f"no Python standard-library sources (*.py) found in {root}")
    names: list[str] = []
    texts: list[str] = []
    total = 0
    digest = hashlib.sha256()
    for path in files:
        data = path.read_bytes()
        text = data.decode("utf-8", errors="replace")
        if max_chars is not None and total + len(text) > max_chars and names:
            continue  # keep scanning: a later, smaller file may still fit
        names.append(path.name)
        texts.append(text)
        total += len(text)
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(data).digest())
    if len(names) < 2:
        raise ValueError(f"corpus too small ({len(names)} file) to hold out any: raise max_chars")
    every = max(2, heldout_every)
    held = [i for i in range(len(names)) if i % every == every - 1] or [len(names) - 1]
    train = [i for i in range(len(names)) if i not in set(held)]
    return Corpus(
        root=root,
        train_files=[names[i] for i in train],
        heldout_files=[names[i] for i in held],
        train_texts=[texts[i] for i in train],
        heldout_texts=[texts[i] for i in held],
        digest=digest.hexdigest(),
    )


def pack_documents(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """Tokenise documents and concatenate them, each followed by the stop token.

    Ending every file with `<|endoftext|>` is what teaches the model to stop.
    """
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream into `[N, seq_len + 1]` windows (inputs + shifted labels)."""
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"token stream of {len(stream)} tokens is shorter than seq_len {seq_len}")
    idx = torch.arange(seq_len + 1).unsqueeze(0) + seq_len * torch.arange(n).unsqueeze(1)
    return stream[idx]
