"""One rollout record (`Rollout`) and its on-disk shard encoding (safetensors bytes).

A shard holds its rollouts as flat tensors with offsets (ragged rows, no padding): the
prompt and response tokens, each realised response token's log-prob under the sampling
distribution, and optionally its top-k; the safetensors metadata (prompt ids, first row)
is written in sorted order, so the same rollouts always give the same bytes. Tensor
names and dtypes: docs/architecture.md ("data").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors.torch import load

from blockdraft.artifacts import safetensors_bytes, sha256_bytes  # noqa: F401  (re-exported)


@dataclass
class Rollout:
    """One target rollout. A training sequence is `prompt_ids + response_ids`."""

    prompt_id: str
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    logprobs: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids])

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def response_len(self) -> int:
        return int(self.response_ids.numel())

    @property
    def loss_mask(self) -> torch.Tensor:
        """Bool `[P+L]`: True on response positions (the tokens a drafter learns)."""
        mask = torch.zeros(self.prompt_len + self.response_len, dtype=torch.bool)
        mask[self.prompt_len :] = True
        return mask


def encode_shard(first_row: int, rows: Sequence[Rollout], store_topk: int) -> bytes:
    """Serialise rollouts to safetensors bytes (the layout in the module docstring)."""

    def offsets(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([0] + [int(p.numel()) for p in parts], dtype=torch.int64).cumsum(0)

    prompts = [r.prompt_ids for r in rows]
    responses = [r.response_ids for r in rows]
    tensors = {
        "prompt_tokens": torch.cat(prompts).to(torch.int32),
        "prompt_offsets": offsets(prompts),
        "response_tokens": torch.cat(responses).to(torch.int32),
        "response_offsets": offsets(responses),
        "logprobs": torch.cat([r.logprobs for r in rows]).to(torch.float32),
    }
    if store_topk:
        tensors["topk_ids"] = torch.cat([r.topk_ids for r in rows]).to(torch.int32)
        tensors["topk_logprobs"] = torch.cat([r.topk_logprobs for r in rows]).to(torch.float32)
    meta = {"prompt_id": json.dumps([r.prompt_id for r in rows]), "first_row": str(first_row)}
    return safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, meta)


def decode_shard(data: bytes) -> list[Rollout]:
    """Inverse of `encode_shard` (token ids come back as int64)."""
    tensors = load(data)
    meta = _metadata(data)
    ids = json.loads(meta["prompt_id"])
    po, ro = tensors["prompt_offsets"].tolist(), tensors["response_offsets"].tolist()
    has_topk = "topk_ids" in tensors
    rows = []
    for i, pid in enumerate(ids):
        r0, r1 = ro[i], ro[i + 1]
        rows.append(
            Rollout(
                pid,
                tensors["prompt_tokens"][po[i] : po[i + 1]].long(),
                tensors["response_tokens"][r0:r1].long(),
                tensors["logprobs"][r0:r1],
                tensors["topk_ids"][r0:r1].long() if has_topk else None,
                tensors["topk_logprobs"][r0:r1] if has_topk else None,
            )
        )
    return rows


def _metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]).get("__metadata__", {})
