"""Length-mix parsing, workload determinism, proportions and validation."""
import collections
import math

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

