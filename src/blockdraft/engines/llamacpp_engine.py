"""llama.cpp as an `Engine` (engines/interface.py): `LLAMACPP`, registered as `llamacpp`.

Why a server process: llama.cpp's speculative decoding (`--spec-type draft-dflash`, its
n-gram types) runs in `llama-server`, which is what laptop users start; blockdraft starts
one on a free local port, sends token-id prompts to `/completion` and reads the response
ids back, so the prompt is never re-tokenised. The server prints each verification round
("accepted k/n draft tokens") when LLAMA_TRACE is set; those lines are the drafting
counters, read per task id. Only the standard library talks to it (urllib).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from blockdraft.engines.interface import (
    ClosedOnExit,
    Drafts,
    EngineError,
    EngineOutput,
    SpecCounters,
    Speculation,
)
from blockdraft.engines.llamacpp_gguf import (
    GGUF,
    LLAMACPP_VERSION,
    OUTTYPES,
    cached_target_gguf,
    convert_to_gguf,
    llamacpp_problem,
    require_tools,
    server_args,
    server_binary,
)
from blockdraft.sampling import SamplingSettings
from blockdraft.serialization.export import DRAFTER_GGUF

START_TIMEOUT_S = 600
PARALLEL = 4  # server slots: batched requests run side by side up to this many
# llama.cpp's n-gram type that `Speculation("ngram")` starts (its own rule, not blockdraft's)
NGRAM_TYPE = "ngram-simple"
_ROUND = " accepted "
_PROPOSAL = re.compile(r"seq_id (\d+), draft candidate +0, pos +(\d+): +(-?\d+) ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _completion_body(
    prompt: Sequence[int],
    settings: SamplingSettings,
    seed: int | None,
) -> dict[str, Any]:
    """`/completion`'s request for blockdraft's sampling settings: HF's order (temperature,
    top-k, top-p) and none of llama.cpp's other samplers (min-p, penalties)."""
    return {
        "prompt": [int(t) for t in prompt],
        "n_predict": settings.max_new_tokens,
        "temperature": settings.temperature,
        "top_k": settings.top_k if settings.top_k > 0 else 0,
        "top_p": settings.top_p,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
        "samplers": ["temperature", "top_k", "top_p"],
        "seed": -1 if seed is None else int(seed),
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


class LlamaServer:
    """One `llama-server` process over a target GGUF (optionally with speculation)."""

    def __init__(
        self, args: list[str], *, ctx: int, threads: int, seed: int = 0, proposals: bool = False
    ) -> None:
        binary, _ = require_tools()
        self.port = _free_port()
        self.version = LLAMACPP_VERSION
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the server)
            prefix="blockdraft-llama-server-", suffix=".log", delete=False
        )
        self.log_path = Path(self._log.name)
        self._read_at = 0
        self._rounds: dict[int, list[tuple[int, int]]] = {}  # slot id -> (accepted, drafted)
        self.proposals: dict[int, list[list[int]]] = {}  # slot id -> each draft's tokens
        self._lock = threading.Lock()
        argv = [str(binary), *args, "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["-c", str(ctx * PARALLEL), "-np", str(PARALLEL), "-t", str(threads)]
        # debug verbosity (5) logs each draft's candidates: what `take_drafts` returns
        argv += [
            "-tb",
            str(threads),
            "-s",
            str(seed),
            "--no-webui",
            "-lv",
            "5" if proposals else "3",
        ]
        self.argv = argv
        env = {**os.environ, "LLAMA_TRACE": "1"}
        started = time.perf_counter()
        self._proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
        )
        self._wait_ready()
        self.load_seconds = time.perf_counter() - started

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
                self.close()
                raise EngineError(f"llama-server failed to start: {' | '.join(tail)}")
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.close()
        raise EngineError(f"llama-server did not start within {START_TIMEOUT_S} s")

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self._url("/completion"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=3600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise EngineError(f"llama-server refused a request: {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, ConnectionError) as exc:
            raise EngineError(f"llama-server stopped answering: {exc}") from None

    def read_rounds(self) -> dict[int, list[tuple[int, int]]]:
        """Every verification round the log shows so far, by server slot, in order."""
        with self._lock, open(self.log_path, "rb") as f:
            f.seek(self._read_at)
            chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # only whole lines; the rest is read next time
            self._read_at += end
            for line in chunk[:end].decode(errors="replace").splitlines():
                proposal = _PROPOSAL.search(line)
                if proposal:
                    seq, pos, token = (int(g) for g in proposal.groups())
                    drafts = self.proposals.setdefault(seq, [])
                    if pos == 0 or not drafts:
                        drafts.append([])
                    drafts[-1].append(token)
                    continue
                if _ROUND not in line or "draft tokens" not in line:
                    continue
                slot = int(line.split("| task")[0].rsplit("id", 1)[1])
                counts = line.split(_ROUND)[1].split("draft tokens")[0]
                accepted, drafted = (int(x) for x in counts.split("/"))
                self._rounds.setdefault(slot, []).append((accepted, drafted))
            return self._rounds

    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()


class LlamaCppEngine(ClosedOnExit):
    """A started llama-server, answering `RunningEngine`'s questions (batch = concurrent
    requests on its slots; counters from its per-round log lines)."""

    def __init__(self, server: LlamaServer, num_proposals: int) -> None:
        self.server = server
        self.version = server.version
        self.load_seconds = server.load_seconds
        self.num_proposals = num_proposals
        self._counted: dict[int, int] = {}  # rounds per slot already returned by take_drafts
        self._expected: dict[int, int] = {}  # drafted tokens per slot the replies counted
        self._lock = threading.Lock()

    def _one(
        self, prompt: Sequence[int], settings: SamplingSettings, stop: set[int], seed: int | None
    ) -> EngineOutput:
        reply = self.server.complete(_completion_body(prompt, settings, seed))
        ids = [int(t) for t in reply.get("tokens") or []]
        for i, t in enumerate(ids):  # blockdraft's stop ids, whatever llama.cpp's EOG set is
            if t in stop:
                ids = ids[: i + 1]
                break
        drafted = int((reply.get("timings") or {}).get("draft_n", 0) or 0)
        self._wait_for_rounds(int(reply.get("id_slot", -1)), drafted)
        return EngineOutput(ids, [float("nan")] * len(ids))

    def _wait_for_rounds(self, slot: int, drafted: int) -> None:
        """The server logs from a thread of its own: wait until the log shows as many
        drafted tokens on this request's slot as the replies so far counted there."""
        with self._lock:
            want = self._expected.get(slot, 0) + drafted
            self._expected[slot] = want
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if sum(d for _, d in self.server.read_rounds().get(slot, [])) >= want:
                return
            time.sleep(0.02)
        raise EngineError(f"llama-server's log ({self.server.log_path}) lacks rounds it ran")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        settings: SamplingSettings,
        stop_token_ids: Sequence[int],
        seeds: Sequence[int | None],
        *,
        logprobs: int | None = None,
        topk: int = 0,
    ) -> list[EngineOutput]:
        """One row per prompt; several prompts run as concurrent requests (the server's
        slots batch them). Log-probs are not read from llama.cpp here."""
        if logprobs is not None or topk:
            raise EngineError(
                "the llama.cpp engine returns no log-probs, which rollouts store: write "
                "rollouts with blockdraft's own loop or --engine vllm"
            )
        stop = set(map(int, stop_token_ids))
        if len(prompts) == 1:
            return [self._one(prompts[0], settings, stop, seeds[0])]
        with ThreadPoolExecutor(max_workers=min(PARALLEL, len(prompts))) as pool:
            futures = [
                pool.submit(self._one, p, settings, stop, s)
                for p, s in zip(prompts, seeds, strict=True)
            ]
            return [f.result() for f in futures]

    def counters(self) -> SpecCounters:
        """Drafting counters over every round the server has logged since it started."""
        out = SpecCounters(accepted_per_position=[0] * self.num_proposals)
        for rounds in self.server.read_rounds().values():
            for accepted, drafted in rounds:
                if drafted == 0:
                    continue
                out.drafts += 1
                out.draft_tokens += drafted
                out.accepted += accepted
                for i in range(min(accepted, self.num_proposals)):
                    out.accepted_per_position[i] += 1
        return out

    def take_drafts(self) -> Drafts:
        """Each draft's proposals since the last call (`record_drafts=True`: the server logs
        its candidates at debug verbosity); llama.cpp logs no anchor, and no step where the
        draft was empty (n-gram types without a match)."""
        self.server.read_rounds()
        out: Drafts = []
        for slot, seen in self.server.proposals.items():
            out.extend(([], [list(p)]) for p in seen[self._counted.get(slot, 0) :])
            self._counted[slot] = len(seen)
        return out

    def close(self) -> None:
        self.server.close()


class LlamaCpp:
    """llama.cpp as an `Engine`: targets and drafters are converted to GGUF first (the
    target once, cached), then one `llama-server` per start."""

    name = "llamacpp"
    records_lookup_steps = False  # the server logs verified drafts only
    lookup_rules_match = False  # ngram-simple & co. are its own rules
    export_format = GGUF

    def version(self) -> str | None:
        return LLAMACPP_VERSION if server_binary() is not None else None

    def serve_problem(self, drafter_cfg: dict[str, Any], target_config: Any) -> str | None:
        return llamacpp_problem(drafter_cfg, target_config)

    def serve_command(self, target: str, drafter_dir: str, num_proposals: int) -> str:
        """With GGUFs that `export --format gguf` writes (the target's in the user cache)."""
        gguf = str(Path(drafter_dir) / DRAFTER_GGUF)
        args = server_args("TARGET.gguf", drafter_gguf=gguf, num_proposals=num_proposals)
        return (
            "# (`blockdraft export --format gguf` writes both GGUFs and prints this with them)\n"
            "llama-server " + " ".join(shlex.quote(a) for a in args)
        )

    def load(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        seed: int = 0,
        speculation: Speculation | None = None,
        sampled_logprobs: bool = False,
        record_drafts: bool = False,
    ) -> LlamaCppEngine:
        require_tools()
        outtype = OUTTYPES.get(dtype or "float32")
        if outtype is None:
            raise EngineError(
                f"the llama.cpp engine converts float32/bfloat16/float16, not {dtype}"
            )
        target = cached_target_gguf(model_dir, outtype)
        drafter, k, ngram_type = None, 0, None
        tmp = None
        if speculation is not None and speculation.method == "dflash":
            if speculation.sampled:
                raise EngineError(
                    "llama.cpp's draft-dflash drafts the argmax and verifies it against the "
                    "target's sample; it has no draw-and-verify (min(1, p/q)) mode, so at T > 0 "
                    "its acceptance is not the evaluator's: check at T = 0"
                )
            tmp = tempfile.TemporaryDirectory(prefix="blockdraft-llamacpp-")
            drafter = str(
                convert_to_gguf(
                    speculation.model, Path(tmp.name) / "drafter.gguf", outtype, model_dir
                )
            )
            k = speculation.num_proposals
        elif speculation is not None:
            ngram_type, k = NGRAM_TYPE, speculation.num_proposals
        cache = "f32" if outtype == "f32" else "f16"
        args = server_args(
            target,
            drafter_gguf=drafter,
            num_proposals=k,
            ngram_type=ngram_type,
            ngram_size=speculation.lookup_max if speculation is not None else 3,
            cache_type=cache,
        )
        try:
            threads = max(1, torch.get_num_threads())
            server = LlamaServer(
                args, ctx=max_model_len, threads=threads, seed=seed, proposals=record_drafts
            )
        finally:
            if tmp is not None:
                tmp.cleanup()  # the server has read the drafter
        return LlamaCppEngine(server, k)


LLAMACPP = LlamaCpp()

__all__ = ["LLAMACPP", "LlamaCppEngine", "LlamaServer"]
