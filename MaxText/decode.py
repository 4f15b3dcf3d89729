"""mode=decode: tokenize `prompt`, generate `max_new_tokens` with the inference Engine, print the completion.

Params come from `load_parameters_path` (a converted checkpoint: `python -m MaxText.convert_hf_checkpoint`), else
from the run's latest training checkpoint (`<base_output_directory>/<run_name>/checkpoints`), else a random init
(a smoke run, with a warning). The tokenizer is the Kimi tiktoken one when the checkpoint folder holds
`tiktoken.model` + `tokenizer_config.json`, byte-level otherwise.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from MaxText import checkpointing, pyconfig
from MaxText.inference.engine import Engine, GenerationStats
from MaxText.layers.models import KimiLinearForCausalLM
from MaxText.tokenizer import load_tokenizer
from MaxText.train import init_params, latest_trained_params

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DecodeResult:
    prompt: str
    completion: str
    new_token_ids: list[int]
    stats: GenerationStats


def load_decode_params(config):
    if config.load_parameters_path:
        return checkpointing.load_sharded_params(config.load_parameters_path, config)
    params = latest_trained_params(config)
    if params is None:
        logger.warning("no load_parameters_path and no training checkpoint for run %r: decoding with RANDOM "
                       "weights (a smoke run)", config.run_name)
        params = init_params(KimiLinearForCausalLM(config), config, jax.random.key(config.seed))
    return params


def decode(config, params=None) -> DecodeResult:
    """Generates a completion of `config.prompt`; `params` defaults to `load_decode_params(config)`."""
    tokenizer = load_tokenizer(config.load_parameters_path, config)
    engine = Engine(config, load_decode_params(config) if params is None else params)
    prompt_ids = tokenizer.encode(config.prompt, add_bos=tokenizer.bos_id is not None)
    new_ids = engine.generate([prompt_ids], config.max_new_tokens, temperature=config.temperature,
                              seed=config.seed, eos_id=tokenizer.eos_id, speculative=config.speculative,
                              num_draft_tokens=config.num_draft_tokens, draft_engine=load_draft_engine(config))[0]
    # Acceptance is logged by the speculative loop and printed by train_or_decode.py from these stats.
    return DecodeResult(config.prompt, tokenizer.decode(new_ids), new_ids, engine.last_stats)


def load_draft_engine(config) -> Engine | None:
    """speculative=draft_model: an Engine of `draft_config_path` with `draft_parameters_path` (random init when
    empty, with a warning); None otherwise."""
    if config.speculative != "draft_model":
        return None
    draft_config = pyconfig.load_config(config.draft_config_path)
    if config.draft_parameters_path:
        return Engine(draft_config, checkpointing.load_params(config.draft_parameters_path, draft_config))
    logger.warning("speculative=draft_model without draft_parameters_path: the draft model has RANDOM weights (its "
                   "drafts are rarely accepted; the output is still exact)")
    return Engine(draft_config, init_params(KimiLinearForCausalLM(draft_config), draft_config,
                                            jax.random.key(config.seed)))
