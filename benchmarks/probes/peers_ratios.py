"""Each of our rows of a peers run against each llama.cpp row: the review's per-document speed ratio, mean and 95%
t-interval over the documents (the winners table does this for the defaults only, fixed in advance).

    python -m benchmarks.probes.peers_ratios [benchmarks/results/peers.json]

Measures nothing: it reads the committed JSON, which names the commit that produced it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from polykv_agents.bench.stats import mean_interval


def review_ratios(result: dict) -> list[tuple[str, str, float, float, float]]:
    """``(ours, peer, mean, low, high)`` of the peer's review wall over ours, one ratio per document."""
    rows = {row["method"]: row for row in result["rows"] if row.get("kind") == "engine"}
    ours = [method for method in rows if method.startswith("polykv_agents")]
    peers = [method for method in rows if not method.startswith("polykv_agents") and "reset" not in method]
    out = []
    for our in ours:
        walls = rows[our]["samples"]["review_wall_s"]
        for peer in peers:
            ratios = [theirs / mine for mine, theirs in zip(walls, rows[peer]["samples"]["review_wall_s"], strict=True)]
            interval = mean_interval(ratios)
            out.append((our, peer, interval.mean, interval.low, interval.high))
    return out


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/peers.json")
    result = json.loads(path.read_text())
    print("commit", result["info"]["git_commit"][:10])
    for our, peer, mean, low, high in review_ratios(result):
        print(f"{our} vs {peer}: {mean:.2f}x [{low:.2f}, {high:.2f}]")


if __name__ == "__main__":
    main()
