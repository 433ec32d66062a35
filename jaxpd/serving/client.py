"""`python -m jaxpd.client "prompt"`: stream one generation from a jaxpd server.

Text goes to stdout as it arrives; the finish reason and the request's TTFT/TPOT go to
stderr at the end, so `> file` keeps only the completion. Models without a tokenizer
take `--token_ids 1,2,3` instead of a prompt (their output is printed as ids).
"""
from __future__ import annotations

import sys
from typing import Iterator, TextIO

import grpc
from absl import app, flags

from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Define the client's flags on `fv` (the global FLAGS when run as a program)."""
    flags.DEFINE_string("target", "127.0.0.1:50051", "host:port of the server.", flag_values=fv)
    flags.DEFINE_string("tls_ca", None, "PEM CA of a server started with --public_tls_cert: "
                        "connect over TLS.", flag_values=fv)
    flags.DEFINE_integer("max_tokens", 32, "Tokens to generate at most.", flag_values=fv)
    flags.DEFINE_float("temperature", None, "0 = greedy (default: the server's, 1.0).",
                       flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens; 0 = off.",
                         flag_values=fv)
    flags.DEFINE_float("top_p", None, "Nucleus sampling in (0, 1] (default: 1.0, off).",
                       flag_values=fv)
    flags.DEFINE_integer("seed", None, "Seed for reproducible sampling (default: random).",
                         flag_values=fv)
    flags.DEFINE_boolean("ignore_eos", False, "Keep generating past end-of-sequence.",
                         flag_values=fv)
    flags.DEFINE_list("token_ids", None, "Comma-separated prompt token ids instead of text.",
                      flag_values=fv)
    flags.DEFINE_float("timeout_s", None, "Deadline of the call in seconds (default: none).",
                       flag_values=fv)


def build_request(prompt: str | None, fv: flags.FlagValues) -> jaxpd_pb2.GenerateRequest:
    """A GenerateRequest from a prompt (or --token_ids) and the sampling flags."""
    msg = jaxpd_pb2.GenerateRequest(max_tokens=fv.max_tokens, top_k=fv.top_k,
                                    ignore_eos=fv.ignore_eos)
    if fv.token_ids:
        msg.token_ids.ids.extend(int(t) for t in fv.token_ids)
    elif prompt is not None:
        msg.prompt = prompt
    for name in ("temperature", "top_p", "seed"):
        if getattr(fv, name) is not None:
            setattr(msg, name, getattr(fv, name))
    return msg


def stream(stub: jaxpd_pb2_grpc.GenerationStub, request: jaxpd_pb2.GenerateRequest,
           timeout_s: float | None = None) -> Iterator[jaxpd_pb2.GenerateResponse]:
    """The server's responses; the call is cancelled if the caller stops early."""
    call = stub.Generate(request, timeout=timeout_s)
    try:
        yield from call
    finally:
        call.cancel()


def print_stream(responses: Iterator[jaxpd_pb2.GenerateResponse], out: TextIO,
                 err: TextIO) -> jaxpd_pb2.GenerateResponse | None:
    """Write text (or ids, for a model without tokenizer) as it comes; the summary to
    `err`. Returns the last response."""
    last = None
    for last in responses:
        if last.text:
            out.write(last.text)
        elif last.token_ids:
            out.write(" ".join(map(str, last.token_ids)) + " ")
        out.flush()
    out.write("\n")
    if last is not None and last.HasField("finish_reason"):
        m = last.metrics
        parts = [f"finish_reason={last.finish_reason}"]
        if m.HasField("abort_reason"):
            parts.append(f"abort_reason={m.abort_reason!r}")
        if m.HasField("ttft_s"):
            parts.append(f"TTFT={m.ttft_s * 1e3:.1f}ms")
        if m.HasField("tpot_s"):
            parts.append(f"TPOT={m.tpot_s * 1e3:.1f}ms")
        err.write(" ".join(parts) + "\n")
    return last


def run(prompt: str | None, fv: flags.FlagValues, out: TextIO = sys.stdout,
        err: TextIO = sys.stderr) -> int:
    """One streamed generation; returns the exit status (1 on an RPC error)."""
    channel = (grpc.secure_channel(fv.target, grpc.ssl_channel_credentials(
        open(fv.tls_ca, "rb").read())) if fv.tls_ca else grpc.insecure_channel(fv.target))
    with channel:
        stub = jaxpd_pb2_grpc.GenerationStub(channel)
        try:
            print_stream(stream(stub, build_request(prompt, fv), fv.timeout_s), out, err)
        except grpc.RpcError as e:
            err.write(f"\n{e.code().name}: {e.details()}\n")
            return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) > 2 or (len(argv) == 2) == bool(flags.FLAGS.token_ids):
        raise app.UsageError("give one prompt argument, or --token_ids instead")
    return run(argv[1] if len(argv) == 2 else None, flags.FLAGS)


if __name__ == "__main__":
    define_flags()
    app.run(main)
