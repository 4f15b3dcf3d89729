"""Speculative vs plain greedy decoding: tokens/s, acceptance rate and tokens per verify step on repetitive input.

    python benchmarks/speculative.py                                    # CPU-size tiny random model
    python benchmarks/speculative.py --config configs/kimi_linear.yml --layers 4 --batch 8 --new-tokens 256  # GPU

The prompt is source code (this repository's own Python files, byte-level tokens, modulo the vocabulary): the
n-gram drafter finds earlier occurrences of the recent tokens in it. A random-init model does not copy from its
context, so acceptance is low there; `--params trained` loads the tiny model trained by
`train_or_decode.py configs/kimi_linear_tiny.yml` (its run's latest checkpoint), `--params DIR` a converted one. Each configuration runs once to compile, then is timed over
`--repeats` runs; the outputs are asserted token-identical to plain greedy.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from MaxText import checkpointing, pyconfig  # noqa: E402
from MaxText.inference.engine import Engine  # noqa: E402
from MaxText.layers.models import KimiLinearForCausalLM  # noqa: E402
from MaxText.train import latest_trained_params  # noqa: E402


def source_code_prompts(batch: int, length: int, vocab_size: int) -> list[list[int]]:
    """`batch` windows of `length` bytes from the repository's Python sources (byte ids modulo the vocabulary)."""
    text = b"".join(open(path, "rb").read() for path in sorted(glob.glob(os.path.join(REPO, "MaxText", "**", "*.py"),
                                                                          recursive=True)))
    stride = max((len(text) - length) // batch, 1)
    return [[b % vocab_size for b in text[i * stride:i * stride + length]] for i in range(batch)]


def timed(engine, fn, repeats: int):
    """Runs `fn` once to compile, then `repeats` times; returns (its result, decode tokens/s of the timed runs)."""
    fn()
    tokens = seconds = 0.0
    for _ in range(repeats):
        result = fn()
        tokens, seconds = tokens + engine.last_stats.decode_tokens, seconds + engine.last_stats.decode_seconds
    return result, tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/kimi_linear_tiny.yml")
    parser.add_argument("--params", default="", help="a converted checkpoint directory, 'trained' (the config's "
                        "run's latest training checkpoint under base_output_directory), or '' (random init)")
    parser.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0 = all)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kernel", default="auto", help="kda_kernel")
    args = parser.parse_args()

    overrides = {"kda_kernel": args.kernel, "temperature": 0.0,
                 "max_target_length": args.prompt_len + args.new_tokens + max(args.draft_tokens) + 1}
    if args.layers:
        base = pyconfig.load_config(args.config)
        overrides.update(num_decoder_layers=args.layers,
                         kda_layers=[i + 1 for i in range(args.layers) if base.layer_types[i] == "kda"],
                         mla_layers=[i + 1 for i in range(args.layers) if base.layer_types[i] == "mla"])
    config = pyconfig.load_config(args.config, overrides)
    if args.params == "trained":
        params = latest_trained_params(config)
        if params is None:
            raise SystemExit(f"no training checkpoint for run {config.run_name!r} under {config.base_output_directory}")
    elif args.params:
        params = checkpointing.load_params(args.params, config)
    else:
        params = KimiLinearForCausalLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32),
                                                    model_mode="train")
    engine = Engine(config, params)
    prompts = source_code_prompts(args.batch, args.prompt_len, config.vocab_size)
    print(f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {config.num_decoder_layers} layers, "
          f"emb_dim {config.emb_dim}, params {'random' if not args.params else args.params}; batch {args.batch}, "
          f"prompt {args.prompt_len} source-code tokens, {args.new_tokens} new tokens, greedy")

    plain, plain_tps = timed(engine, lambda: engine.generate(prompts, args.new_tokens), args.repeats)
    print("| drafter | k | tokens/s | vs plain | acceptance | tokens / verify step |")
    print("|---|---|---|---|---|---|")
    print(f"| plain | - | {plain_tps:.1f} | 1.00 | - | 1.00 |")
    for k in args.draft_tokens:
        out, tps = timed(engine, lambda: engine.generate(prompts, args.new_tokens, speculative="ngram",
                                                         num_draft_tokens=k), args.repeats)
        assert out == plain, f"speculative output differs from plain greedy at k={k}"
        stats = engine.last_stats
        print(f"| ngram | {k} | {tps:.1f} | {tps / plain_tps:.2f} | {100 * stats.acceptance_rate:.1f}% | "
              f"{stats.tokens_per_step:.2f} |")


if __name__ == "__main__":
    main()
