"""HF Kimi-Linear checkpoint (config.json + safetensors shards) -> our checkpoint directory (config.yml + Orbax).

    python -m MaxText.convert_hf_checkpoint --hf-path DIR --output-dir OUT [--dtype bfloat16|float32]

1. Reads `config.json` (moonshotai `linear_attn_config` schema or transformers `layer_types` schema) and the
   headers of every shard (`model.safetensors.index.json` when present, else every `*.safetensors`), and
   validates the whole checkpoint before reading any weight: truncated files, unexpected / missing tensors and
   wrong shapes are reported by name with the expected and the found shape.
2. Streams shard by shard, one tensor at a time, into per-param staging files in our layout and dtype (experts of
   one layer may span shards; they fill their slots wherever they come from).
3. Writes the Orbax checkpoint from the staging files one chunk at a time, `OUT/config.yml`, and copies the
   tokenizer files (`tiktoken.model`, `tokenizer_config.json`) when present.
Everything is written into a temporary directory beside OUT that is renamed to OUT at the very end, so a failed or
interrupted conversion leaves no OUT. Peak memory: about the largest single tensor plus a few 64 MiB blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from MaxText import checkpointing, hf_weights, pyconfig

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")
INDEX_FILE = "model.safetensors.index.json"
STAGING_SUBDIR = "_staging"


class ConversionError(ValueError):
    """The HF checkpoint directory cannot be converted (the message says which file or tensor and why)."""


# ------------------------------------------------------------------------------------------------ safetensors


def _safetensors_dtypes() -> dict[str, np.dtype]:
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    return {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
            "BF16": np.dtype(ml_dtypes.bfloat16)}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes sit in a safetensors file."""
    file: str
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def read_safetensors_header(file: str) -> list[TensorEntry]:
    """The tensors of one safetensors file, checked against the file's size (a truncated file fails here)."""
    dtypes = _safetensors_dtypes()
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ConversionError(f"{file}: truncated safetensors file ({size} bytes, no header)")
        header_len = int.from_bytes(prefix, "little")
        if 8 + header_len > size:
            raise ConversionError(f"{file}: truncated safetensors file: the header needs {header_len} bytes, the "
                                  f"file has {size - 8}")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise ConversionError(f"{file}: corrupt safetensors header ({e})") from e
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in dtypes:
            raise ConversionError(f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}; expected one of "
                                  f"{sorted(dtypes)}")
        dtype, shape = dtypes[info["dtype"]], tuple(int(s) for s in info["shape"])
        begin, end = (8 + header_len + int(o) for o in info["data_offsets"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ConversionError(f"{file}: tensor {name!r} of shape {list(shape)} {info['dtype']} spans "
                                  f"{end - begin} bytes; expected {int(np.prod(shape)) * dtype.itemsize}")
        if end > size:
            raise ConversionError(f"{file}: truncated safetensors file: tensor {name!r} ends at byte {end}, the "
                                  f"file has {size} bytes")
        entries.append(TensorEntry(file, name, dtype, shape, begin, end))
    return sorted(entries, key=lambda e: e.begin)


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """Reads one tensor with plain file reads (no mmap, so nothing stays resident after it is dropped)."""
    out = np.empty(entry.shape, entry.dtype)
    with open(entry.file, "rb") as f:
        f.seek(entry.begin)
        read = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if read != entry.end - entry.begin:
        raise ConversionError(f"{entry.file}: truncated while reading tensor {entry.name!r}")
    return out


def shard_files(hf_path: str) -> list[str]:
    """The safetensors shards: those named by model.safetensors.index.json, else every *.safetensors file."""
    index = os.path.join(hf_path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{index} has no 'weight_map' of tensor name -> shard file")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(hf_path, f))]
        if missing:
            raise ConversionError(f"{index} names shard files that do not exist in {hf_path}: {missing}")
        return [os.path.join(hf_path, f) for f in files]
    files = sorted(f for f in os.listdir(hf_path) if f.endswith(".safetensors"))
    if not files:
        raise ConversionError(f"no *.safetensors files (and no {INDEX_FILE}) in {hf_path}")
    return [os.path.join(hf_path, f) for f in files]


def read_all_headers(hf_path: str) -> dict[str, list[TensorEntry]]:
    """shard file -> its tensors; checks names are unique across shards and agree with the index when present."""
    shards = {file: read_safetensors_header(file) for file in shard_files(hf_path)}
    seen: dict[str, str] = {}
    for file, entries in shards.items():
        for entry in entries:
            if entry.name in seen:
                raise ConversionError(f"tensor {entry.name!r} is in both {seen[entry.name]} and {file}")
            seen[entry.name] = file
    index = os.path.join(hf_path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        wrong = [f"{name!r} (index: {file}, found in: {os.path.basename(seen[name]) if name in seen else 'no shard'})"
                 for name, file in weight_map.items() if name not in seen or os.path.basename(seen[name]) != file]
        if wrong:
            raise ConversionError(f"{index} disagrees with the shards for tensors: {', '.join(wrong[:8])}")
    return shards


# ------------------------------------------------------------------------------------------------ conversion


def read_hf_config(hf_path: str) -> dict[str, Any]:
    file = os.path.join(hf_path, "config.json")
    if not os.path.isfile(file):
        raise ConversionError(f"no config.json in {hf_path}")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def default_dtype(hf_config: Mapping[str, Any]) -> str:
    """The checkpoint's own dtype (config.json `dtype` / `torch_dtype`) when it is bfloat16, else float32."""
    return "bfloat16" if (hf_config.get("dtype") or hf_config.get("torch_dtype")) == "bfloat16" else "float32"


def _stage_shards(shards: Mapping[str, list[TensorEntry]], staged: Mapping[tuple[str, ...], checkpointing.StagedArray],
                  specs: Mapping[str, hf_weights.HFTensorSpec], progress: bool) -> None:
    """Streams every tensor, shard by shard, into its staging files (one HF tensor in memory at a time)."""
    total = sum(e.end - e.begin for entries in shards.values() for e in entries)
    with tqdm(total=total, unit="B", unit_scale=True, desc="reading shards", disable=not progress) as bar:
        for file, entries in shards.items():
            bar.set_postfix_str(os.path.basename(file))
            for entry in entries:
                array = read_tensor(entry)
                for piece in hf_weights.convert_tensor(entry.name, array, specs):
                    staged[piece.path].write(piece.value, piece.slot)
                del array
                bar.update(entry.end - entry.begin)


def convert(hf_path: str, output_dir: str, dtype: str | None = None, progress: bool = True,
            dense_kernel_layout: str | None = None, expert_kernel_layout: str | None = None) -> str:
    """Converts the HF checkpoint at `hf_path` into the new directory `output_dir`; returns its absolute path.

    `dtype`: 'bfloat16' | 'float32' for the stored weights (the router bias stays float32); None = the
    checkpoint's own. `dense_kernel_layout`: 'in_out' | 'out_in', how the dense projections' kernels are stored
    (configs/base.yml); None = base.yml's; `expert_kernel_layout` likewise for the routed experts. Raises
    ConversionError / HFCheckpointError / pyconfig.ConfigError naming the problem; nothing is left at `output_dir` on
    failure.
    """
    output_dir = os.path.abspath(output_dir)
    if os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
        raise ConversionError(f"output directory {output_dir} already exists and is not empty")
    hf_config = read_hf_config(hf_path)
    dtype = dtype or default_dtype(hf_config)
    if dtype not in ("bfloat16", "float32"):
        raise ConversionError(f"dtype {dtype!r}; expected 'bfloat16' or 'float32'")
    keys = {**hf_weights.config_from_hf(hf_config), "weight_dtype": dtype, "dtype": dtype,
            "load_parameters_path": output_dir}
    for key, layout in (("dense_kernel_layout", dense_kernel_layout), ("expert_kernel_layout", expert_kernel_layout)):
        if layout is not None:
            keys[key] = layout
    shards = read_all_headers(hf_path)
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.partial-", dir=parent)
    try:
        config = pyconfig.load_config(checkpointing.write_config(work, keys))  # validates the keys
        hf_weights.check_tensor_shapes({e.name: e.shape for entries in shards.values() for e in entries}, config)
        staging = os.path.join(work, STAGING_SUBDIR)
        os.makedirs(staging)
        staged = {path: checkpointing.StagedArray.create(os.path.join(staging, ".".join(path)),
                                                         shape, checkpointing.leaf_dtype(path, dtype))
                  for path, shape in hf_weights.param_shapes(config).items()}
        _stage_shards(shards, staged, hf_weights.hf_tensor_specs(config), progress)
        total = sum(s.nbytes for s in staged.values())
        with tqdm(total=total, unit="B", unit_scale=True, desc="writing Orbax", disable=not progress) as bar:
            checkpointing.save_params(work, hf_weights.nest(staged), config, extra_config=keys,
                                      on_chunk=bar.update)
        shutil.rmtree(staging)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(hf_path, name)):
                shutil.copy2(os.path.join(hf_path, name), os.path.join(work, name))
        if os.path.isdir(output_dir):
            os.rmdir(output_dir)  # empty (checked above); rename needs the name free
        os.rename(work, output_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return output_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m MaxText.convert_hf_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--hf-path", required=True, help="directory with config.json and *.safetensors")
    parser.add_argument("--output-dir", required=True, help="new directory for config.yml + the Orbax checkpoint")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="dtype of the stored weights (default: the checkpoint's own, float32 unless bfloat16)")
    parser.add_argument("--dense-kernel-layout", choices=("in_out", "out_in"), default=None,
                        help="how the dense projections' kernels are stored (default: configs/base.yml's)")
    parser.add_argument("--expert-kernel-layout", choices=("in_out", "out_in"), default=None,
                        help="how the routed experts' matrices are stored (default: configs/base.yml's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        out = convert(args.hf_path, args.output_dir, args.dtype, progress=not args.no_progress,
                      dense_kernel_layout=args.dense_kernel_layout, expert_kernel_layout=args.expert_kernel_layout)
    except (ConversionError, hf_weights.HFCheckpointError, pyconfig.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} (config: {os.path.join(out, checkpointing.CONFIG_FILE)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
