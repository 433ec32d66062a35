#!/usr/bin/env bash
# The device check, for a lent GPU (or TPU) machine: one command, under 9 minutes.
#
#   bash launch/device_bench.sh [OUT_DIR]          (default: $OUT, else ./device_bench_out)
#
# The machine's image already has jax with its CUDA plugin, flax, torch and transformers;
# jaxpd is put on the path from this checkout (no network needed). Wheels of anything
# missing (grpcio-health-checking, grpcio-reflection, ...) may travel in .whl/ and are
# installed to /tmp/site first; they must accept the image's grpcio (the H200 image has
# 1.84.0: take grpcio-health-checking and grpcio-reflection 1.84.0). It writes, per
# step, the bench's JSON and its printed table into OUT_DIR, and a summary.txt of all
# tables:
#   1. devices and versions; the decode attention cores (launch/attention_bench.py):
#      the backend's compiled Pallas kernel against the jnp reference, error and time;
#   1b. every serving program exported for the platform (`python -m jaxpd.export`,
#      colocated=1, max_model_len 128) with its Pallas kernel and with the reference,
#      then run here on the same random inputs (launch/export_check.sh): the kernel's
#      numerics inside the programs the engine serves (TPU: a random head-dim-128
#      model, the kernel's lane width; GPU: the built-in model);
#   2. the roofline (bandwidth, matmul rate, prefill per bucket, decode per batch and
#      context) on the built-in model and on a random 1B-class Llama (bfloat16);
#   3. the serving bench on the same requests: jaxpd colocated=1 vs transformers (one
#      device cannot hold two disjoint meshes), 32 x (64 -> 64) greedy, both models.
# The serving steps run attention_impl=auto: the jnp reference on GPU, and on TPU too for
# these models (JAX's TPU kernel, auto's pick there, needs a head dim that is a multiple
# of 128); the roofline's decode runs the reference too (it builds `Llama` itself).
# Each step has its own time limit, so one slow step cannot eat the others' budget.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-device_bench_out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# jaxpd from the checkout, namespaced as installed (jaxpd.models etc.): an editable
# install needs no network with --no-deps --no-build-isolation.
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 ||
  echo "editable install failed (see install.log); using the source tree" | tee -a "$out/summary.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {   # step NAME SECONDS CMD...: run with a limit, keep its output, append to summary
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$out/summary.txt"
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  grep -v -e '^\s*$' -e 'it/s\]' "$out/$name.txt" | tail -n 40 >>"$out/summary.txt"
  echo "-- $name: exit $rc" | tee -a "$out/summary.txt"
}

step devices 30 python3 -c "import jax, jaxlib, flax, torch, transformers; \
print('jax', jax.__version__, 'flax', flax.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__); print(jax.devices()); \
print('torch cuda:', torch.cuda.is_available())"
# The platform's own Pallas kernel, named ("auto" may pick the reference there).
kernel=$(python3 -c "import jax; p = jax.devices()[0].platform; \
print({'gpu': 'pallas_gpu', 'cuda': 'pallas_gpu', 'tpu': 'pallas_tpu'}.get(p, 'auto'))")
step attention 60 python3 launch/attention_bench.py --impls "reference,$kernel" \
  --json "$out/attention.json"
export_model=-
if [ "$kernel" = pallas_tpu ]; then
  export_model=/tmp/jaxpd_h128
  timeout 30 python3 launch/make_random_llama.py "$export_model" --size tiny_h128 >/dev/null 2>&1
fi
export_platform=$(python3 -c "import jax; p = jax.devices()[0].platform; \
print({'gpu': 'cuda'}.get(p, p))")
step export 90 bash launch/export_check.sh "$export_platform" "$kernel" "$export_model" \
  /tmp/jaxpd_export 128 '^(decode|prefill_b1|prefill_b8|insert_m1$|penalties)'
# BIG_SIZE=tiny NUM_REQUESTS=4 checks the script itself on a CPU in a minute or two.
step make_big 60 python3 launch/make_random_llama.py /tmp/jaxpd_big --size "${BIG_SIZE:-1b}" --dtype bfloat16
step roofline_default 50 python3 -m jaxpd.bench --roofline --mesh colocated=1 \
  --json "$out/roofline_default.json" --no_progress
step roofline_big 75 python3 -m jaxpd.bench --roofline --mesh colocated=1 --model /tmp/jaxpd_big \
  --roofline_batches 1,16,32 --roofline_contexts 128,512 --roofline_max_len 512 \
  --json "$out/roofline_big.json" --no_progress
serve=(--mesh colocated=1 --compare hf --prompt_lens 64 --output_lens 64 --num_requests "${NUM_REQUESTS:-32}"
       --rate 1000 --slots_per_shard 32 --hf_batch 32 --no_progress)
step serve_default 90 python3 -m jaxpd.bench "${serve[@]}" --json "$out/serve_default.json"
step serve_big 75 python3 -m jaxpd.bench "${serve[@]}" --model /tmp/jaxpd_big \
  --json "$out/serve_big.json"
echo "done $(date +%T); results in $out" | tee -a "$out/summary.txt"
