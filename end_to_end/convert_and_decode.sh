#!/usr/bin/env bash
# The user path on CPU, end to end: a tiny random HF Kimi-Linear checkpoint (HF's own save_pretrained, several
# shards, with a small tiktoken Kimi tokenizer) -> `python -m MaxText.convert_hf_checkpoint` -> decode it with
# `python train_or_decode.py OUT/config.yml mode=decode ...`. Usage: end_to_end/convert_and_decode.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:-$(mktemp -d)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"

python end_to_end/tiny_hf.py "$WORK/hf" --kimi-tokenizer
rm -rf "$WORK/converted"
python -m MaxText.convert_hf_checkpoint --hf-path "$WORK/hf" --output-dir "$WORK/converted"
python train_or_decode.py "$WORK/converted/config.yml" mode=decode load_parameters_path="$WORK/converted" \
  prompt="def fibonacci(n):" max_new_tokens=16
