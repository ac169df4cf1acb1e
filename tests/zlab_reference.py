"""z-lab's own DFlash / DFlash2 classes as the tests' reference, and comparisons with them.

The reference is z-lab's `dflash` package from PyPI (0.1.0 holds `DFlash2DraftModel`;
`make install` puts it in the venv without its pinned dependencies, since `dflash.model`
needs only torch and transformers), or a checkout of github.com/z-lab/dflash named by
`BLOCKDRAFT_ZLAB_DFLASH` (the directory holding `dflash/model.py`), which wins when set.
Without either, tests that ask for it are skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import Qwen3Config

from blockdraft.decoding.proposers import draft_block
from blockdraft.drafters.dflash import DrafterConfig
from blockdraft.drafters.dflash2 import DFlash2Drafter
from blockdraft.serialization.checkpoint import serving_config

ANCHOR = 9  # the compared block's anchor position (a context of 9 target positions)


ZLAB_DIR = Path(sys.prefix) / "zlab-dflash"  # where `make install` puts it (Makefile)


def zlab_model() -> ModuleType:
    """z-lab's `dflash.model`, or skip (fail when a named checkout is not usable)."""
    root = os.environ.get("BLOCKDRAFT_ZLAB_DFLASH")
    if not root and (ZLAB_DIR / "dflash" / "model.py").is_file():
        root = str(ZLAB_DIR)
    if root:
        if not (Path(root) / "dflash" / "model.py").is_file():
            pytest.fail(f"BLOCKDRAFT_ZLAB_DFLASH={root}: no dflash/model.py there")
        sys.path.insert(0, root)
        try:
            model = importlib.import_module("dflash.model")
        finally:
            sys.path.remove(root)
        where = f"{root}/dflash/model.py"
    else:
        if importlib.util.find_spec("dflash") is None:
            pytest.skip("z-lab's reference not installed: pip install --no-deps dflash==0.1.0")
        model = importlib.import_module("dflash.model")
        where = model.__file__
    if not hasattr(model, "DFlash2DraftModel"):
        pytest.fail(f"{where} predates DFlash2 (no DFlash2DraftModel)")
    return model


def reference_checkpoint(zlab, config: DrafterConfig, path: Path, scale: float = 0.2):
    """`(model, directory)`: a checkpoint written by z-lab's class with random weights
    (ours only for its config.json): every weight `N(0, scale)`, norms around 1, the
    convolutions' at 0.5 (a strong block-local mixing)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(serving_config(config)))
    hf = Qwen3Config.from_pretrained(path)
    cls = zlab.DFlash2DraftModel if config.arch == "dflash2" else zlab.DFlashDraftModel
    torch.manual_seed(7)
    ref = cls(hf)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            std = 0.5 if "conv" in name or "norm" in name else scale
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if "norm" in name else 0.0))
    ref.save_pretrained(path / "ref")
    return ref.eval(), path / "ref"


def _reference_block(ref, target, feats, anchor_id, block):
    ids = torch.full((1, block), ref.mask_token_id, dtype=torch.long)
    ids[0, 0] = anchor_id
    with torch.no_grad():
        noise = target.embed_tokens(ids)
        hidden = ref(
            position_ids=torch.arange(ANCHOR + block)[None],
            noise_embedding=noise,
            target_hidden=feats[:, :ANCHOR],
        )
    return hidden[:, 1:]


def assert_same_as_reference(ref, ours, target) -> None:
    """One block drafted by both at the same context: hidden states to float tolerance
    (inference and training forwards), the same tokens at T = 0, and at T > 0 the
    reference's q over its candidates equal to our selector's distribution along the
    path it drew (DFlash: the same logits)."""
    block = ours.config.block_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (1, ANCHOR + block), generator=g)
    feats = target.forward(ids).features
    anchor = int(ids[0, ANCHOR])
    want = _reference_block(ref, target, feats, anchor, block)[0]
    state = ours.new_state()
    ours.extend_context(state, feats[:, :ANCHOR], 0)
    got = ours.draft_hidden(state, anchor, ANCHOR)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the training forward too, at this anchor among others
        many = ours.forward_blocks(feats, ids, torch.tensor([[3, ANCHOR, ANCHOR + 3]]))
    torch.testing.assert_close(many[0, 1], want, rtol=1e-4, atol=1e-4)
    head = target.lm_head
    with torch.no_grad():
        if isinstance(ours, DFlash2Drafter):
            tokens, _, _ = ref.propose(want[None], torch.tensor([anchor]), head, 0.0)
            mine, _ = draft_block(ours, state, anchor, ANCHOR, 0.0, 1.0, 0, None)
            assert torch.equal(mine, tokens[0])
            torch.manual_seed(5)
            path, cand, q = ref.propose(want[None], torch.tensor([anchor]), head, 0.9)
            prev = torch.cat([torch.tensor([anchor]), path[0, :-1]])
            ours_q = torch.softmax(ours.compute_logits(got, prev).float() / 0.9, -1)
            ref_q = torch.zeros_like(ours_q).scatter(-1, cand[0], q[0])
            torch.testing.assert_close(ours_q, ref_q, rtol=1e-4, atol=1e-5)
        else:
            logits = ref.compute_logits(want, head)
            torch.testing.assert_close(ours.compute_logits(got), logits, rtol=1e-4, atol=1e-4)
