#!/usr/bin/env bash
# Regenerate every measured result in benchmarks/results/ and docs/RESULTS.md, one after another
# (never in parallel: they time the same CPU). About 2 hours on 2 cores.
#
#   bash benchmarks/run_all.sh [PEER_PYTHON]
#
# PEER_PYTHON: the python of a separate environment with polykv-llm==0.1.0 (see docs/RESULTS.md,
# "Peer"); without it the peer comparison is skipped and its last results are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
doc=$(mktemp --suffix=.txt)
trap 'rm -f "$doc"' EXIT
python -c "from polykv_agents.eval import pydoc_documents; print(pydoc_documents(1, 60_000)[0])" > "$doc"

for suite in speed memory quality ablation; do
    polykv-agents bench "$suite" --out "$out"
done
if [[ $# -ge 1 ]]; then
    polykv-agents bench peer --peer-python "$1" --out "$out"
fi
for context in 2048 4096; do
    polykv-agents bench agents --document "$doc" --agents 15 --context-tokens "$context" --max-new-tokens 32 \
        --repetitions 3 --json > "$out/agents_$context.json"
done
polykv-agents bench agents --document "$doc" --agents 15 --context-tokens 2048 --max-new-tokens 32 \
    --repetitions 3 --runtime compressed --json > "$out/agents_compressed_2048.json"
python benchmarks/graph_e2e.py --contexts 2048 4096 --roles 15 --max-tokens 32 --repetitions 2 \
    --out "$out/graph_e2e.json"
python benchmarks/load_soak.py --out "$out/load_soak.json"   # figures quoted in docs/RELIABILITY.md
python benchmarks/grammar_overhead.py --out "$out/grammar_overhead.json"   # quoted in README.md
python benchmarks/ray_scale_out.py --out "$out/ray_scale_out.json"         # quoted in docs/DISTRIBUTED.md
python benchmarks/render_results.py
