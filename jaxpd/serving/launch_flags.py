"""The flags of `python -m jaxpd.launch` that are not `EngineConfig`'s (those are
generated from its fields: `config_flags`), written here once: serving, roles, the
router, auth; and what is derived from them: the internal plane's credentials, the
engine options, the checks of flag combinations. CPU devices and pinning:
`jaxpd.sharding.cpu_devices`. Plain Python (absl flags): importing this loads no jax."""
from __future__ import annotations

import sys

from absl import flags

from jaxpd import kv_budget
from jaxpd.parsing import REASONING_PARSERS, TOOL_CALL_PARSERS
from jaxpd.serving.config_flags import config_options, define_config_flags


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Define the launcher's flags on `fv` (the global FLAGS when run as a program)."""
    _define_serving_flags(fv)
    define_config_flags(fv)
    _define_engine_flags(fv)
    _define_role_flags(fv)
    _define_auth_flags(fv)


def _define_serving_flags(fv: flags.FlagValues) -> None:
    """What to serve, where, and how the process starts and stops."""
    flags.DEFINE_string("model", None, "Hugging Face checkpoint directory of a Llama-family "
                        "model (default: the built-in model, jaxpd.default_model_dir()).",
                        flag_values=fv)
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (gRPC and /metrics).",
                        flag_values=fv)
    flags.DEFINE_integer("port", 50051, "gRPC port; 0 picks a free one and prints it.",
                         lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("metrics_port", 0, "Port of the Prometheus /metrics endpoint; 0 = off.",
                         lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("http_port", 8000, "Port of the OpenAI-compatible HTTP API (with "
                         "/health and /metrics) on --host, for the single-process server and "
                         "the router; 0 picks a free one and prints it, -1 = off. Prefill and "
                         "decode roles serve /health and /metrics there only when it is given "
                         "(several roles share a host).",
                         lower_bound=-1, flag_values=fv)
    flags.DEFINE_boolean("warmup", True, "Compile every bucket before serving.", flag_values=fv)
    flags.DEFINE_float("shutdown_timeout_s", 5.0, "On SIGTERM/SIGINT: health NOT_SERVING "
                       "and new requests refused at once; in-flight ones may still run this "
                       "long, then they are aborted (reason 'shutdown'; a role's streams are "
                       "cut, so its router fails them over) and the process exits 0, "
                       "abandoning any compile in progress. During start-up it stops at the "
                       "next step.", lower_bound=0, flag_values=fv)
    flags.DEFINE_alias("shutdown_grace_s", "shutdown_timeout_s", flag_values=fv)
    flags.DEFINE_string("cpus", None, "Run on these CPUs only, e.g. '0' or '1-3' (process "
                        "affinity, set before jax starts, so XLA:CPU's threads use them alone): "
                        "pin a prefill and a decode role to disjoint core sets. Default: all.",
                        flag_values=fv)
    flags.DEFINE_string("public_tls_cert", None, "PEM certificate chain: serve the public gRPC "
                        "and HTTP ports over TLS (with --public_tls_key).", flag_values=fv)
    flags.DEFINE_string("public_tls_key", None, "PEM private key of --public_tls_cert.",
                        flag_values=fv)
    flags.DEFINE_string("public_tls_client_ca", None, "PEM CA: public clients must present a "
                        "certificate it signed (mutual TLS on the public ports).",
                        flag_values=fv)
    flags.DEFINE_integer("max_concurrent_rpcs", 4096, "Concurrent Generate/Complete calls "
                         "before more get RESOURCE_EXHAUSTED (a call holds no thread: what "
                         "the engine cannot run yet waits in its queue, --max_queued).",
                         lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("max_prompt_bytes", 0, "Longest prompt or Tokenize text in UTF-8 "
                         "bytes, refused before tokenizing; 0 = 32 bytes per token of "
                         "max_prompt_len, at least 64 KiB.", lower_bound=0, flag_values=fv)
    flags.DEFINE_enum("tool_call_parser", "auto", list(TOOL_CALL_PARSERS),
                      "How the HTTP chat API finds tool calls in the output: hermes "
                      "(Qwen2.5/Qwen3 <tool_call>), llama3_json, mistral ([TOOL_CALLS]), "
                      "json (any call-shaped JSON object), none; auto chooses from the "
                      "chat template. A request may name another (tool_call_parser).",
                      flag_values=fv)
    flags.DEFINE_enum("reasoning_parser", "auto", list(REASONING_PARSERS),
                      "How the HTTP chat API splits thinking into reasoning_content: qwen3 "
                      "(<think>...</think>), none; auto: qwen3 when the chat template has "
                      "<think>.", flag_values=fv)
    flags.DEFINE_string("once", None, "Instead of serving, generate greedily for this prompt, "
                        "print the completion and exit (default: unset, serve).", flag_values=fv)
    flags.DEFINE_integer("once_max_tokens", 32, "Tokens to generate with --once.",
                         lower_bound=1, flag_values=fv)


def _define_engine_flags(fv: flags.FlagValues) -> None:
    """Engine options beside `EngineConfig`'s fields (whose flags `config_flags`
    generates): the KV budget, the compile cache, admission SLOs, the elastic split."""
    flags.DEFINE(_SizeParser(), "kv_cache_memory", None,
                 "KV each pool may hold (each decode dp shard's and the prefill mesh's): "
                 "bytes, or a size such as 4GiB, 512MiB or 2GB. Default: on CPU "
                 f"{kv_budget.CPU_KV_FRACTION:.0%} of the host's available memory split "
                 "over the pools, at most 2 GiB each; half a device's memory on "
                 "accelerators. Sets the pages per shard.", flag_values=fv)
    flags.DEFINE(_SizeParser(unit="GB"), "kv_cache_gb", None,
                 "Deprecated spelling of --kv_cache_memory in GB (a bare number is GB).",
                 flag_values=fv)
    flags.register_multi_flags_validator(
        ["kv_cache_memory", "kv_cache_gb"],
        lambda given: given["kv_cache_memory"] is None or given["kv_cache_gb"] is None,
        "give --kv_cache_memory or --kv_cache_gb, not both", flag_values=fv)
    flags.DEFINE_float("slo_ttft_ms", 0.0, "Reject (RESOURCE_EXHAUSTED) a request whose "
                       "predicted TTFT exceeds this; 0 = off.", lower_bound=0, flag_values=fv)
    flags.DEFINE_float("slo_tpot_ms", 0.0, "With --elastic: the time-per-output-token SLO "
                       "the split controller holds decode to.", lower_bound=0, flag_values=fv)
    flags.DEFINE_bool("elastic", False, "With --mesh elastic=N: move devices between the "
                      "prefill and decode meshes while serving, as the split controller "
                      "decides from TTFT and TPOT against --slo_ttft_ms / --slo_tpot_ms and "
                      "decode occupancy; with --role router: switch one worker's role at a "
                      "time (never a role's last). Off by default until the shift bench says "
                      "it wins.", flag_values=fv)
    flags.DEFINE_float("elastic_interval_s", 5.0, "With --elastic: seconds between "
                       "observations.", lower_bound=0.01, flag_values=fv)
    flags.DEFINE_float("elastic_sustain_s", 30.0, "With --elastic: how long a move must be "
                       "wanted before it is made.", lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("elastic_step", 1, "With --elastic: devices one move takes from a "
                         "role (a router moves one worker).", lower_bound=1, flag_values=fv)
    flags.DEFINE_float("elastic_dwell_s", 120.0, "With --elastic: the least time between two "
                       "moves.", lower_bound=0, flag_values=fv)
    flags.DEFINE_float("elastic_efficiency", 1.0, "With --elastic: the latency model's "
                       "starting scaling, time per unit of work ~ (devices now / after) ** "
                       "this, in [0, 1] (1: ideal); each move then measures it.",
                       lower_bound=0, upper_bound=1, flag_values=fv)
    flags.DEFINE_string("compilation_cache_dir", None, "Keep compiled programs here and "
                        "load them on the next start ('none': off). Default: "
                        "$JAX_COMPILATION_CACHE_DIR, else $JAXPD_CACHE/compiled (jaxpd.paths).",
                        flag_values=fv)


class _SizeParser(flags.ArgumentParser):
    """A KV budget's flag: the value `kv_budget.parse_kv_cache_memory` gives `LLM`'s
    `kv_cache_memory`, refused with its message; `unit` is a bare number's."""

    syntactic_help = "bytes, or a size such as 4GiB, 512MiB or 2GB"

    def __init__(self, unit: str = ""):
        self.unit = unit

    def parse(self, argument) -> int:
        text = str(argument).strip()
        if self.unit and text.replace(".", "", 1).isdigit():
            text += self.unit
        return kv_budget.parse_kv_cache_memory(text)

    def flag_type(self) -> str:
        return "size"


def _define_role_flags(fv: flags.FlagValues) -> None:
    """Multi-process deployments: roles, the router, the KV transport, liveness."""
    flags.DEFINE_enum("role", "", ["", "prefill", "decode", "router"],
                      "Multi-process deployments: run one role (its --mesh is then prefill=P or "
                      "decode=D[xT]; the router needs none). Empty: both phases in this "
                      "process.", flag_values=fv)
    flags.DEFINE_string("router", None, "prefill/decode roles: host:port of the router's "
                        "internal port (its --internal_port, not its public --port) to "
                        "register with (retried with backoff until it answers).", flag_values=fv)
    flags.DEFINE_integer("internal_port", 0, "router role: port of the internal plane "
                         "(workers register and heartbeat there; authenticated); 0 picks a "
                         "free one and prints it.", lower_bound=0, flag_values=fv)
    flags.DEFINE_list("prefill_workers", [], "router role: host:port of prefill workers "
                      "(workers may also register themselves).", flag_values=fv)
    flags.DEFINE_list("decode_workers", [], "router role: host:port of decode workers.",
                      flag_values=fv)
    flags.DEFINE_enum("kv_transport", "transfer_server", ["transfer_server", "grpc"],
                      "prefill/decode roles: how KV pages cross processes (the JAX transfer "
                      "server, or a gRPC byte stream where it is unavailable).", flag_values=fv)
    flags.DEFINE_enum("kv_offers", "shards", ["shards", "gather"], "prefill role whose mesh "
                      "spans processes, transfer server: each process offers its own kv-head "
                      "shards (the decode side pulls each from its owner), or the leader "
                      "gathers them all and offers the whole KV (give every process the same "
                      "value).", flag_values=fv)
    flags.DEFINE_list("kv_offer_hosts", [], "decode role, transfer server: hosts (other than "
                      "the prefill leader's) its KV may also be pulled from -- the other hosts "
                      "of a prefill mesh spanning hosts, each offering its own shards.",
                      flag_values=fv)
    flags.DEFINE_float("heartbeat_s", 1.0, "Workers heartbeat the router this often (the "
                       "router probes --prefill_workers/--decode_workers as often).",
                       lower_bound=0.01, flag_values=fv)
    flags.DEFINE_float("lease_s", None, "router role: drop a worker whose last heartbeat is "
                       "older than this, failing its requests over (default: 5 x "
                       "--heartbeat_s).", lower_bound=0.01, flag_values=fv)
    flags.DEFINE_float("stall_timeout_s", 5.0, "router role: a decode stream that sends "
                       "nothing (workers send a keepalive each second) for this long is a "
                       "lost worker: its request fails over.", lower_bound=0.01, flag_values=fv)
    flags.DEFINE_integer("num_processes", 1, "prefill or decode role: processes (one per "
                         "host) that form its --mesh together (jax.distributed); process 0 "
                         "leads, the others replay its programs.", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_integer("process_id", 0, "This process's place among --num_processes.",
                         lower_bound=0, flag_values=fv)
    flags.DEFINE_string("coordinator", None, "With --num_processes > 1: host:port of the "
                        "jax.distributed coordinator, which process 0 runs and listens on.",
                        flag_values=fv)
    flags.DEFINE_float("follower_timeout_s", 5.0, "The leader of a multi-process role stops "
                       "the role when a follower has not answered for this long.",
                       lower_bound=0.5, flag_values=fv)


def _define_auth_flags(fv: flags.FlagValues) -> None:
    """Authentication of the internal plane (roles, the router's internal port, KV)."""
    flags.DEFINE_string("cluster_token", None, "Shared secret every internal call carries "
                        "(shows in `ps`: prefer --cluster_token_file or the "
                        "JAXPD_CLUSTER_TOKEN environment variable).", flag_values=fv)
    flags.DEFINE_string("cluster_token_file", None, "File holding the cluster token.",
                        flag_values=fv)
    flags.DEFINE_string("tls_cert", None, "mTLS: this process's certificate chain (PEM).",
                        flag_values=fv)
    flags.DEFINE_string("tls_key", None, "mTLS: this process's private key (PEM).",
                        flag_values=fv)
    flags.DEFINE_string("tls_ca", None, "mTLS: the CA that signs every peer's certificate "
                        "(PEM).", flag_values=fv)
    flags.DEFINE_string("tls_server_name", None, "mTLS: the name peers' certificates are "
                        "checked against when it is not the host dialled.", flag_values=fv)
    flags.DEFINE_boolean("insecure_internal", False, "Allow an internal plane without "
                         "authentication on a non-loopback --host (anyone who reaches it can "
                         "drive the process; not recommended).", flag_values=fv)


def internal_auth(fv: flags.FlagValues):
    """One `InternalAuth` from the auth flags (and JAXPD_CLUSTER_TOKEN). Raises
    ValueError (AuthConfigError) or OSError (an unreadable file)."""
    from jaxpd.auth import InternalAuth   # plain Python (grpc): the router may import it

    return InternalAuth.from_options(
        cluster_token=fv.cluster_token, cluster_token_file=fv.cluster_token_file,
        tls_cert=fv.tls_cert, tls_key=fv.tls_key, tls_ca=fv.tls_ca,
        tls_server_name=fv.tls_server_name, insecure=fv.insecure_internal)


def role_auth(fv: flags.FlagValues, what: str):
    """The internal auth of a role, checked against its --host; None (after printing
    why) when the flags are wrong or the plane would be open."""
    try:
        auth = internal_auth(fv)
        auth.check_bind(fv.host, what)
    except (ValueError, OSError) as e:
        print(f"cannot start {what}: {e}", file=sys.stderr)
        return None
    return auth


def elastic_error(fv: flags.FlagValues) -> str | None:
    """Why `--elastic` cannot run with these flags, or None."""
    from jaxpd.sharding.spec import parse_mesh_spec
    if not fv.elastic:
        return None
    try:
        elastic = parse_mesh_spec(fv.mesh).elastic
    except ValueError:
        elastic = 0                          # the mesh's own check says what is wrong
    if fv.role == "router":
        if fv.elastic_step != 1:
            return "--elastic on a router moves one worker at a time: --elastic_step must be 1"
    elif not elastic or fv.role or fv.once is not None:
        return (f"--elastic needs --mesh elastic=N and a serving process without --role "
                f"or --once, or --role router (got --mesh {fv.mesh}"
                + (f", --role {fv.role})" if fv.role else ")"))
    if not (fv.slo_ttft_ms > 0 and fv.slo_tpot_ms > 0):
        return "--elastic needs --slo_ttft_ms and --slo_tpot_ms (the SLOs it holds each role to)"
    return None


def multihost_error(fv: flags.FlagValues) -> str | None:
    """What is wrong with the --num_processes / --process_id / --coordinator flags, or
    None. Beyond loopback the coordinator needs the cluster token: the leader signs
    the plans it sends its followers with it."""
    from jaxpd.auth import is_loopback
    from jaxpd.sharding.spec import parse_mesh_spec

    if fv.num_processes == 1:
        return "--process_id needs --num_processes > 1" if fv.process_id else None
    if fv.role not in ("prefill", "decode"):
        return ("--num_processes > 1: only a prefill or decode role spans processes "
                "(--role prefill or --role decode)")
    if fv.process_id >= fv.num_processes:
        return f"--process_id must be below --num_processes ({fv.num_processes})"
    if fv.enable_prefix_caching:
        return (f"--enable_prefix_caching is not supported yet on a {fv.role} role across "
                f"processes (--num_processes > 1)")
    example = "prefill=P" if fv.role == "prefill" else "decode=D or decode=DxT"
    if fv.mesh == "auto":
        return f"--num_processes > 1 needs an explicit --mesh {example} (devices in all)"
    host, _, port = (fv.coordinator or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--coordinator must be host:port, got {fv.coordinator!r}"
    try:
        spec = parse_mesh_spec(fv.mesh)
    except ValueError as e:
        return f"--mesh: {e}"
    if (spec.has_prefill, spec.has_decode) != (fv.role == "prefill", fv.role == "decode"):
        return (f"--mesh {fv.mesh}: a {fv.role} role across processes has one mesh, "
                f"--mesh {example} (no elastic, colocated or second mesh)")
    num = spec.num_devices
    if num % fv.num_processes:
        return (f"--mesh {fv.mesh} has {num} devices, which {fv.num_processes} processes "
                f"cannot share equally")
    try:
        token = internal_auth(fv).token
    except (ValueError, OSError) as e:
        return str(e)
    if not is_loopback(host.strip("[]")) and token is None:
        return (f"--coordinator {fv.coordinator} is beyond loopback: give the cluster token "
                f"(JAXPD_CLUSTER_TOKEN or --cluster_token_file), which signs the plans the "
                f"leader sends its followers")
    return None


def engine_options(fv: flags.FlagValues) -> dict:
    """`LLM` keyword arguments from the flags: `EngineConfig`'s (`config_flags`) and the
    KV budget (unset ones keep the LLM's defaults)."""
    options = config_options(fv, processes=fv.num_processes)
    budget = fv.kv_cache_memory if fv.kv_cache_memory is not None else fv.kv_cache_gb
    if budget is not None:
        options["kv_cache_memory"] = budget
    return options
