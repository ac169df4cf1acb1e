"""The EDR paper's workflow on z-lab's own classes: take a drafter z-lab's
`DFlash2DraftModel` wrote, fine-tune it with EDR by `blockdraft train`, export it, and
serve it back through z-lab's class (tests/zlab_reference.py; skipped without it)."""

from __future__ import annotations

import pytest
from trainkit import make_config, read_metrics

from blockdraft.drafters.dflash import DrafterConfig
from blockdraft.serialization.checkpoint import load_drafter
from blockdraft.serialization.export import export_drafter, validate_for_serving
from blockdraft.training import train
from zlab_reference import assert_same_as_reference, reference_checkpoint, zlab_model


@pytest.mark.slow
def test_zlab_checkpoint_finetunes_with_edr_and_serves_back(target, rollout_dirs, tmp_path):
    zlab = zlab_model()
    config = DrafterConfig.for_target(
        target, num_layers=1, block_size=5, arch="dflash2", selector_rank=8, selector_top_k=6
    )
    _, published = reference_checkpoint(zlab, config, tmp_path / "published", scale=0.05)
    cfg = make_config(
        tmp_path / "ft",
        rollout_dirs,
        "sampled",
        objective={"name": "edr", "max_anchors": 8},
        drafter={"init_from": str(published)},
    )
    final = train(cfg, target=target)
    evals = [m["eval_mal"] for m in read_metrics(cfg.run_dir) if m["event"] == "eval"]
    assert evals[-1] > evals[0] + 0.2, f"held-out MAL {evals[0]:.3f} -> {evals[-1]:.3f}"
    served = export_drafter(final, tmp_path / "served")
    assert validate_for_serving(served) == []
    ref, info = zlab.DFlash2DraftModel.from_pretrained(served, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert_same_as_reference(ref.float().eval(), load_drafter(final, target).eval(), target)
