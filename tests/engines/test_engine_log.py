"""vLLM's own output (a screen of Triton, NUMA, tcmalloc, thread-binding and seed warnings
at every start) goes to a log file, so a run prints blockdraft's lines; no vLLM needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from blockdraft.engines.vllm_engine import LOG_ENV, engine_log_path
from blockdraft.user_cache import CACHE_ENV

SRC = Path(__file__).resolve().parents[2] / "src"


def test_the_engine_process_output_native_lines_included_goes_to_the_log(tmp_path):
    log = tmp_path / "logs" / "vllm.log"
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from blockdraft.engines.vllm_engine import redirect_output\n"
        "assert redirect_output(Path(sys.argv[1]), 'engine for tiny')\n"
        "print('a python line')\n"
        "os.write(2, b'a native line on fd 2\\n')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for _ in range(2):  # appended: the second start keeps the first one's lines
        done = subprocess.run(
            [sys.executable, "-c", code, str(log)], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done
    text = log.read_text()
    assert text.count("a python line") == 2 and text.count("a native line on fd 2") == 2
    assert text.count(": engine for tiny") == 2


def test_where_the_log_goes(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(LOG_ENV, raising=False)
    assert engine_log_path() == tmp_path / "cache" / "logs" / "vllm.log"
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "mine.log"))
    assert engine_log_path() == tmp_path / "mine.log"
    monkeypatch.setenv(LOG_ENV, "-")
    assert engine_log_path() is None  # left on the terminal


def test_asking_the_installed_vllm_what_it_serves_prints_nothing(tmp_path):
    """`export --target` asks vLLM's registry whether it serves the target: vLLM's import
    notes (Triton's missing CPU backend, ...) must not land on the command's terminal."""
    import pytest

    from blockdraft.engines.vllm_engine import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not installed")
    code = (
        "from blockdraft.engines.dflash_support import _installed_vllm_serves\n"
        "assert _installed_vllm_serves('Qwen3ForCausalLM') is True\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("VLLM_LOGGING_LEVEL", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done
