"""The demo's online stage: real speculative decoding next to our AR loop and HF generate.

Kept apart from `demo.py` (the pipeline's stages) because it is the one stage that
times things: it decodes the first held-out prompts with every drafter, and scores the
same prompts offline at the same length, so that the report's online tau and offline
MAL describe the same text (equal at T = 0) instead of differing by prompt set and length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blockdraft.demo import DemoSettings, _drafter_dtype, _log


def _progress_line(p: Any) -> str:
    """One line per decoded prompt: the online stage is the demo's slowest to watch."""
    ar = f" (AR {p.ar_tokens_per_s:.0f})" if p.ar_tokens_per_s else ""
    return f"{p.done}/{p.total} prompts, {p.tokens_per_s:.0f} tok/s{ar}, tau {p.tau:.2f}"


def evaluate_online(
    target: Any,
    s: DemoSettings,
    finals: dict[str, Path],
    rollouts: dict[str, Path],
    out: Path,
) -> dict[str, Any]:
    """Real speculative decoding of held-out prompts: tau, speedup vs our AR loop and vs
    HF generate, and each drafter's offline MAL on the same prompts at the same length
    (the first `online_prompts` eval rollouts cut to `online_max_new_tokens`), so online
    and offline measure the same text: at T = 0 they must be equal."""
    from blockdraft.data.rollout_store import RolloutSet
    from blockdraft.evaluation.hf_generate import ar_vs_hf, has_hf_generate
    from blockdraft.evaluation.offline import mal_ci
    from blockdraft.evaluation.online import decode
    from blockdraft.evaluation.scoring import score_rollout_set
    from blockdraft.models.drafter_spec import load_drafter_spec

    rs = RolloutSet.open(rollouts["eval"])
    same = rs.subset(range(min(s.online_prompts, len(rs))))
    prompts = [r.prompt_ids.tolist() for r in same]
    hf: dict[str, float] = {}
    if has_hf_generate(target):
        _log(f"online decoding: HF generate vs our AR loop ({len(prompts)} prompts)")
        hf = ar_vs_hf(target, prompts, s.temperature, s.online_max_new_tokens)
    online = {}
    for name, path in finals.items():
        _log(f"online decoding with {name} ({len(prompts)} prompts)")
        drafter, drafter_id = load_drafter_spec(path, target, dtype=_drafter_dtype(s, target))
        res = decode(
            target,
            drafter,
            prompts,
            temperature=s.temperature,
            max_new_tokens=s.online_max_new_tokens,
            seed=s.seed,
            callback=lambda p, name=name: _log(f"  {name}: {_progress_line(p)}"),
        )
        acc = score_rollout_set(
            drafter, target, same, drafter_id=drafter_id, cache_dir=out / "scores"
        )
        mal, ci = mal_ci([a[: s.online_max_new_tokens - 1] for a in acc])
        vs_hf = res.speedup * hf["ar_vs_hf"] if hf and res.speedup else None
        online[name] = {
            "tau": res.tau,
            "tau_ci95": list(res.tau_ci95),
            "histogram": res.histogram,
            "tokens_per_s": res.tokens_per_s,
            "ar_tokens_per_s": res.ar_tokens_per_s,
            "speedup": res.speedup,
            "speedup_vs_hf": vs_hf,
            "hf_tokens_per_s": hf.get("hf_tokens_per_s"),
            "offline_mal": mal,
            "offline_mal_ci95": list(ci),
        }
    return online
