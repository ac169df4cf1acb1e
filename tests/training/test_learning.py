"""Short runs must *learn*: held-out offline MAL rises for every objective (from scratch,
and EDR as a fine-tuning stage from a checkpoint, as in the EDR paper), and D-PACE's
weights move toward later positions as early positions become accurate."""

from __future__ import annotations

import pytest
from trainkit import make_config, read_metrics

from blockdraft.training import train

CASES = [
    ("uniform", "greedy"),
    ("decay", "greedy"),
    ("dpace", "greedy"),
    ("dpace-cumulative", "greedy"),
    ("e2e", "sampled"),
    ("edr", "sampled"),
]


def _evals(run_dir) -> list[float]:
    return [m["eval_mal"] for m in read_metrics(run_dir) if m["event"] == "eval"]


@pytest.mark.slow
@pytest.mark.parametrize("objective,mode", CASES)
def test_training_improves_heldout_mal(objective, mode, target, rollout_dirs, tmp_path):
    cfg = make_config(tmp_path / "run", rollout_dirs, mode, objective={"name": objective})
    final = train(cfg, target=target)
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file()
    evals = _evals(cfg.run_dir)
    before, after = evals[0], evals[-1]
    assert after > before + 0.2, f"{objective}/{mode}: held-out MAL {before:.3f} -> {after:.3f}"
    train_events = [m for m in read_metrics(cfg.run_dir) if m["event"] == "train"]
    assert train_events and all(len(m["acc_k"]) == 4 for m in train_events)
    assert {"step", "loss", "lr", "acc_k", "dpace_weight_profile"} <= set(train_events[-1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sampled", "greedy"])
def test_edr_finetune_from_checkpoint_improves_mal(mode, target, rollout_dirs, tmp_path):
    """The EDR paper's recipe: a CE-trained drafter, then an EDR fine-tuning stage (greedy
    EDR's soft acceptance q(x) has vanishing gradients on a random drafter, so that mode
    is only ever used this way). max_anchors < L-1 exercises round-start sampling."""
    pre = make_config(
        tmp_path / "pre", rollout_dirs, mode, optim={"max_steps": 3}, eval={"at_start": False}
    )
    start = train(pre, target=target)
    ft = make_config(
        tmp_path / "ft",
        rollout_dirs,
        mode,
        objective={"name": "edr", "max_anchors": 8},
        drafter={"init_from": str(start)},
    )
    train(ft, target=target)
    evals = _evals(ft.run_dir)
    assert evals[0] == pytest.approx(
        _evals(pre.run_dir)[-1], rel=1e-6
    )  # really started from the checkpoint
    assert evals[-1] > evals[0] + 0.2, (
        f"EDR fine-tune ({mode}): held-out MAL {evals[0]:.3f} -> {evals[-1]:.3f}"
    )


@pytest.mark.slow
def test_dpace_weights_shift_to_later_positions(target, rollout_dirs, tmp_path):
    cfg = make_config(
        tmp_path / "run",
        rollout_dirs,
        "greedy",
        objective={"name": "dpace"},
        logging={"every": 2, "tensorboard": True},
        eval={"at_start": False},
    )
    train(cfg, target=target)
    assert any((tmp_path / "run" / "tensorboard").iterdir())
    events = [m for m in read_metrics(cfg.run_dir) if m["event"] == "train"]
    first, last = events[0], events[-1]
    assert last["acc_k"][0] > first["acc_k"][0] + 0.2  # early positions became accurate ...
    # ... and the mean normalised weight moved toward later slots
    assert last["dpace_weight_centroid"] > first["dpace_weight_centroid"] + 0.1
    assert last["dpace_weight_profile"][-1] > first["dpace_weight_profile"][-1]
    assert last["dpace_weight_profile"][0] < first["dpace_weight_profile"][0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "drafter", [{"arch": "semi_ar", "markov_rank": 8}, {"draft_vocab_size": 64}]
)
def test_semi_ar_and_reduced_vocab_drafters_learn(drafter, target, rollout_dirs, tmp_path):
    cfg = make_config(
        tmp_path / "run", rollout_dirs, "greedy", objective={"name": "dpace"}, drafter=drafter
    )
    final = train(cfg, target=target)
    evals = _evals(cfg.run_dir)
    assert evals[-1] > evals[0] + 0.2, f"{drafter}: held-out MAL {evals[0]:.3f} -> {evals[-1]:.3f}"
    from blockdraft.serialization.checkpoint import load_drafter

    reloaded = load_drafter(final, target)
    assert reloaded.config.arch == drafter.get("arch", "dflash")
    assert reloaded.config.draft_vocab_size == drafter.get("draft_vocab_size")
