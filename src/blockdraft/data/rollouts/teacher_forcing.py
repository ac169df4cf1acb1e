"""Teacher-forced scoring of given responses by the target (`blockdraft rollout-import`).

Why its own module: importing rollouts generated elsewhere needs the target's log-prob
of every response token under the processed sampling distribution (what `blockdraft
rollout` stores), and that is one batched teacher-forced pass over the target, with the
LM head run only on response positions and in row chunks (a 262k vocabulary never needs
a `[B, T, V]` tensor), independent of the record parsing and shard writing around it.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from blockdraft.sampling import SamplingSettings, sampling_logprobs
from blockdraft.targets.target import Target


def score_responses(
    target: Target,
    sequences: list[tuple[list[int], list[int]]],
    settings: SamplingSettings,
    store_topk: int = 0,
    batch_tokens: int = 8192,
    progress: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]]:
    """Teacher-forced log-probs of each (prompt, response) under the processed distribution.

    Returns per sequence: float32 log-probs `[L]` of the response tokens, top-k ids and
    log-probs `[L, k]` (or None), and whether every token was the T=1 argmax. Batches
    are length-sorted and right-padded up to `batch_tokens` padded tokens; the LM head
    runs only on response positions, in row chunks, so a 262k vocabulary never needs a
    `[B, T, V]` tensor.
    """
    device = target.device
    decoder = target.model.get_decoder()
    head = target.lm_head
    cap = getattr(target.config, "final_logit_softcapping", None)
    k = min(store_topk, target.vocab_size)
    chunk = max(1, (1 << 24) // target.vocab_size)  # ~64 MB of float32 logits per chunk
    filtered = not settings.greedy and (settings.top_k > 0 or settings.top_p < 1)
    plain = not filtered and not k
    order = sorted(range(len(sequences)), key=lambda i: -sum(map(len, sequences[i])))
    results: list[Any] = [None] * len(sequences)
    bar = tqdm(
        total=sum(len(r) for _, r in sequences),
        unit="tok",
        desc="scoring",
        disable=not progress,
        dynamic_ncols=True,
    )
    start = 0
    while start < len(order):
        width = sum(map(len, sequences[order[start]]))
        stop = min(len(order), start + max(1, batch_tokens // width))
        batch = order[start:stop]
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        rows, cols, labels = [], [], []
        for b, i in enumerate(batch):
            prompt, response = sequences[i]
            seq = prompt + response
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
            rows += [b] * len(response)
            cols += range(len(prompt) - 1, len(seq) - 1)  # position predicting each token
            labels += response
        positions = torch.arange(width).expand(len(batch), -1)
        hidden = decoder(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=False,
        ).last_hidden_state
        picked = hidden[torch.tensor(rows, device=device), torch.tensor(cols, device=device)]
        lab = torch.tensor(labels, device=device)
        lps, tk_i, tk_v, hits = [], [], [], []
        for c in range(0, picked.shape[0], chunk):
            logits = head(picked[c : c + chunk])
            if cap:
                logits = torch.tanh(logits / cap) * cap
            labels_c = lab[c : c + chunk, None]
            hits.append(logits.argmax(-1) == labels_c[:, 0])
            if plain:  # log_softmax at the label only: x[label] - logsumexp(x), one pass
                x = logits.float() / (settings.temperature or 1.0)
                lps.append((x.gather(-1, labels_c) - torch.logsumexp(x, -1, keepdim=True))[:, 0])
                continue
            logp = sampling_logprobs(logits, settings)
            lps.append(logp.gather(-1, labels_c)[:, 0])
            if k:
                top = torch.topk(logp, k, dim=-1)
                tk_i.append(top.indices.to(torch.int32))
                tk_v.append(top.values)
        lp_all, hit_all = torch.cat(lps).cpu(), torch.cat(hits).cpu()
        ti_all = torch.cat(tk_i).cpu() if k else None
        tv_all = torch.cat(tk_v).cpu() if k else None
        offset = 0
        for i in batch:
            n = len(sequences[i][1])
            sl = slice(offset, offset + n)
            results[i] = (
                lp_all[sl].clone(),
                ti_all[sl].clone() if ti_all is not None else None,
                tv_all[sl].clone() if tv_all is not None else None,
                bool(hit_all[sl].all()),
            )
            offset += n
        bar.update(offset)
        start = stop
    bar.close()
    return results
