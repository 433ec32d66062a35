"""The bench's llama.cpp baselines and host line, without llama.cpp: the batched
backend's scheduling is checked against a stand-in for `llama_decode` that records
every batch and answers each sequence's next token as (position + 1)."""
import types

from jaxpd.bench.args import backends_of, parse_compare
from jaxpd.bench.cli import parse_args
from jaxpd.bench.driver import BenchRequest
from jaxpd.bench.host import cpu_info, describe_host, has_avx512, host_line
from jaxpd.bench.llama_cpp import LlamaCppBatchedBackend

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16

processor\t: 1
model name\t: AMD EPYC 9B14
"""


def test_host_line_names_the_cpu_and_its_vector_extensions(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    model, flags = cpu_info(str(path))
    assert model == "AMD EPYC 9B14" and "avx512_bf16" in flags
    host = describe_host(str(path))
    assert host["isa"] == ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                           "avx512_vnni", "avx512_bf16"]
    assert has_avx512(host)
    line = host_line(host)
    assert line.startswith("host: AMD EPYC 9B14, ") and "avx512_vnni" in line
    assert describe_host(str(tmp_path / "missing"))["cpu_model"] != ""


def test_batched_llama_cpp_is_a_baseline_of_its_own():
    assert parse_compare("llama_cpp_batched,hf") == ["llama_cpp_batched", "hf"]
    args = parse_args(["--mesh", "colocated=1", "--compare", "llama_cpp_batched,llama_cpp"])
    assert backends_of(args) == ["colocated=1", "llama_cpp", "llama_cpp_batched"]


class _Recorder:
    """Stands in for llama.cpp: `step` records each batch's entries."""

    def __init__(self):
        self.batches, self.removed = [], []

    def step(self, entries):
        self.batches.append(list(entries))
        return [pos + 1 for _, pos, _, logits in entries if logits]


def _backend(n_seq: int, n_batch: int) -> tuple[LlamaCppBatchedBackend, _Recorder]:
    rec = _Recorder()
    backend = LlamaCppBatchedBackend.__new__(LlamaCppBatchedBackend)
    backend.n_seq, backend.n_batch, backend.n_threads = n_seq, n_batch, 1
    backend.memory = object()
    backend.lc = types.SimpleNamespace(
        llama_memory_seq_rm=lambda mem, seq, p0, p1: rec.removed.append((seq, p0, p1)))
    backend._step = rec.step
    return backend, rec


def test_batched_steps_hold_every_running_sequence_and_the_new_prompts(monkeypatch):
    import jaxpd.bench.llama_cpp as module
    monkeypatch.setattr(module, "build_info", lambda: {})
    backend, rec = _backend(n_seq=2, n_batch=6)
    requests = [BenchRequest(0, 0.0, [11, 12, 13], 3), BenchRequest(1, 0.0, [21, 22], 2),
                BenchRequest(2, 0.0, [31, 32, 33, 34, 35, 36, 37], 1)]
    result = backend.run(requests)
    # Step 1: both prompts whole (5 tokens), logits only at each prompt's last token.
    assert rec.batches[0] == [(11, 0, 0, False), (12, 1, 0, False), (13, 2, 0, True),
                              (21, 0, 1, False), (22, 1, 1, True)]
    # Step 2: the running sequences' next tokens (a token is its position + 1).
    assert rec.batches[1] == [(3, 3, 0, True), (2, 2, 1, True)]
    # Request 1 is done after 2 tokens; its sequence is cleared and request 2's
    # prompt of 7 takes it, 5 tokens beside sequence 0's one, then the last 2.
    assert (1, -1, -1) in rec.removed
    assert rec.batches[2][0] == (4, 4, 0, True)
    assert [e[:3] for e in rec.batches[2][1:]] == [(31, 0, 1), (32, 1, 1), (33, 2, 1),
                                                   (34, 3, 1), (35, 4, 1)]
    assert not any(e[3] for e in rec.batches[2][1:])
    assert rec.batches[3] == [(36, 5, 1, False), (37, 6, 1, True)]
    assert [len(t.token_times_s) for t in result.timelines] == [3, 2, 1]
    assert sorted(seq for seq, _, _ in rec.removed) == [0, 1, 1]
