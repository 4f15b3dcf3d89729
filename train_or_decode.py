"""Entry point: `python train_or_decode.py CONFIG.yml [key=value ...]`.

mode=train trains (MaxText/train.py); mode=decode generates a completion of `prompt` (MaxText/decode.py);
mode=both trains, then decodes with the trained weights. Every key is documented in configs/base.yml.
"""

from __future__ import annotations

import logging
import sys
import time

from MaxText import pyconfig
from MaxText.pyconfig import ConfigError


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("absl", "jax._src"):  # Orbax and XLA narrate every save and compile at INFO
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    try:
        config = pyconfig.load_config(argv[1], argv[2:])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    _setup_logging(config.log_level)
    from MaxText import decode, sharding, train  # after logging is set up: importing JAX is slow and chatty

    sharding.maybe_initialize_distributed(config)  # multi-host: before anything else touches the devices

    params = None
    if config.mode in ("train", "both"):
        start = time.perf_counter()
        result = train.train(config)
        first, last = min(result.eval_losses), max(result.eval_losses)
        print(f"trained to step {result.final_step} in {time.perf_counter() - start:.0f} s: held-out loss "
              f"{result.eval_losses[first]:.3f} (step {first}) -> {result.eval_losses[last]:.3f} (step {last}); "
              f"checkpoints in {result.checkpoint_dir}")
        params = result.params
    if config.mode in ("decode", "both"):
        out = decode.decode(config, params)
        stats = out.stats
        print(f"--- prompt ---\n{out.prompt}\n--- completion ({len(out.new_token_ids)} tokens) ---\n{out.completion}")
        print(f"prefill: {stats.prefill_tokens} tokens, {stats.prefill_tokens_per_second:.1f} tokens/s; decode: "
              f"{stats.decode_tokens} tokens, {stats.decode_tokens_per_second:.1f} tokens/s "
              f"(first call includes compilation)")
        if config.speculative != "none":
            print(f"speculative={config.speculative}, num_draft_tokens={config.num_draft_tokens}: acceptance "
                  f"{100 * stats.acceptance_rate:.1f}%, {stats.tokens_per_step:.2f} tokens per verify step, "
                  f"{stats.verify_steps} verify steps")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
