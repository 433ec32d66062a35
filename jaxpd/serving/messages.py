"""Between the public service's proto messages and jaxpd's own objects: a request's
sampling options in (checked, naming the field), log-probabilities and metrics out."""
from __future__ import annotations

from jaxpd.outputs import RequestMetrics
from jaxpd.request import Request
from jaxpd.sampling_params import MAX_STOP_STRINGS, SamplingParams
from jaxpd.serving.proto import jaxpd_pb2
from jaxpd.validation import MAX_STOP_TOKEN_IDS

_DEFAULTS = SamplingParams()
_INT32_MAX = 2**31 - 1   # the engine keeps top_k in an int32 array


def sampling_params(msg: jaxpd_pb2.GenerateRequest) -> SamplingParams:
    """The request's sampling options; unset optional fields take SamplingParams' defaults.
    Raises ValueError naming the field."""
    if not 0 <= msg.top_k <= _INT32_MAX:
        raise ValueError(f"top_k must be an integer in [0, 2**31) (0 = off), got {msg.top_k}")
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(msg.stop_token_ids)} ids, more than "
                         f"{MAX_STOP_TOKEN_IDS}")
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(msg.stop)} strings, more than {MAX_STOP_STRINGS}")
    opt = lambda name: getattr(msg, name) if msg.HasField(name) else getattr(_DEFAULTS, name)
    return SamplingParams(max_tokens=opt("max_tokens"), temperature=opt("temperature"),
                          top_k=msg.top_k, top_p=opt("top_p"), seed=opt("seed"),
                          stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
                          stop=tuple(msg.stop), repetition_penalty=opt("repetition_penalty"),
                          presence_penalty=msg.presence_penalty,
                          frequency_penalty=msg.frequency_penalty, min_p=msg.min_p,
                          logprobs=opt("logprobs"), n=opt("n"))


def logprobs_message(logprobs: list | None) -> list[jaxpd_pb2.TokenLogprobs]:
    return [jaxpd_pb2.TokenLogprobs(logprob=lp, top=[jaxpd_pb2.Logprob(token_id=t, logprob=v)
                                                     for t, v in top])
            for lp, top in logprobs or ()]


def metrics_message(r: Request) -> jaxpd_pb2.RequestMetrics:
    m = RequestMetrics.of(r)
    return jaxpd_pb2.RequestMetrics(
        ttft_s=m.ttft_s, tpot_s=m.tpot_s, queue_s=m.queue_s, prefill_s=m.prefill_s,
        transfer_s=m.transfer_s, transfer_bytes=m.transfer_bytes, e2e_s=m.e2e_s,
        num_preemptions=m.num_preemptions, abort_reason=r.abort_reason)
