"""Offline tensor parallelism from a script without `if __name__ == "__main__":`: the spawned ranks
re-import the script, and the user gets one line saying what to add, not one bootstrap traceback per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_unguarded_script_gets_one_line_naming_the_main_guard(tiny_models, tmp_path):
    script = tmp_path / "offline_tp.py"
    script.write_text(
        "from serving import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_models('llama'))!r}, tensor_parallel_size=2, device='cpu', dtype='float32',\n"
        "          max_model_len=64, kv_cache_memory_gb=0.01)\n"
        "print(llm.generate(['hi'], SamplingParams(max_tokens=2)))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0
    assert 'put the code that creates the LLM under `if __name__ == "__main__":`' in p.stderr, p.stderr[-3000:]
    assert "bootstrapping phase" not in p.stderr and p.stderr.count("Traceback") <= 1, p.stderr[-3000:]
