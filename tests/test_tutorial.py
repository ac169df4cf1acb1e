"""docs/tutorial.md's commands, run verbatim on a small stand-in for SmolLM2.

The commands are taken from the tutorial's bash blocks as written and run by bash in a
scratch directory (with the repo's `configs/` and `examples/` linked in). The only
substitutions: `T` names a small random local Llama whose tokenizer has no mask token
(`target` and `rollout` get SmolLM2's, `--mask-token '<gh_stars>'`; every later stage
takes it from the rollouts and the drafter), the `pip` line is skipped, and a few options
are *appended* (argparse and the config's dotted overrides take the last
value) so each stage runs in seconds on the stand-in: fewer new tokens, two optimizer
steps, its own layers and a draft vocabulary that fits its 384 tokens.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TUTORIAL = REPO / "docs" / "tutorial.md"
DATA = REPO.parent / "shared" / "data"  # the suite's offline benchmark copies

# SmolLM2's own mask token; the stand-in has none, so the stages that come before any
# record name it (later stages take it from the rollouts and the drafter, as for any target)
STAND_IN_MASK = "'<gh_stars>'"
SPEEDUPS = {
    "target": f"--mask-token {STAND_IN_MASK}",
    "rollout": f"--max-new-tokens 8 --limit 8 --no-progress --mask-token {STAND_IN_MASK}",
    "train": "optim.max_steps=2 num_anchors=8 eval.max_rollouts=4 data.max_seq_len=128 "
    "logging.progress=false device=cpu target.layer_ids=[0,1,2] drafter.draft_vocab_size=128",
    "eval": "--n-boot 50 --no-progress",
    "suite": f"--limit 1 --n-boot 50 --no-progress --data-dir {shlex.quote(str(DATA))}",
    "export": "",
}


def tutorial_commands(text: str) -> list[str]:
    """Shell commands of every ```bash block (continuations joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_the_tutorial_covers_every_stage():
    cmds = tutorial_commands(TUTORIAL.read_text())
    stages = [shlex.split(c)[1] for c in cmds if c.startswith("blockdraft ")]
    assert stages == [
        "target", "rollout", "rollout", "train", "eval", "suite", "export", "serve-check"
    ]  # fmt: skip
    assert "T=smollm2-135m" in cmds
    assert "## 8. Serve it" in TUTORIAL.read_text()


@pytest.mark.skipif(not DATA.is_dir(), reason=f"no offline benchmark data in {DATA}")
def test_the_tutorial_runs_verbatim(tmp_path):
    from random_targets import save_target_without_mask

    model = save_target_without_mask(tmp_path / "stand-in")
    work = tmp_path / "work"
    work.mkdir()
    for name in ("configs", "examples"):
        (work / name).symlink_to(REPO / name)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["BLOCKDRAFT_CACHE"] = str(tmp_path / "cache")
    script = ["set -e"]
    for cmd in tutorial_commands(TUTORIAL.read_text()):
        if cmd.startswith("pip "):
            continue  # installing is the user's step
        if cmd.startswith("blockdraft serve-check"):
            # vLLM's CPU attention has no kernel for the stand-in's head size (16); the
            # same command runs on `tiny` in tests/engines whenever vLLM is installed
            continue
        if cmd.startswith("T="):
            cmd = f"T={shlex.quote(str(model))}"
        elif cmd.startswith("blockdraft "):
            cmd = f"{cmd} {SPEEDUPS[shlex.split(cmd)[1]]}"
        script.append(f"echo {shlex.quote('>>> ' + cmd[:60])} >&2; {cmd}")
    res = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, f"tutorial command failed:\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr
    served = work / "drafters" / "smollm2-dflash"
    config = (served / "config.json").read_text()
    assert '"mask_token": "<gh_stars>"' in config and '"mask_token_id": 2' in config
    assert (work / "eval.json").is_file() and (work / "suite.json").is_file()


def test_the_tutorials_ngram_row_is_what_eval_prints():
    """The tutorial's `eval` output, ngram row, recomputed the way `eval` computes it
    from the token ids of the tutorial's held-out rollouts (tests/fixtures, made by its
    step 3 on SmolLM2): prompt lookup needs no model, so a change of the lookup rule, the
    scoring or the statistics that moves the printed row fails here, not in a reader's
    terminal."""
    import json

    import torch

    from blockdraft.data.rollouts.store import Rollout
    from blockdraft.drafters.ngram import NgramDrafter
    from blockdraft.evaluation.offline import mal_ci, offline_stats
    from blockdraft.evaluation.scoring import score_rollouts
    from blockdraft.pipeline.report import offline_table

    data = json.loads((REPO / "tests" / "fixtures" / "smol_heldout_rollouts.json").read_text())
    rollouts = [
        Rollout(
            r["id"],
            torch.tensor(r["prompt_ids"]),
            torch.tensor(r["response_ids"]),
            torch.zeros(len(r["response_ids"])),
        )
        for r in data["rollouts"]
    ]
    acc = score_rollouts(NgramDrafter(), None, rollouts, 0.0, use_cache=False)
    stats = offline_stats(acc)
    _, ci = mal_ci(acc, n_boot=2000, seed=0)  # eval's defaults
    row = {"benchmark": "smol-heldout", "name": "ngram", "mal": stats.mal, "mal_ci95": list(ci),
           "expected_rounds": stats.expected_rounds, "ar_k": stats.ar_k}  # fmt: skip
    printed = offline_table([row])[-1]
    documented = [
        ln for ln in TUTORIAL.read_text().splitlines() if "| smol-heldout | ngram |" in ln
    ]
    assert documented == [printed]
