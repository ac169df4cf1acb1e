"""Rollouts: stored log-probs against an independent scoring pass, storage, resume, refusals."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from blockdraft.data.prompt_type import Prompt, PromptError
from blockdraft.data.rollouts import (
    RolloutError,
    RolloutSet,
    SamplingSettings,
    generate_rollouts,
    sampling_logprobs,
    split_by_prompt,
)
from blockdraft.data.rollouts.store import nested_subset
from blockdraft.targets.target import Target
from random_targets import make_random_target

HERE = Path(__file__).parent
TEXTS = [
    "def add(a, b):",
    "class Point:\n    def",
    "for i in range(10):\n",
    "import os",
    "The quick brown fox",
    "x",
    "if __name__ == '__main__':\n    main()\n",
    "print(i * i)",
]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on 2 shared cores run ~8x faster single-threaded; restores the setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompts(n: int = len(TEXTS)) -> list[Prompt]:
    return [
        Prompt(f"q{i}", TEXTS[i % len(TEXTS)] + " " * (i // len(TEXTS)), None, "test")
        for i in range(n)
    ]


def hf_logprobs(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """The processed distribution recomputed with HF's own logits warpers."""
    logits = logits.double()
    if s.temperature == 0:
        return torch.log_softmax(logits, -1)
    x = TemperatureLogitsWarper(s.temperature)(None, logits)
    if s.top_k:
        x = TopKLogitsWarper(s.top_k)(None, x)
    if s.top_p < 1:
        x = TopPLogitsWarper(s.top_p)(None, x)
    return torch.log_softmax(x, -1)


def test_sampling_logprobs_match_hf_warpers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    for s in [
        SamplingSettings(1.0),
        SamplingSettings(0.7, top_p=0.8, top_k=20),
        SamplingSettings(1.3, top_k=5),
        SamplingSettings(0.5, top_p=0.3),
        SamplingSettings(0.0),
    ]:
        ours, ref = sampling_logprobs(logits, s), hf_logprobs(logits, s).float()
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), s
        assert torch.allclose(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)], atol=1e-5), s
        assert torch.allclose(ours.exp().sum(-1), torch.ones(6))


SETTINGS = [
    SamplingSettings(temperature=1.0, max_new_tokens=12, seed=3),
    SamplingSettings(temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=12, seed=4),
    SamplingSettings(temperature=0.0, max_new_tokens=12, seed=5),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["T1", "T0.7-p0.8-k20", "greedy"])
def test_stored_logprobs_equal_fresh_scoring(random_target, tmp_path, settings):
    rs = generate_rollouts(
        random_target,
        prompts(),
        tmp_path / "r",
        settings,
        batch_size=3,
        shard_size=5,
        store_topk=4,
        progress=False,
    )
    assert len(rs) == len(TEXTS) and [r.prompt_id for r in rs] == [p.id for p in prompts()]
    for r in RolloutSet.open(tmp_path / "r"):
        assert r.prompt_ids.tolist() == random_target.encode(TEXTS[int(r.prompt_id[1:])])
        logits = random_target.forward(r.input_ids[None]).logits[0]
        ref = hf_logprobs(logits[r.prompt_len - 1 : -1], settings)  # predicts each response token
        realised = ref.gather(-1, r.response_ids[:, None])[:, 0]
        assert torch.isfinite(realised).all()  # every sampled token was allowed by the filters
        assert torch.allclose(r.logprobs.double(), realised, atol=1e-4)
        if settings.temperature == 0:
            assert torch.equal(r.response_ids, ref.argmax(-1))
        top = torch.topk(ref, 4, dim=-1)
        assert torch.allclose(r.topk_logprobs.double(), top.values, atol=1e-4)
        assert torch.equal(r.topk_ids[:, 0], top.indices[:, 0])
        assert r.loss_mask.sum() == r.response_len and not r.loss_mask[: r.prompt_len].any()
        assert (
            r.response_len == settings.max_new_tokens
            or r.response_ids[-1] in random_target.stop_token_ids
        )


def test_stop_tokens_end_a_rollout_and_batches_do_not_matter(random_target, tmp_path):
    even = Target(
        random_target.model,
        random_target.tokenizer,
        name="even-stops",
        mask_token_id=random_target.mask_token_id,
        stop_token_ids=list(range(0, 400, 2)),
    )
    s = SamplingSettings(temperature=1.0, max_new_tokens=20, seed=9)
    batched = generate_rollouts(even, prompts(), tmp_path / "b", s, batch_size=4, progress=False)
    alone = generate_rollouts(even, prompts(), tmp_path / "a", s, batch_size=1, progress=False)
    lengths = set()
    for rb, ra in zip(batched, alone, strict=True):
        toks = rb.response_ids.tolist()
        lengths.add(len(toks))
        assert all(t % 2 for t in toks[:-1])  # nothing after the first stop token
        assert toks[-1] % 2 == 0 or len(toks) == 20
        assert torch.equal(rb.response_ids, ra.response_ids)  # seed per prompt, not per batch
        assert torch.allclose(rb.logprobs, ra.logprobs, atol=1e-5)
    assert len(lengths) > 2  # rows really finished at different steps


def _load_child():
    spec = importlib.util.spec_from_file_location(
        "rollout_writer_child", HERE / "rollout_writer_child.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_resume_after_kill_equals_uninterrupted_run(random_target, tmp_path):
    child = _load_child()
    out, marker = tmp_path / "killed", tmp_path / "paused"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "rollout_writer_child.py"), str(out), str(marker), "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 120
    while not marker.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"child did not reach the pause point:\n{proc.stdout.read().decode()}")
        time.sleep(0.1)
    kwargs = dict(
        batch_size=child.BATCH_SIZE,
        shard_size=child.SHARD_SIZE,
        store_topk=child.STORE_TOPK,
        progress=False,
    )
    settings = SamplingSettings(**child.SETTINGS)
    # a second writer while the first is alive is refused naming it (issue 29), not mixed in
    with pytest.raises(RolloutError, match=rf"another blockdraft process \(pid {proc.pid}:"):
        generate_rollouts(random_target, child.make_prompts(), out, settings, **kwargs)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["rows"] for s in manifest["shards"]] == [3, 3]  # shard 2 was in progress
    finished = {s["file"]: (out / s["file"]).read_bytes() for s in manifest["shards"]}
    resumed = generate_rollouts(random_target, child.make_prompts(), out, settings, **kwargs)
    fresh = generate_rollouts(
        random_target, child.make_prompts(), tmp_path / "fresh", settings, **kwargs
    )

    assert {f: (out / f).read_bytes() for f in finished} == finished  # untouched
    assert len(resumed) == len(fresh) == child.NUM_PROMPTS
    assert [r.prompt_id for r in RolloutSet.open(out)] == [p.id for p in child.make_prompts()]
    for a, b in zip(RolloutSet.open(out), fresh, strict=True):
        assert a.prompt_id == b.prompt_id
        for field in ("prompt_ids", "response_ids", "logprobs", "topk_ids", "topk_logprobs"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (a.prompt_id, field)
    m = RolloutSet.open(out).manifest
    assert m["complete"] and m["num_rollouts"] == child.NUM_PROMPTS
    assert [s["first_row"] for s in m["shards"]] == [0, 3, 6, 9]
    RolloutSet.open(out).verify()
    assert not list(out.glob(".*.tmp"))


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_refuses_to_mix_targets_settings_or_prompts(random_target, tmp_path):
    out = tmp_path / "r"
    s = SamplingSettings(temperature=1.0, max_new_tokens=4, seed=0)
    generate_rollouts(random_target, prompts(4), out, s, batch_size=2, shard_size=2, progress=False)
    before = _snapshot(out)
    with pytest.raises(
        RolloutError, match=r"manifest.json: refusing to mix rollouts: settings.temperature differs"
    ):
        generate_rollouts(
            random_target, prompts(6), out, SamplingSettings(0.7, max_new_tokens=4), progress=False
        )
    with pytest.raises(RolloutError, match="settings.seed differs"):
        generate_rollouts(
            random_target,
            prompts(6),
            out,
            SamplingSettings(1.0, max_new_tokens=4, seed=1),
            progress=False,
        )
    other = make_random_target("qwen3", seed=1)  # same config and vocab, other weights
    with pytest.raises(RolloutError, match="target.fingerprint"):
        generate_rollouts(other, prompts(6), out, s, progress=False)
    with pytest.raises(RolloutError, match="store_topk differs"):
        generate_rollouts(random_target, prompts(6), out, s, store_topk=2, progress=False)
    renamed = [Prompt(f"z{i}", p.text, None, "t") for i, p in enumerate(prompts(6))]
    with pytest.raises(
        RolloutError, match=r"shard-00000.safetensors: rows 0..1 were generated for other prompts"
    ):
        generate_rollouts(random_target, renamed, out, s, progress=False)
    assert _snapshot(out) == before  # nothing written, nothing lost
    assert len(RolloutSet.open(out)) == 4

    # a damaged listed shard is regenerated by the rerun, the file found there moved aside
    (out / "shard-00001.safetensors").write_bytes(b"garbage")
    generate_rollouts(random_target, prompts(4), out, s, progress=False)
    after = _snapshot(out)
    assert after.pop("shard-00001.safetensors.replaced") == b"garbage"
    assert after == before

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(RolloutError, match="not empty and has no manifest.json"):
        generate_rollouts(random_target, prompts(2), busy, s, progress=False)
    assert _snapshot(busy) == {"notes.txt": b"mine"}
    with pytest.raises(PromptError, match="duplicate prompt id 'q0'"):
        generate_rollouts(random_target, prompts(2) * 2, tmp_path / "dup", s, progress=False)


def test_extend_with_leftovers_equals_one_run(random_target, tmp_path):
    s = SamplingSettings(temperature=1.0, max_new_tokens=5, seed=2)
    out = tmp_path / "grow"
    generate_rollouts(random_target, prompts(4), out, s, batch_size=2, shard_size=2, progress=False)
    # leftovers of a run killed after renaming shard 2 but before listing it, and mid-write
    (out / "shard-00002.safetensors").write_bytes(b"orphan")
    (out / ".shard-00003.safetensors.tmp").write_bytes(b"partial")
    grown = generate_rollouts(
        random_target, prompts(8), out, s, batch_size=2, shard_size=2, progress=False
    )
    whole = generate_rollouts(
        random_target, prompts(8), tmp_path / "one", s, batch_size=2, shard_size=2, progress=False
    )
    assert [r.response_ids.tolist() for r in grown] == [r.response_ids.tolist() for r in whole]
    assert grown.manifest["num_rollouts"] == 8 and grown.complete
    assert not (out / ".shard-00003.safetensors.tmp").exists()
    RolloutSet.open(out).verify()


def test_a_shorter_request_completes_an_interrupted_longer_one(random_target, tmp_path):
    """Resuming an interrupted 8-prompt run with its first 6 prompts finishes those 6 and
    marks the set complete (it used to keep `requested` 8 and stay incomplete forever)."""
    s = SamplingSettings(temperature=1.0, max_new_tokens=4, seed=3)
    out = tmp_path / "shrink"
    kw = dict(batch_size=2, shard_size=2, progress=False)
    generate_rollouts(random_target, prompts(4), out, s, **kw)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["prompts"]["requested"], manifest["complete"] = 8, False  # killed at row 4 of 8
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="incomplete rollout set"):
        RolloutSet.open(out)
    shorter = generate_rollouts(random_target, prompts(6), out, s, **kw)
    assert shorter.complete and len(RolloutSet.open(out)) == 6
    assert RolloutSet.open(out).manifest["prompts"]["requested"] == 6
    again = generate_rollouts(random_target, prompts(2), out, s, **kw)  # all stored already
    assert again.complete and len(again) == 6
    longer = generate_rollouts(random_target, prompts(8), out, s, **kw)  # extends it
    assert longer.complete and len(longer) == 8


def test_split_by_prompt_and_subsets(random_target, tmp_path):
    ids = [f"id{i}" for i in range(200)]
    train, ev = split_by_prompt(ids, 0.1, seed=0)
    assert len(ev) == 20 and sorted(train + ev) == list(range(200))
    assert split_by_prompt(ids, 0.1, seed=0) == (train, ev)
    assert split_by_prompt(ids, 0.1, seed=1)[1] != ev
    rev = ids[::-1]  # the split follows the ids, not their order
    assert {rev[i] for i in split_by_prompt(rev, 0.1, seed=0)[1]} == {ids[i] for i in ev}
    assert split_by_prompt(ids[:3], 0.01)[1] != []  # at least one eval prompt
    with pytest.raises(ValueError, match="eval_fraction"):
        split_by_prompt(ids, 1.0)

    s = SamplingSettings(temperature=1.0, max_new_tokens=3)
    rs = generate_rollouts(
        random_target, prompts(8), tmp_path / "r", s, shard_size=3, progress=False
    )
    tr, te = rs.split(0.25, seed=0)
    assert len(tr) == 6 and len(te) == 2
    assert sorted(rs.prompt_ids) == sorted(tr.prompt_ids + te.prompt_ids)
    assert [r.prompt_id for r in te] == te.prompt_ids
    sub = rs.subset([7, 0, 4])
    assert [r.prompt_id for r in sub] == ["q7", "q0", "q4"] and sub[-1].prompt_id == "q4"
    assert sub.subset([2])[0].prompt_id == "q4"
    assert rs.settings == s and rs.manifest["target"]["name"] == random_target.name
    with pytest.raises(IndexError):
        rs[8]
    with pytest.raises(RolloutError, match="no rollout manifest"):
        RolloutSet.open(tmp_path)


def test_nested_subset_is_nested_order_free_and_spread_over_a_mix():
    ids = [f"gsm{i}" for i in range(300)] + [f"code{i}" for i in range(300)]
    small, large = nested_subset(ids, 60), nested_subset(ids, 240)
    assert len(small) == 60 and len(set(small)) == 60 and small == sorted(small)
    assert set(small) <= set(large)  # every smaller set lies inside every larger one
    rev = ids[::-1]  # chosen by id, not by position
    assert {rev[i] for i in nested_subset(rev, 60)} == {ids[i] for i in small}
    # a prefix of the mix would be all `gsm`; a hash choice takes both halves (binomial
    # 60 draws of p = 1/2: 12..48 holds with probability > 1 - 1e-5)
    assert 12 <= sum(ids[i].startswith("gsm") for i in small) <= 48
    assert nested_subset(ids, 0) == [] and nested_subset(ids, 600) == list(range(600))
    with pytest.raises(ValueError, match="subset of 601"):
        nested_subset(ids, 601)


def test_cli_rollout(random_target, tmp_path, monkeypatch, capsys):
    import blockdraft.cli.rollout as rollout_cli
    from blockdraft.cli import main

    loaded = []
    monkeypatch.setattr(
        rollout_cli, "load_target", lambda name, **kw: loaded.append(name) or random_target
    )
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"question": t}) + "\n" for t in TEXTS))

    def args(out: str, temperature: str = "0.8") -> list[str]:
        return [
            "rollout",
            "--target",
            "x",
            "--prompts",
            f"{src}:question",
            "--out",
            str(tmp_path / out),
            "--temperature",
            temperature,
            "--top-k",
            "10",
            "--max-new-tokens",
            "4",
            "--limit",
            "5",
            "--shard-size",
            "2",
            "--batch-size",
            "2",
            "--store-topk",
            "3",
            "--no-progress",
        ]

    assert main(args("o")) == 0 and loaded == ["x"]
    rs = RolloutSet.open(tmp_path / "o")
    assert len(rs) == 5 and rs.settings.top_k == 10 and rs[0].topk_ids.shape[1] == 3
    assert rs.manifest["prompts"]["spec"] == f"{src}:question"
    assert main(args("o", temperature="0.5")) == 2
    assert "settings.temperature differs" in capsys.readouterr().err
    src.write_text('{"question": "a"}\n{oops\n')
    assert main(args("o2")) == 2
    assert f"{src}:2: invalid JSON" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_cli_rollout_stores_a_top_k_distribution_by_default(random_target, tmp_path, monkeypatch):
    """Without --store-topk: sampled rollouts under a top-k cutoff of at most 64 store that
    top k (their whole distribution: every stored row sums to 1), greedy ones and larger
    cutoffs nothing; resuming a set follows what it was written with, whatever the
    default."""
    import blockdraft.cli.rollout as rollout_cli
    from blockdraft.cli import main

    monkeypatch.setattr(rollout_cli, "load_target", lambda name, **kw: random_target)
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"question": t}) + "\n" for t in TEXTS))

    def run(out: str, *flags: str, limit: int = 3) -> RolloutSet:
        base = ["rollout", "--target", "x", "--prompts", f"{src}:question", "--out"]
        more = ["--max-new-tokens", "4", "--limit", str(limit), "--no-progress"]
        assert main([*base, str(tmp_path / out), *more, *flags]) == 0
        return RolloutSet.open(tmp_path / out)

    rs = run("k", "--temperature", "0.7", "--top-p", "0.8", "--top-k", "5")
    assert rs.manifest["store_topk"] == 5 and rs[0].topk_ids.shape[1] == 5
    mass = torch.cat([r.topk_logprobs.exp().sum(-1) for r in rs])
    torch.testing.assert_close(mass, torch.ones_like(mass))
    assert run("g", "--temperature", "0").manifest["store_topk"] == 0
    assert run("wide", "--temperature", "1", "--top-k", "65").manifest["store_topk"] == 0
    assert run("none", "--temperature", "1").manifest["store_topk"] == 0
    # a set written without the top k (as before this default) resumes without the flag
    flags = ("--temperature", "0.7", "--top-k", "5")
    assert run("old", *flags, "--store-topk", "0").manifest["store_topk"] == 0
    resumed = run("old", *flags, limit=5)
    assert len(resumed) == 5 and resumed.manifest["store_topk"] == 0


@pytest.mark.parametrize("screened", [False, True])
def test_greedy_rollouts_without_logprobs_equal_the_default(
    random_target, tmp_path, monkeypatch, screened
):
    """`store_logprobs=False`: the same greedy tokens, row for row and with varied lengths,
    NaN log-probs, the manifest says so. `screened`: the int8 (or bf16) screen of the head
    chooses every token and the fp32 head is never called; otherwise the plain path runs."""
    from blockdraft.data.rollouts import sampler as generation
    from blockdraft.kernels import argmax_screen

    monkeypatch.setattr(argmax_screen, "_HEADS", argmax_screen.weakref.WeakKeyDictionary())
    if screened:
        monkeypatch.setattr(argmax_screen.ScreenedArgmaxHead, "MIN_HEAD", 0)
        if generation.greedy_screen(random_target) is None:
            pytest.skip("no fast screen of the head on this CPU")
    else:
        assert generation.greedy_screen(random_target) is None  # the random head is small
    stops = Target(  # a few frequent tokens stop rows, so lengths vary
        random_target.model,
        random_target.tokenizer,
        name="stops",
        mask_token_id=random_target.mask_token_id,
        stop_token_ids=list(range(0, random_target.vocab_size, 5)),
    )
    s = SamplingSettings(temperature=0.0, max_new_tokens=12)
    ref = generate_rollouts(stops, prompts(), tmp_path / "ref", s, batch_size=3, progress=False)
    calls = {"screen": 0, "head": 0}
    original = argmax_screen.ScreenedArgmaxHead.argmax

    def counted(self, hidden):  # type: ignore[no-untyped-def]
        calls["screen"] += 1
        return original(self, hidden)

    monkeypatch.setattr(argmax_screen.ScreenedArgmaxHead, "argmax", counted)
    head = stops.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda *a: calls.__setitem__("head", calls["head"] + 1))
    try:
        lean = generate_rollouts(
            stops,
            prompts(),
            tmp_path / "lean",
            s,
            batch_size=3,
            progress=False,
            store_logprobs=False,
        )
    finally:
        hook.remove()
    lengths = {r.response_len for r in ref}
    assert len(lengths) > 1, "every row had the same length: the stop tokens proved nothing"
    assert [r.response_ids.tolist() for r in lean] == [r.response_ids.tolist() for r in ref]
    assert all(torch.isnan(r.logprobs).all() for r in lean)
    assert all(torch.isfinite(r.logprobs).all() for r in ref)
    assert (calls["screen"] > 0 and calls["head"] == 0) if screened else calls["screen"] == 0
    assert lean.manifest["store_logprobs"] is False and "NaN" in lean.manifest["logprobs"]
    assert "store_logprobs" not in ref.manifest  # sets with log-probs keep their manifest


def test_rollouts_without_logprobs_refusals(random_target, tmp_path, capsys):
    """Sampled or top-k rows need the full distribution; a set never mixes the two kinds;
    a rollout without log-probs is scored greedily only; the CLI says so in one line."""
    from blockdraft.cli import main
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
    from blockdraft.evaluation.scoring import acceptance_tensor

    greedy = SamplingSettings(temperature=0.0, max_new_tokens=4)
    for s, k in ((SamplingSettings(temperature=1.0, max_new_tokens=4), 0), (greedy, 2)):
        with pytest.raises(ValueError, match="only greedy rollouts without --store-topk"):
            generate_rollouts(
                random_target,
                prompts(2),
                tmp_path / "x",
                s,
                store_topk=k,
                progress=False,
                store_logprobs=False,
            )
    assert not (tmp_path / "x").exists()
    out = tmp_path / "r"
    rs = generate_rollouts(
        random_target, prompts(4), out, greedy, shard_size=2, progress=False, store_logprobs=False
    )
    before = _snapshot(out)
    with pytest.raises(RolloutError, match="store_logprobs differs"):
        generate_rollouts(random_target, prompts(6), out, greedy, progress=False)
    assert _snapshot(out) == before
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(random_target, num_layers=1, block_size=4)
    drafter = BlockDrafter(cfg).bind_target(random_target).eval()
    r = rs[0]
    acc = acceptance_tensor(drafter, random_target, r.prompt_ids, r.response_ids, r.logprobs, 0.0)
    assert acc.shape == (r.response_len - 1, 3)
    with pytest.raises(ValueError, match="no log-probs.*greedily"):
        acceptance_tensor(drafter, random_target, r.prompt_ids, r.response_ids, r.logprobs, 1.0)
    bad = ["rollout", "--target", "tiny", "--prompts", "stdlib:eval", "--out", str(tmp_path / "c")]
    assert main([*bad, "--no-logprobs", "--temperature", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--no-logprobs: only greedy rollouts" in err
    assert not (tmp_path / "c").exists()


def test_store_topk_beyond_the_top_k_cutoff_records_what_is_stored(tmp_path, capsys):
    """Under a top-k cutoff of 5 at most 5 entries of a distribution are non-zero, so
    `--store-topk 100000` stores (and records) 5, and says so; greedy sets, which store
    T = 1 log-probs, are capped at the vocabulary."""
    from blockdraft.data.rollouts.store import RolloutSet
    from blockdraft.targets.registry import load_target
    from clikit import run_cli, save_local_model

    model = save_local_model(tmp_path / "m")
    common = ("rollout", "--target", model, "--prompts", "stdlib:train", "--limit", "2",
              "--max-new-tokens", "4", "--no-progress", "--store-topk", "100000")  # fmt: skip
    code, out, err = run_cli(capsys, *common, "--top-k", "5", "--out", tmp_path / "s")
    assert code == 0, err
    assert "--store-topk 100000" in err and "storing 5" in err
    rs = RolloutSet.open(tmp_path / "s")
    assert rs.manifest["store_topk"] == 5 and rs[0].topk_ids.shape[-1] == 5
    code, out, err = run_cli(capsys, *common, "--temperature", "0", "--out", tmp_path / "g")
    vocab = load_target(str(model), progress=False).vocab_size
    assert code == 0 and f"storing {vocab}" in err
    assert RolloutSet.open(tmp_path / "g").manifest["store_topk"] == vocab


def test_a_stage_directory_opens_the_set_it_holds(tmp_path):
    """The demo's `rollouts/eval` holds its set in `set/`: the printed stage path works."""
    from blockdraft.data.prompt_specs import load_prompts
    from blockdraft.data.rollouts.store import STAGE_SET

    target = make_random_target()
    stage = tmp_path / "rollouts" / "eval"
    generate_rollouts(
        target, load_prompts("stdlib:eval", limit=2), stage / STAGE_SET,
        SamplingSettings(temperature=0, max_new_tokens=4), progress=False,
    )  # fmt: skip
    (stage / "stage.json").write_text("{}")
    assert len(RolloutSet.open(stage)) == 2
    with pytest.raises(RolloutError, match="no rollout manifest"):
        RolloutSet.open(tmp_path / "rollouts")
