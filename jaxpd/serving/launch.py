"""`python -m jaxpd.launch`: serve a model over gRPC (or, with --once, generate once).

Start-up order matters:
1. flags are parsed and, on CPU, XLA_FLAGS gets as many virtual devices as the mesh
   needs. jax reads XLA_FLAGS once, when its first backend initialises; nothing before
   this point imports jax (the `jaxpd` package exports lazily, the mesh spec is parsed
   by the plain-Python `jaxpd.sharding.spec`), and the engine is imported only after.
   The router role never imports jax or flax at all: it needs no accelerator;
2. the gRPC server (and the OpenAI-compatible HTTP API on --http_port) starts listening
   at once with health NOT_SERVING, so orchestrators can watch the (long) load and compile;
3. the model loads and every bucket compiles (progress printed), then health flips to
   SERVING and a final `jaxpd serving ...` line is printed;
4. SIGTERM or SIGINT: health NOT_SERVING, no new calls, in-flight ones get
   --shutdown_timeout_s to finish before they are aborted with reason "shutdown", the
   engine shuts down, exit 0. A signal during step 3 stops the start-up before its next
   step. A background compile in progress does not hold the exit: `main` ends the
   process with `os._exit` once everything else is shut down and the output flushed
   (an ordinary exit while XLA compiles on a thread dies in C++); so do the interpreter's
   own teardown costs. A process of a mesh spanning processes exits the ordinary way
   (jax.distributed shuts down at exit) and waits for its compiles.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from absl import app, flags

from jaxpd.serving.launch_flags import (role_auth, define_flags, engine_options,  # noqa: F401
                                        elastic_error, internal_auth, multihost_error)
from jaxpd.sharding.cpu_devices import (parse_cpus, pin_cpus,  # noqa: F401
                                        say_if_oversubscribed, set_cpu_device_count)
from jaxpd.sharding.spec import AUTO, auto_mesh


class _Interrupted(Exception):
    """A stop signal arrived while the model was still loading or compiling."""


def _say(message: str) -> None:
    print(message, flush=True)


def _progress_until(stop: threading.Event):
    """`_say`, as a start-up's progress callback that stops it (raising `_Interrupted`)
    between two steps once `stop` is set."""
    def progress(message: str) -> None:
        if stop.is_set():
            raise _Interrupted
        _say(message)
    return progress


def run(fv: flags.FlagValues) -> int:
    """Serve (or generate once) as the flags say; returns the exit status."""
    if fv.role == "router":
        return _run_router(fv)
    try:
        pin_cpus(fv.cpus)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    error = multihost_error(fv) or elastic_error(fv)
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    try:
        count = set_cpu_device_count(fv.mesh, processes=fv.num_processes)
    except ValueError as e:
        print(f"--mesh: {e}", file=sys.stderr)
        return 2
    if count is not None:
        say_if_oversubscribed(count)
    group = None
    if fv.num_processes > 1:                 # before any jax backend comes up
        from jaxpd.engine.multihost.plan_channel import ProcessGroup, initialize
        group = ProcessGroup(fv.num_processes, fv.process_id, fv.coordinator)
        initialize(group)
    from jaxpd import xla_cache
    from jaxpd.llm import LLM   # after XLA_FLAGS: this is what brings the backend up
    if fv.mesh == AUTO and fv.role != "router":
        import jax
        fv.mesh = auto_mesh(jax.devices()[0].platform, jax.device_count(), fv.role or None)

    try:
        xla_cache.enable(fv.compilation_cache_dir or xla_cache.default_dir())
    except (OSError, ValueError) as e:
        print(f"--compilation_cache_dir: {e}", file=sys.stderr)
        return 2

    if fv.once is not None:
        return _run_once(fv, LLM)
    stop = _stop_on_signals()
    if fv.role in ("prefill", "decode"):
        return _run_role(fv, stop, group)
    return _serve(fv, stop, LLM)


def _run_role(fv: flags.FlagValues, stop: threading.Event, group=None) -> int:
    """A prefill or decode role of a multi-process deployment (`group`: this process's
    place in a role spanning processes): 2 for bad auth flags or an open plane, 1 when
    it cannot start or the router refuses it."""
    auth = role_auth(fv, f"the {fv.role} worker")
    if auth is None:
        return 2
    from jaxpd.serving.worker import serve_role
    from jaxpd.transfer.transfer_server import TransferServerUnavailable
    options = dict(engine_options(fv), warmup=fv.warmup)
    try:
        return serve_role(fv.role, fv.model, fv.host, fv.port, fv.router, fv.kv_transport,
                          stop, _say, options, auth=auth, heartbeat_s=fv.heartbeat_s,
                          http_port=fv.http_port if fv["http_port"].present else -1,
                          group=group, follower_timeout_s=fv.follower_timeout_s,
                          kv_offer_hosts=tuple(fv.kv_offer_hosts), kv_offers=fv.kv_offers,
                          shutdown_timeout_s=fv.shutdown_timeout_s,
                          wait_for_compiles=not _ends_with_os_exit(fv))
    except (OSError, ValueError, TransferServerUnavailable) as e:
        print(f"cannot start the {fv.role} worker: {e}", file=sys.stderr)
        return 1


def _public_tls(fv: flags.FlagValues):
    """(grpc server credentials, uvicorn ssl options) from the --public_tls_* flags, or
    (None, {}). ValueError naming the flag; OSError for an unreadable file."""
    if not fv.public_tls_cert and not fv.public_tls_key:
        if fv.public_tls_client_ca:
            raise ValueError("--public_tls_client_ca needs --public_tls_cert and --public_tls_key")
        return None, {}
    if not (fv.public_tls_cert and fv.public_tls_key):
        raise ValueError("give both --public_tls_cert and --public_tls_key")
    import grpc
    read = lambda path: open(path, "rb").read()
    ca = read(fv.public_tls_client_ca) if fv.public_tls_client_ca else None
    creds = grpc.ssl_server_credentials(
        ((read(fv.public_tls_key), read(fv.public_tls_cert)),), root_certificates=ca,
        require_client_auth=ca is not None)
    ssl = {"ssl_certfile": fv.public_tls_cert, "ssl_keyfile": fv.public_tls_key}
    if ca is not None:
        import ssl as ssl_module
        ssl.update(ssl_ca_certs=fv.public_tls_client_ca, ssl_cert_reqs=ssl_module.CERT_REQUIRED)
    return creds, ssl


def _start_http(fv: flags.FlagValues, role: str, server):
    """The OpenAI-compatible HTTP server beside gRPC `server` (sharing its admission,
    histograms and stats), or None with --http_port -1. Raises OSError."""
    if fv.http_port < 0:
        return None
    from jaxpd.serving.http import HttpServer, OpenAIService

    names = (fv.model,) if fv.model and not os.path.exists(fv.model) else ()
    service = OpenAIService(role, names, server.servicer.admission, server.metrics,
                            server.servicer.stats, fv.max_queued,
                            2 * fv.max_prompt_bytes + 64 * 1024 if fv.max_prompt_bytes else None,
                            tool_call_parser=fv.tool_call_parser,
                            reasoning_parser=fv.reasoning_parser)
    return HttpServer(service, fv.host, fv.http_port, ssl=_public_tls(fv)[1])


def _say_http(fv: flags.FlagValues, http) -> None:
    if http is not None:
        scheme = "https" if fv.public_tls_cert else "http"
        _say(f"jaxpd HTTP (OpenAI API, /health, /metrics) on {scheme}://{fv.host}:{http.port}")


def _stop_servers(server, http, grace_s: float) -> None:
    """Drain gRPC and HTTP together: one grace period for both."""
    start = time.monotonic()
    if http is not None:
        http.service.draining = True
    server.stop(grace_s)
    if http is not None:
        http.stop(max(0.0, grace_s - (time.monotonic() - start)))


def _serve(fv: flags.FlagValues, stop: threading.Event, LLM) -> int:
    """Both phases in this process, behind the public gRPC service (and HTTP)."""
    from jaxpd.serving.server import InferenceServer

    try:
        tls = _public_tls(fv)[0]
    except (OSError, ValueError) as e:
        print(f"cannot start the server: {e}", file=sys.stderr)
        return 2
    server = InferenceServer(fv.host, fv.port, fv.slo_ttft_ms,
                             metrics_port=fv.metrics_port or None,
                             max_concurrent_rpcs=fv.max_concurrent_rpcs,
                             max_prompt_bytes=fv.max_prompt_bytes or None, tls=tls)
    llm = http = None
    try:
        try:
            http = _start_http(fv, "single", server)
        except OSError as e:
            print(f"cannot start the HTTP server: {e}", file=sys.stderr)
            return 1
        _say(f"jaxpd listening on {fv.host}:{server.port} (NOT_SERVING until the model is warm)")
        _say_http(fv, http)
        if server.metrics_port is not None:
            _say(f"jaxpd metrics on http://{fv.host}:{server.metrics_port}/metrics")
        _say(f"loading {fv.model or 'the built-in default model'} onto mesh {fv.mesh}")
        try:
            llm = LLM(fv.model, warmup=fv.warmup, progress=_progress_until(stop),
                      **engine_options(fv))
        except (OSError, ValueError) as e:   # missing/bad checkpoint, bad engine option
            print(f"cannot load the model: {e}", file=sys.stderr)
            return 1
        except _Interrupted:
            _say("jaxpd stopped while starting")
        if llm is not None and not stop.is_set():
            server.attach(llm)
            if http is not None:
                http.attach(llm)
            _say(f"jaxpd serving {llm.model_path} on {fv.host}:{server.port} "
                 f"(mesh {llm.config.mesh})")
            driver = _elastic_driver(fv, llm, server) if fv.elastic else None
            # A timed wait: the process's signal may land on any of its threads, and
            # Python runs the handler (which sets `stop`) only once the main thread
            # wakes; an untimed wait could sleep through it for good.
            while not stop.wait(0.2):
                pass
            if driver is not None:
                driver.stop()
        _say("jaxpd shutting down")
    finally:
        _stop_servers(server, http, fv.shutdown_timeout_s)
        if llm is not None:
            llm.shutdown(wait_for_compiles=False)   # `main` ends the process with os._exit
    left = [t.name for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon]
    if left:
        print(f"threads still running at exit: {left}", file=sys.stderr)
    return 0


def _elastic_driver(fv: flags.FlagValues, llm, server):
    """`--elastic`: the split controller, acting on this process's elastic mesh."""
    from jaxpd.plan.controller import Split, SplitController
    from jaxpd.plan.driver import ElasticDriver

    def split() -> Split:
        spec = llm.engine.config.mesh
        return Split(spec.prefill_tp, spec.decode_dp)

    controller = SplitController(split(), fv.slo_ttft_ms / 1000, fv.slo_tpot_ms / 1000,
                                 step=fv.elastic_step, sustain_s=fv.elastic_sustain_s,
                                 dwell_s=fv.elastic_dwell_s, efficiency=fv.elastic_efficiency)
    _say(f"jaxpd elastic: the split controller moves devices every >= {fv.elastic_dwell_s:g} s "
         f"(TTFT SLO {fv.slo_ttft_ms:g} ms, TPOT SLO {fv.slo_tpot_ms:g} ms)")
    return ElasticDriver(controller, server.render_metrics, llm.prepare_resplit, llm.resplit,
                         split, fv.elastic_interval_s, say=_say,
                         count=llm.engine.counters.add).start()


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _run_router(fv: flags.FlagValues) -> int:
    """The front door: Generation service over a `Router` on --port, workers' Register
    on the authenticated --internal_port; SERVING while `Router.ready()` holds."""
    from jaxpd.model_registry import resolve_model
    from jaxpd.models.source import model_config_and_tokenizer
    from jaxpd.serving.router import Router, RouterConfig
    from jaxpd.serving.server import InferenceServer

    auth = role_auth(fv, "the router's internal port")
    if auth is None:
        return 2
    stop = _stop_on_signals()
    try:
        model = resolve_model(fv.model)
        # The workers' default: the model's max_position_embeddings.
        max_model_len = fv.max_model_len or \
            model_config_and_tokenizer(model)[0].max_position_embeddings
        config = RouterConfig(max_model_len=max_model_len, max_queued=fv.max_queued,
                              dtype=fv.dtype, page_size=fv.page_size,
                              heartbeat_s=fv.heartbeat_s, lease_s=fv.lease_s,
                              stall_timeout_s=fv.stall_timeout_s,
                              prefix_routing=fv.enable_prefix_caching is not False,
                              prefix_extend_below=fv.prefix_extend_below)
        router = Router(model, config, tuple(fv.prefill_workers), tuple(fv.decode_workers),
                        auth=auth)
    except (OSError, ValueError) as e:
        print(f"cannot start the router: {e}", file=sys.stderr)
        return 1
    server = http = None
    try:
        internal_port = router.listen(fv.host, fv.internal_port)
        server = InferenceServer(fv.host, fv.port, fv.slo_ttft_ms,
                                 metrics_port=fv.metrics_port or None,
                                 max_concurrent_rpcs=fv.max_concurrent_rpcs,
                                 max_prompt_bytes=fv.max_prompt_bytes or None,
                                 tls=_public_tls(fv)[0])
        http = _start_http(fv, "router", server)
    except (OSError, ValueError) as e:
        print(f"cannot start the router: {e}", file=sys.stderr)
        if server is not None:
            server.stop(0)
        router.shutdown()
        return 1
    try:
        _say(f"jaxpd router internal plane on {fv.host}:{internal_port} "
             f"(auth: {auth.describe()})")
        _say(f"jaxpd router listening on {fv.host}:{server.port} (NOT_SERVING until a "
             f"decode worker is live)")
        _say_http(fv, http)
        known, serving, attached, driver = {}, False, False, None
        model, problems = "", []
        while not stop.is_set():             # health follows the live decode workers
            if (router.fingerprint, router.problems()) != (model, problems):
                model, problems = router.fingerprint, router.problems()
                _say(f"jaxpd router: new requests go to model {model[:12] or '(none)'}"
                     + "".join(f"; {p}" for p in problems))
            live = router.live_workers()
            for address in live.keys() - known.keys():
                _say(f"jaxpd router: {live[address]} worker {address} joined")
            for address in known.keys() - live.keys():
                _say(f"jaxpd router: {known[address]} worker {address} left")
            known = live
            if router.ready() != serving:
                serving = not serving
                if not attached:
                    server.attach(router)
                    if http is not None:
                        http.attach(router)
                    attached = True
                    _say(f"jaxpd serving {router.model_path} on {fv.host}:{server.port} "
                         f"(mesh router)")
                else:
                    server.set_serving(serving)
                    if http is not None:
                        http.set_serving(serving)
                    _say(f"jaxpd router {'SERVING' if serving else 'NOT_SERVING'}: "
                         + (f"model {router.fingerprint[:12]}" if serving else
                            "; ".join(router.problems())))
            if fv.elastic and driver is None:
                driver = _router_elastic_driver(fv, router, server)
            stop.wait(0.2)
        _say("jaxpd shutting down")
    finally:
        if driver is not None:
            driver.stop()
        _stop_servers(server, http, fv.shutdown_timeout_s)
        router.shutdown()
    return 0


def _router_elastic_driver(fv: flags.FlagValues, router, server):
    """`--role router --elastic`: the split controller switching workers' roles
    (`router_split`), once at least one worker of each role is live (None before)."""
    from jaxpd.plan.controller import SplitController
    from jaxpd.plan.driver import ElasticDriver
    from jaxpd.serving.router_split import RouterSplit

    actuator = RouterSplit(router, say=_say)
    split = actuator.split()
    if min(split.prefill, split.decode) < 1:
        return None
    controller = SplitController(split, fv.slo_ttft_ms / 1000, fv.slo_tpot_ms / 1000,
                                 sustain_s=fv.elastic_sustain_s, dwell_s=fv.elastic_dwell_s,
                                 efficiency=fv.elastic_efficiency)
    _say(f"jaxpd elastic: the split controller switches one worker's role at most every "
         f"{fv.elastic_dwell_s:g} s (workers now {split}; TTFT SLO {fv.slo_ttft_ms:g} ms, "
         f"TPOT SLO {fv.slo_tpot_ms:g} ms)")
    return ElasticDriver(controller, server.render_metrics, actuator.prepare, actuator.resplit,
                         actuator.split, fv.elastic_interval_s, say=_say,
                         count=router.counters.add).start()


def _run_once(fv: flags.FlagValues, llm_class) -> int:
    from jaxpd.sampling_params import SamplingParams

    with llm_class(fv.model, warmup=fv.warmup, progress=_say, **engine_options(fv)) as llm:
        if llm.tokenizer is None:
            print(f"--once needs a model with tokenizer.json; {llm.model_path} has none",
                  file=sys.stderr)
            return 2
        params = SamplingParams(max_tokens=fv.once_max_tokens, temperature=0.0)
        out = llm.generate([fv.once], params)[0]
        _say(out.text)
        m = out.metrics
        print(f"[{out.finish_reason}] {len(out.token_ids)} tokens, TTFT "
              f"{m.ttft_s * 1e3:.1f} ms" + (f", TPOT {m.tpot_s * 1e3:.1f} ms" if m.tpot_s else ""),
              file=sys.stderr)
    return 0


def _ends_with_os_exit(fv: flags.FlagValues) -> bool:
    """Whether `main` ends this process with `os._exit`: all but the processes of a mesh
    spanning processes, whose jax.distributed client shuts down at the ordinary exit."""
    return fv.num_processes == 1


def main(argv: list[str]) -> int:
    """Run the launcher; exit with its status, through `os._exit` where
    `_ends_with_os_exit` says so: a compile still running on a thread (abandoned by the
    shutdown) or the interpreter's teardown would otherwise hold the exit, or crash it."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    status = run(flags.FLAGS)
    if not _ends_with_os_exit(flags.FLAGS):
        return status
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    define_flags()
    app.run(main)
