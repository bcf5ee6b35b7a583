#!/usr/bin/env bash
# Trains the default model v2 in ONE device call and leaves everything in $OUT, within the
# device's limits (10 minutes a command; at most 8 files of at most 16 MiB come back):
#
#   $OUT/train_stdout.log              the script's progress lines (the call's output keeps only
#                                      the last 12,000 characters)
#   $OUT/train_log.json                loss curve, progress evals, sizes, timings, sha256 of the
#                                      saved files (rewritten as the run goes: a crash leaves it)
#   $OUT/default-model.tar.gz.partNN   the model folder (~31 MB: more than one file may carry),
#                                      the held-out split and SHA256SUMS, as a gzip'd tar cut
#                                      into 15 MiB pieces (usually 2)
#
# Run from the repository root:  bash tools/train_default_model_device.sh [extra script args]
# Reassemble where the files come back (FILES is the folder holding the parts):
#   mkdir -p /tmp/dmv2 && cat "$FILES"/default-model.tar.gz.part* | tar -xzf - -C /tmp/dmv2
#   (cd /tmp/dmv2 && sha256sum -c SHA256SUMS)
set -uo pipefail
: "${OUT:?set OUT to the folder whose files come back}"
work=$(mktemp -d /tmp/default-model-v2.XXXXXX)
# The script keeps itself within --time-budget-s (540 s by default, checkpoint included; Python's
# imports come on top); timeout is the backstop that still leaves time to pack what was written.
timeout --kill-after=5 570 python3 tools/train_default_model.py \
    --out "$work/default-model" \
    --heldout-out "$work/data/default_model_heldout.jsonl.gz" \
    --log-json "$OUT/train_log.json" "$@" 2>&1 | tee "$OUT/train_stdout.log"
status=${PIPESTATUS[0]}
if [[ -f "$work/default-model/model.safetensors" ]]; then
    (
        cd "$work" &&
            sha256sum default-model/* data/* >SHA256SUMS &&
            tar -cf - default-model data SHA256SUMS
    ) | gzip -1 | split -b 15M -d - "$OUT/default-model.tar.gz.part"
fi
ls -l "$OUT"
exit "$status"
