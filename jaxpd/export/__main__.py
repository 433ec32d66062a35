"""`python -m jaxpd.export --platform tpu|cuda|cpu [--mesh SPEC] [--model DIR|NAME]
[--dtype float32|bfloat16] [--attention_impl IMPL] [--max_model_len N] [--match REGEX]
--out DIR`: lower every serving program for the platform (or those `--match` names:
`jaxpd.export.export_programs`) and print one line per program. Exit 2 on a bad flag, 1 when a program fails to lower."""
from __future__ import annotations

import argparse
import sys

from jaxpd.export import DTYPES, PLATFORMS, check_options, export_programs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxpd.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", required=True, choices=PLATFORMS)
    p.add_argument("--mesh", default="prefill=4,decode=4",
                   help="the launcher's mesh spec, e.g. prefill=4,decode=4 or prefill=2,decode=2x2")
    p.add_argument("--model", default=None,
                   help="checkpoint directory or registered name (default: the built-in model)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="default: the platform's (bfloat16 on tpu and cuda, float32 on cpu)")
    p.add_argument("--attention_impl", default="auto",
                   choices=("auto", "reference", "native", "pallas_gpu", "pallas_tpu"),
                   help="decode attention core (default: what auto picks on the platform)")
    p.add_argument("--max_model_len", type=int, default=None,
                   help="prompt + output tokens per request (default: the model's context); "
                        "sets the buckets and context widths")
    p.add_argument("--match", default=None,
                   help="only the programs whose name this regular expression finds")
    p.add_argument("--out", required=True, help="directory for the .jax_export files")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_options(args.platform, args.mesh, args.dtype)
    except ValueError as e:
        print(f"python -m jaxpd.export: error: {e}", file=sys.stderr)
        return 2
    try:
        summary = export_programs(args.platform, args.mesh, args.model, args.dtype,
                                  args.attention_impl, args.max_model_len, args.out,
                                  progress=lambda msg: print(msg, file=sys.stderr, flush=True),
                                  match=args.match)
    except ValueError as e:
        print(f"python -m jaxpd.export: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"python -m jaxpd.export: {e}", file=sys.stderr)
        return 1
    print(f"{len(summary['programs'])} programs for {summary['platform']} on {summary['mesh']} "
          f"({summary['dtype']}, attention {summary['attention_impl']}) in "
          f"{summary['seconds']:.1f} s -> {args.out}")
    for p in summary["programs"]:
        print(f"  {p['name']:<40} {p['kernel']:<11} {p['bytes']:>10,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
