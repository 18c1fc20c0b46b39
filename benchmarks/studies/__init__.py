"""The studies: suites (:class:`polykv_agents.bench.suite.Suite`) that measure this project against its peers
(llama.cpp, polykv-llm, transformers' QuantizedCache), explain a design choice (ablation, frontier, dtypes, weights,
compiled steps, admission, reuse, blocks, grammar, Ray) or check the workflows end to end (graph_e2e, load_soak),
with the harnesses they need. Each is run by ``python -m benchmarks <name>``."""
