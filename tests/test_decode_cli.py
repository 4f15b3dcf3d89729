"""The user path: HF checkpoint with a Kimi tiktoken tokenizer -> convert -> `train_or_decode.py mode=decode`."""

import os
import re
import subprocess
import sys

from end_to_end import tiny_hf
from MaxText import pyconfig
from MaxText.convert_hf_checkpoint import convert
from MaxText.decode import decode
from MaxText.tokenizer import KimiTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_decode_a_converted_checkpoint_from_the_command_line(tmp_path):
    hf_dir, out_dir = str(tmp_path / "hf"), str(tmp_path / "converted")
    assert tiny_hf.main([hf_dir, "--kimi-tokenizer"]) == 0
    convert(hf_dir, out_dir, progress=False)
    prompt = "def fibonacci(n): hello world"
    args = [f"{out_dir}/config.yml", "mode=decode", f"prompt={prompt}", "max_new_tokens=12"]
    run = subprocess.run([sys.executable, os.path.join(REPO, "train_or_decode.py"), *args], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    # The same request through the Python API: the CLI prints exactly its completion, with the Kimi tokenizer.
    config = pyconfig.load_config(args[0], args[1:])
    assert config.load_parameters_path == out_dir
    expected = decode(config)
    assert len(expected.new_token_ids) == 12
    tokenizer = KimiTokenizer(out_dir)
    assert tokenizer.decode(expected.new_token_ids) == expected.completion
    assert f"--- prompt ---\n{prompt}\n--- completion (12 tokens) ---\n{expected.completion}\n" in run.stdout
    assert re.search(r"prefill: \d+ tokens, [\d.]+ tokens/s; decode: 12 tokens, [\d.]+ tokens/s", run.stdout)
