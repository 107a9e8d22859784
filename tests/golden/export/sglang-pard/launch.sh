#!/usr/bin/env bash
# Serves the target with STANDALONE speculation in sglang (written by specdecode export; NOTES.md says what maps to what). Set TARGET to serve another copy of the target (e.g. its hub id); extra arguments go to the server.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
TARGET="${TARGET:-TARGET_DIR}"
exec python -m sglang.launch_server --model-path "$TARGET" --speculative-algorithm STANDALONE --speculative-draft-model-path "$HERE/draft" --speculative-num-steps 6 --speculative-eagle-topk 1 --speculative-num-draft-tokens 7 "$@"
