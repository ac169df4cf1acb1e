"""Reading responses written by serving engines: one JSON object per line, many dialects.

`blockdraft rollout-import` accepts what people already have on disk instead of asking
them to reshape it: our own flat record, OpenAI-compatible (chat) completions (`vllm
serve`, SGLang, TGI's Messages API, OpenAI batch output), vLLM's offline `RequestOutput`,
SGLang's and TGI's native `/generate` answers. This module only finds the fields (every
key, in the order it is looked for: docs/rollouts.md, "What a line may look like"); the
tokenizer and the target are applied in `importer.py`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.data.rollouts.store import RolloutError

ID_KEYS = ("prompt_id", "custom_id", "id")
PROMPT_ID_KEYS = ("prompt_token_ids", "prompt_ids")
RESPONSE_ID_KEYS = (
    "token_ids",
    "output_token_ids",
    "output_ids",
    "response_token_ids",
    "completion_token_ids",
)
RESPONSE_TEXT_KEYS = ("response", "completion", "output", "generated_text", "text")
SETTINGS_KEYS = ("settings", "sampling_params", "sampling", "request", "body", "parameters")
MAX_TOKENS_KEYS = ("max_new_tokens", "max_tokens", "max_completion_tokens")


@dataclass
class EngineRecord:
    """The fields of one response line, before tokenisation."""

    line: int
    id: str
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    messages: list[dict[str, Any]] | None = None
    response_ids: list[int] | None = None
    response_text: str | None = None
    eos_stop: bool = False  # the engine says it stopped on an end-of-sequence token
    stop_token: int | None = None  # the stop token it names, if any
    settings: dict[str, Any] | None = None
    error: str | None = None
    no_response: bool = False  # an engine answer whose choice holds nothing (dropped)


def read_records(path: Path) -> Iterator[EngineRecord]:
    """Records of a JSONL file; a line that is not a JSON object is a one-line error."""
    if not path.is_file():
        raise RolloutError(f"{path}: no such file")
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise RolloutError(f"{path}:{n}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RolloutError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise RolloutError(f"{path}:{n}: expected a JSON object per line")
            yield extract(obj, n, path)


def _choice(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The first choice; None for an engine answer with an empty `choices`/`outputs` list."""
    for holder in (obj, _get(obj, "response"), _get(obj, "response", "body")):
        if not isinstance(holder, dict):
            continue
        for key in ("choices", "outputs"):
            seq = holder.get(key)
            if isinstance(seq, list) and seq and isinstance(seq[0], dict):
                return seq[0]
            if isinstance(seq, list) and not seq:
                return None
    return obj


def _get(obj: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _ids(value: Any, path: Path, line: int, key: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise RolloutError(f"{path}:{line}: key {key!r} must be a list of token ids")
    return value


def extract(obj: dict[str, Any], line: int, path: Path) -> EngineRecord:
    """Find id, prompt, response, finish and settings in one record (see module docstring).

    An engine answer (it has `choices`/`outputs`) without a response in its choice (an
    empty list, `content: null`) is a record to drop and count, like an empty response;
    a record with no engine answer and no response is a format error naming the line.
    """
    answered = _choice(obj)
    choice = answered if answered is not None else {}
    meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else {}
    rid = next((obj[k] for k in ID_KEYS if obj.get(k) is not None), None)
    rid = rid if rid is not None else meta.get("id")
    rec = EngineRecord(line=line, id=str(rid) if rid is not None else f"line-{line}")

    error = obj.get("error")
    status = _get(obj, "response", "status_code")
    if error not in (None, "", {}):
        rec.error = str(error.get("message", error) if isinstance(error, dict) else error)
    elif status not in (None, 200):
        rec.error = f"status code {status}"

    holders = (obj, obj.get("request"), obj.get("body"), _get(obj, "request", "body"))
    holders += (obj.get("response"), _get(obj, "response", "body"))
    for holder in holders:
        if not isinstance(holder, dict) or rec.prompt_ids or rec.messages or rec.prompt_text:
            continue
        for key in PROMPT_ID_KEYS:
            if holder.get(key) is not None:
                rec.prompt_ids = _ids(holder[key], path, line, key)
                break
        if rec.prompt_ids is None and isinstance(holder.get("messages"), list):
            rec.messages = holder["messages"]
        prompt = holder.get("prompt")
        if rec.prompt_ids is None and rec.messages is None and prompt is not None:
            if isinstance(prompt, str):
                rec.prompt_text = prompt
            else:
                rec.prompt_ids = _ids(prompt, path, line, "prompt")

    for holder in (choice, obj):
        for key in RESPONSE_ID_KEYS:
            if rec.response_ids is None and holder.get(key) is not None:
                rec.response_ids = _ids(holder[key], path, line, key)
    content = _get(choice, "message", "content")
    texts = [content] + [choice.get(k) for k in ("text", "generated_text")]
    texts += [obj.get(k) for k in RESPONSE_TEXT_KEYS]
    rec.response_text = next((t for t in texts if isinstance(t, str)), None)
    if rec.response_ids is None and rec.response_text is None:
        _refuse_wrong_type(choice, obj, path, line)
    if rec.response_ids is None and rec.response_text is None and choice is not obj:
        rec.no_response = True  # the engine answered with an empty choice
    elif rec.response_ids is None and rec.response_text is None and rec.error is None:
        raise RolloutError(
            f"{path}:{line}: no response found (looked for token ids in "
            f"{', '.join(RESPONSE_ID_KEYS)} and text in message.content, "
            f"{', '.join(RESPONSE_TEXT_KEYS)})"
        )
    _finish(rec, choice, meta, obj)
    rec.settings = _settings(obj)
    return rec


def _refuse_wrong_type(choice: dict, obj: dict, path: Path, line: int) -> None:
    """A response field present with another type than text (`"response": 5`) is named
    with its type, not reported as "no response found"."""
    places = [("message.", _get(choice, "message"), ("content",))]
    places += [("", choice, ("text", "generated_text")), ("", obj, RESPONSE_TEXT_KEYS)]
    for where, holder, keys in places:
        if not isinstance(holder, dict):
            continue
        for key in keys:
            value = holder.get(key)
            if value is not None and not isinstance(value, (str, dict)):  # dict: a holder
                raise RolloutError(
                    f"{path}:{line}: {where}{key!r} is {type(value).__name__} {value!r:.40}, "
                    "expected the response text (a string) or token ids in "
                    f"{', '.join(RESPONSE_ID_KEYS)}"
                )


def _finish(rec: EngineRecord, choice: dict, meta: dict, obj: dict) -> None:
    """Did the engine stop on an end-of-sequence token (not a stop string or the limit)?"""
    reason = choice.get("finish_reason")
    if isinstance(reason, str):
        stop = choice.get("stop_reason")  # vLLM: None = EOS, int = stop token, str = string
        rec.eos_stop = reason == "stop" and not isinstance(stop, str)
        rec.stop_token = stop if isinstance(stop, int) else None
        return
    sg = meta.get("finish_reason")
    if isinstance(sg, dict):  # SGLang: {"type": "stop", "matched": <token id or string>}
        matched = sg.get("matched")
        rec.eos_stop = sg.get("type") == "stop" and not isinstance(matched, str)
        rec.stop_token = matched if isinstance(matched, int) else None
        return
    tgi = _get(obj, "details", "finish_reason")
    rec.eos_stop = tgi == "eos_token"


def _settings(obj: dict[str, Any]) -> dict[str, Any] | None:
    """Sampling settings stated in the record, in `SamplingSettings` terms (None: none)."""
    for key in SETTINGS_KEYS:
        src = obj.get(key)
        if key == "request" and isinstance(_get(src, "body"), dict):
            src = src["body"]
        if not isinstance(src, dict) or "temperature" not in src:
            continue
        out: dict[str, Any] = {"temperature": float(src["temperature"])}
        if src.get("top_p") is not None:
            out["top_p"] = float(src["top_p"])
        if src.get("top_k") is not None:
            out["top_k"] = max(0, int(src["top_k"]))  # vLLM/SGLang: -1 = no top-k
        limit = next((src[k] for k in MAX_TOKENS_KEYS if src.get(k) is not None), None)
        if limit is not None:
            out["max_new_tokens"] = int(limit)
        if src.get("seed") is not None:
            out["seed"] = int(src["seed"])
        return out
    return None
