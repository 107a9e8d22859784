#!/usr/bin/env bash
# Serves the target with draft_model speculation in vllm (written by specdecode export; NOTES.md says what maps to what). Set TARGET to serve another copy of the target (e.g. its hub id); extra arguments go to the server.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
TARGET="${TARGET:-TARGET_DIR}"
exec vllm serve "$TARGET" --speculative-config "$(python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["model"] = sys.argv[2]; print(json.dumps(c))' "$HERE/speculative_config.json" "$HERE/draft")" "$@"
