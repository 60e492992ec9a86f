"""Command line: ``turboquant memory`` (more sub-commands arrive with their chapters)."""
from __future__ import annotations

import argparse
import sys

from . import memory


def _memory(args) -> int:
    geometry = memory.PRESETS[args.preset]
    side = {"none": 0, "norm": memory.NORM_SIDE_BITS,
            "affine": memory.affine_side_bits(geometry.head_dim, args.group_size)}[args.side]
    print(geometry.describe())
    print(f"{'context':>10} {'bits':>6} {'side bits':>9} {'KV MB':>12}")
    for t in args.context:
        for b in args.bits:
            nbytes = memory.kv_cache_bytes(geometry, t, b, side if b < 16 else 0, batch=args.batch)
            print(f"{t:>10,} {b:>6g} {side if b < 16 else 0:>9g} {nbytes / 1e6:>12,.1f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="turboquant", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("memory", help="KV-cache bytes for a model preset (Chapter 1's formula)")
    m.add_argument("--preset", choices=sorted(memory.PRESETS), default="llama-3.1-8b")
    m.add_argument("--context", type=int, nargs="+", default=[4096, 32768, 131072])
    m.add_argument("--bits", type=float, nargs="+", default=[16, 8, 4, 3, 2])
    m.add_argument("--side", choices=["none", "norm", "affine"], default="norm",
                   help="side information per vector for bits < 16 (default: one fp16 norm)")
    m.add_argument("--group-size", type=int, default=64, help="affine group size for --side affine")
    m.add_argument("--batch", type=int, default=1)
    m.set_defaults(run=_memory)
    args = p.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
