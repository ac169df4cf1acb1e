"""The README's quick start, run verbatim, so it can never rot again.

The commands are taken from README.md's "Quick start" bash block as written and run by
bash in a scratch directory (with the repo's `configs/` and `examples/` linked in). The
only substitutions: `T` names a small random local HF model instead of a hub id, the
`pip`/`hf download` lines are skipped (install and download), and a few options are
*appended* (argparse and the config's dotted overrides take the last value) so that each
stage runs in seconds: fewer new tokens, two optimizer steps, fewer bootstrap samples.
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

# appended to each sub-command: small sizes, no progress bars
SPEEDUPS = {
    "rollout": "--max-new-tokens 12 --no-progress",
    "train": "optim.max_steps=2 num_anchors=8 eval.max_rollouts=4 data.max_seq_len=128 "
    "logging.progress=false logging.tensorboard=false device=cpu",
    "eval": "--n-boot 50 --no-progress",
    "compare": "--n-boot 50 --no-progress",
    "decode": "--limit 2 --no-progress",  # the README asks for --vs-hf: keeps the AR baseline
    "export": "",
}


def quick_start_commands(readme: str) -> list[str]:
    """Shell commands of the quick start block (continuations joined, comments dropped)."""
    section = readme[readme.index("## Quick start") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README quick start has no ```bash block"
    text = block.group(1).replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line = line.split("  #")[0].strip() if not line.lstrip().startswith("#") else ""
        if line:
            commands.append(line)
    return commands


def test_quick_start_commands_cover_every_stage():
    cmds = quick_start_commands((REPO / "README.md").read_text())
    stages = [shlex.split(c)[1] for c in cmds if c.startswith("blockdraft ")]
    assert stages == ["rollout", "rollout", "train", "train", "eval", "compare", "decode", "export"]
    assert any(c.startswith("T=") for c in cmds)


@pytest.fixture(scope="module")
def local_model(tmp_path_factory) -> Path:
    from random_targets import make_random_target

    target = make_random_target("qwen3", num_layers=4)
    path = tmp_path_factory.mktemp("model") / "random-qwen3"
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def test_readme_quick_start_runs_verbatim(local_model, tmp_path):
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["BLOCKDRAFT_CACHE"] = str(tmp_path / "cache")
    script = ["set -e"]
    for cmd in quick_start_commands((REPO / "README.md").read_text()):
        if cmd.startswith(("pip ", "hf ")):
            continue  # installing and downloading are the user's steps
        if cmd.startswith("T="):
            cmd = f"T={shlex.quote(str(local_model))}"
        elif cmd.startswith("blockdraft "):
            cmd = f"{cmd} {SPEEDUPS[shlex.split(cmd)[1]]}"
        script.append(f'echo ">>> [$SECONDS s] {cmd[:60]}" >&2; {cmd}')
    res = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, f"README command failed:\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr
    served = tmp_path / "drafters" / "qwen3-4b-dflash-edr"
    assert (served / "model.safetensors").is_file() and (served / "modeling_dflash.py").is_file()
    assert "--speculative-algorithm DFLASH" in res.stdout
    assert (tmp_path / "eval.json").is_file()


def test_real_model_commands_are_the_tutorials():
    """The README's real-model block is the tutorial's, line for line, so the tutorial's
    verbatim test (tests/test_tutorial.py) covers it."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## A real model") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    tutorial = (REPO / "docs" / "tutorial.md").read_text()
    tutorial_lines = set(tutorial.splitlines())
    missing = [c for c in commands if c not in tutorial_lines]
    assert len(commands) >= 5 and not missing, missing
