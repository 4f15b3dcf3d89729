"""Prints every param's logical axes and mesh PartitionSpec for a config and mesh, largest params first.

    python end_to_end/print_param_sharding.py configs/kimi_linear.yml ici_tensor_parallelism=8 [--devices 8] [--all]

Uses `jax.eval_shape` only: nothing is allocated, so the 48B config prints on any machine, and no device mesh is
built (the mesh sizes come from the ici_* / dcn_* keys for `--devices` devices). Layers with the same param
path are collapsed into one row (`layers_{n}` with the count) unless `--all` is given. Params above 1M elements that
end up fully replicated are marked `REPLICATED`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from MaxText import pyconfig, sharding  # noqa: E402

LARGE = 1_000_000  # elements


def mesh_sizes(config, devices: int | None) -> dict[str, int]:
    ici = [config[f"ici_{a}_parallelism"] for a in sharding.MESH_AXES]
    dcn = [config[f"dcn_{a}_parallelism"] for a in sharding.MESH_AXES]
    if devices is None:
        devices = math.prod(s for s in ici + dcn if s > 0)
    processes = math.prod(s for s in dcn if s > 0)
    ici, dcn = sharding.mesh_axis_sizes(config, devices, processes)
    return {axis: i * d for axis, i, d in zip(sharding.MESH_AXES, ici, dcn)}


def shard_shape(shape, spec, sizes) -> tuple[int, ...]:
    out = []
    for dim, size in enumerate(shape):
        out.append(size // math.prod(sizes[a] for a in sharding.entry_axes(spec[dim] if dim < len(spec) else None)))
    return tuple(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--devices", type=int, default=None, help="device count (default: the mesh keys' product)")
    parser.add_argument("--all", action="store_true", help="one row per param (no collapsing of layers)")
    args = parser.parse_args(argv)
    config = pyconfig.load_config(args.config, args.overrides)
    sizes = mesh_sizes(config, args.devices)
    rows = sharding.param_spec_table(config, sizes)

    grouped: dict[tuple, list] = {}
    for path, shape, logical, spec, replicated in rows:
        key_path = path if args.all else re.sub(r"layers_\d+", "layers_{n}", path)
        grouped.setdefault((key_path, shape, logical, str(spec), replicated), []).append(spec)
    total = sum(math.prod(r[1]) for r in rows)
    print(f"config {args.config}; mesh {' x '.join(f'{a}={s}' for a, s in sizes.items())}; {len(rows)} params, "
          f"{total / 1e9:.2f}B elements")
    header = f"{'param':58} {'n':>3} {'shape':>20} {'logical axes':34} {'PartitionSpec':34} {'per-device shard':>18}"
    print(header)
    print("-" * len(header))
    for (path, shape, logical, spec_text, replicated), specs in grouped.items():
        mark = "  REPLICATED" if replicated and math.prod(shape) > LARGE else ""
        print(f"{path:58} {len(specs):>3} {str(list(shape)):>20} {str(logical):34} {spec_text:34} "
              f"{str(list(shard_shape(shape, specs[0], sizes))):>18}{mark}")
    large_replicated = [r[0] for r in rows if r[4] and math.prod(r[1]) > LARGE]
    print(f"params above {LARGE:,} elements fully replicated: {len(large_replicated)}"
          + (f" ({', '.join(large_replicated[:5])} ...)" if large_replicated else ""))
    return 1 if large_replicated else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
