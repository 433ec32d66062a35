#!/usr/bin/env bash
# Every serving program exported for PLATFORM twice, with the attention core KERNEL and
# with the jnp reference, then both run here on the same random inputs
# (`jaxpd.export.execute`): the kernels' numerics as the engine serves them, on one
# device (mesh colocated=1). Prints the exports' counts and the comparison table; exit
# non-zero when an export fails or a program differs beyond tolerance.
#
#   bash launch/export_check.sh PLATFORM KERNEL MODEL OUT_DIR [MAX_MODEL_LEN] [MATCH] [EXPORT]
#
# MODEL "-" is the built-in model; MATCH (a regex) runs only the programs it names.
# EXPORT "all" (the default) exports every program, so each one is lowered for the
# platform; "matched" exports only those MATCH names (a check of the run alone).
# With PLATFORM cpu it checks this script's logic on a machine without a device.
set -euo pipefail
platform=$1 kernel=$2 model=$3 out=$4 len=${5:-256} match=${6:-} exported=${7:-all}
common=(--platform "$platform" --mesh colocated=1 --max_model_len "$len")
case "$exported" in
  all) ;;
  matched) common+=(${match:+--match "$match"}) ;;
  *) echo "export_check.sh: EXPORT must be all or matched, got '$exported'" >&2; exit 2 ;;
esac
if [ "$model" != "-" ]; then
  common+=(--model "$model")
fi
mkdir -p "$out"
python3 -m jaxpd.export "${common[@]}" --attention_impl "$kernel" --out "$out/programs" \
  2>"$out/export.log" | sed -n 1p
python3 -m jaxpd.export "${common[@]}" --attention_impl reference --out "$out/reference" \
  2>>"$out/export.log" | sed -n 1p
python3 -m jaxpd.export.execute --programs "$out/programs" --reference "$out/reference" \
  ${match:+--match "$match"} 2>>"$out/export.log"
