"""Probe: reusing blocks of text at other positions (issue 17, item 3): which tokens to recompute, and what it costs.

A critic reads the specialists' findings. Each finding's keys and values already exist, computed where its
specialist wrote it: after the document and that specialist's own prompt. This moves them into the critic's
prompt instead of prefilling them again, as CacheBlend / EPIC do, and measures what that changes against a full
prefill of the same prompt:

  document (1,024 tokens, shared, exact) | "Findings:" | finding 1 | ... | finding 5 | question
  a finding's keys re-rotated from its old position to the new one (RoPE: R(p + d) = R(d) R(p)), then some of its
  tokens recomputed in place, in one masked forward (each attends to everything before it, the others as moved):

  first       the first fraction of each finding (EPIC; what ``reuse="blocks"`` ships)
  cacheblend  the fraction of all findings' tokens whose layer-1 keys and values deviate most from a full
              prefill's (CacheBlend's selection: it costs two layers of a full prefill to find them)
  oracle      the same, by the deviation summed over every layer (not buildable: it needs the full prefill; it
              bounds what any selection by deviation could do)

Per setting, over ``--documents`` pydoc documents (independent samples):
- judge consistency: the critic is asked which finding is weakest, answering with its number; how often the
  reused prompt's greedy number equals the full prefill's;
- NLL delta: mean negative log-likelihood of the full prefill's 32 greedy tokens under the reused prompt, minus
  under the full prefill (0 = identical distribution along that answer; +0.0198 nats = +2% perplexity);
- agreement: how many of the 32 greedy tokens match before the first difference.

    python benchmarks/probes/block_reuse.py --documents 16

The findings are pydoc sentences (each 40 tokens), not generated answers, so that every document gives
five different blocks. Nothing here is used by the runtime.

Measured 2026-12-02 on this project's 2-core machine, SmolLM2-135M-Instruct in bf16, 16 documents:

  selection   recomputed  judge same as full  NLL delta, mean (lowest to highest document)  greedy agreeing
  first        0%         75%                 +0.217 (-0.025 to +0.648)                    3 of 32
  first       15%         81%                 +0.099 (-0.055 to +0.388)                    4
  first       30%         81%                 +0.072 (-0.071 to +0.334)                    5
  first       50%         81%                 +0.042 (-0.022 to +0.212)                    5
  first      100%         94%                 +0.002 (-0.008 to +0.010)                    31
  cacheblend  15%         88%                 +0.135 (-0.030 to +0.533)                    4
  cacheblend  30%         88%                 +0.109 (-0.003 to +0.462)                    4
  cacheblend  50%         88%                 +0.067 (-0.032 to +0.357)                    4
  oracle      15%         94%                 +0.116 (-0.028 to +0.440)                    4
  oracle      30%         88%                 +0.081 (-0.025 to +0.370)                    4
  oracle      50%         94%                 +0.028 (-0.026 to +0.110)                    5

- No fraction short of recomputing everything keeps the NLL delta within +0.02 nats (+2% perplexity); the closest
  is the oracle at 50%, +0.028, which no runtime can build.
- Recomputing everything, a full prefill in one masked forward, still changed the verdict in 1 of 16 documents
  (bf16 rounding on a near tie): about 94% is this judge's ceiling here, so 90% is close to its noise.
- CacheBlend's layer-1 selection did no better than the first tokens in NLL at equal fractions (+0.135 against
  +0.099 at 15%), and costs two layers of a full prefill to choose. So the runtime recomputes the first tokens.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from polykv_agents.engine import load_model
from polykv_agents.eval.corpus import pydoc_documents

DOCUMENT_TOKENS, FINDINGS, FINDING_TOKENS, ANSWER_TOKENS = 1024, 5, 40, 32
QUESTION = "\nWhich finding is weakest? Answer with its number only.<|im_end|>\n<|im_start|>assistant\nFinding "


@torch.inference_mode()
def forward(model, ids: list[int], cache: DynamicCache, start: int) -> torch.Tensor:
    """Run ``ids`` at positions ``start ..`` into ``cache``; last-position logits ``[vocab]``."""
    positions = torch.arange(start, start + len(ids)).unsqueeze(0)
    out = model(input_ids=torch.tensor([ids]), position_ids=positions, past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float()


@torch.inference_mode()
def append_moved(model, cache: DynamicCache, layers: list[tuple[torch.Tensor, torch.Tensor]], shift: int) -> None:
    """Append stored keys/values ``[1, KVH, n, D]`` per layer, keys re-rotated by ``shift`` positions."""
    probe = layers[0][0]
    cos, sin = model.model.rotary_emb(probe, torch.full((1, probe.shape[2]), shift))
    for layer, (keys, values) in enumerate(layers):
        _, moved = apply_rotary_pos_emb(keys, keys, cos, sin)
        cache.update(moved, values, layer)


def copy_cache(cache: DynamicCache) -> DynamicCache:
    copied = DynamicCache()
    for layer, entry in enumerate(cache.layers):
        copied.update(entry.keys.clone(), entry.values.clone(), layer)
    return copied


@torch.inference_mode()
def greedy(model, cache: DynamicCache, logits: torch.Tensor, position: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, all_logits = [], [logits]
    for _ in range(ANSWER_TOKENS):
        token = int(all_logits[-1].argmax())
        tokens.append(token)
        all_logits.append(forward(model, [token], cache, position))
        position += 1
    return tokens, all_logits[:-1]


@torch.inference_mode()
def nll_along(model, cache: DynamicCache, logits: torch.Tensor, position: int, tokens: list[int]) -> float:
    """Mean negative log-likelihood of ``tokens`` (teacher-forced) from this cache."""
    total = 0.0
    for token in tokens:
        total -= float(torch.log_softmax(logits, -1)[token])
        logits = forward(model, [token], cache, position)
        position += 1
    return total / len(tokens)


def trial(model, tokenizer, text: str, other: str, settings: list[tuple[str, float]]) -> dict[tuple[str, float], dict]:
    ids = tokenizer(text).input_ids
    document = ids[:DOCUMENT_TOKENS]
    sentences = tokenizer(other).input_ids
    findings = [sentences[i * FINDING_TOKENS : (i + 1) * FINDING_TOKENS] for i in range(FINDINGS)]
    base = DynamicCache()
    forward(model, document, base, 0)
    # Each finding's keys/values where its specialist wrote it: after the document and that specialist's prompt.
    stored = []
    for i, finding in enumerate(findings):
        own = tokenizer(f"<|im_start|>user\nYou are specialist {i + 1}. Your finding:<|im_end|>\n").input_ids
        cache = copy_cache(base)
        forward(model, own + finding, cache, len(document))
        start = len(document) + len(own)
        layers = [(e.keys[:, :, start:].clone(), e.values[:, :, start:].clone()) for e in cache.layers]
        stored.append((start, layers))
    header = tokenizer("<|im_start|>user\nThe specialists' findings:").input_ids
    labels = [tokenizer(f"\n{i + 1}. ").input_ids for i in range(FINDINGS)]
    question = tokenizer(QUESTION).input_ids

    # The critic's prompt after the document, and where each finding's tokens sit in it.
    prompt, blocks, position = list(header), [], len(document) + len(header)
    for label, finding in zip(labels, findings, strict=True):
        prompt += label + finding
        position += len(label)
        blocks.append(range(position, position + len(finding)))
        position += len(finding)
    full = copy_cache(base)
    forward(model, prompt, full, len(document))
    logits = forward(model, question, full, position)
    end = position + len(question)
    reference = copy_cache(full)
    answer, _ = greedy(model, full, logits, end)
    full_nll = nll_along(model, reference, logits, end, answer)
    deviation = key_value_deviation(reference, moved_cache(model, base, header, labels, blocks, stored), blocks)

    results = {}
    for strategy, fraction in settings:
        cache = moved_cache(model, base, header, labels, blocks, stored)
        recompute = sorted(set(label_positions(labels, blocks)) | set(select(strategy, fraction, blocks, deviation)))
        recompute_in_place(model, cache, [prompt[p - len(document)] for p in recompute], recompute)
        logits = forward(model, question, cache, position)
        replayed = copy_cache(cache)
        reused_answer, _ = greedy(model, cache, logits, end)
        nll = nll_along(model, replayed, logits, end, answer)
        same = next((i for i, (a, b) in enumerate(zip(answer, reused_answer, strict=True)) if a != b), ANSWER_TOKENS)
        results[strategy, fraction] = {
            "judge_same": float(tokenizer.decode(answer[:1]).strip() == tokenizer.decode(reused_answer[:1]).strip()),
            "nll_delta": nll - full_nll,
            "agreement": same,
        }
    return results


def label_positions(labels: list[list[int]], blocks: list[range]) -> list[int]:
    """Positions of the "\\n1. " labels: new text, always computed."""
    pairs = zip(labels, blocks, strict=True)
    return [p for label, block in pairs for p in range(block.start - len(label), block.start)]


@torch.inference_mode()
def moved_cache(model, base, header, labels, blocks, stored) -> DynamicCache:
    """[document][header exact][label: zeros][finding: moved] ...: every finding's stored keys re-rotated to its new
    position; the labels' slots hold zeros until recomputed."""
    cache = copy_cache(base)
    forward(model, header, cache, cache.get_seq_length())
    for label, block, (old_start, layers) in zip(labels, blocks, stored, strict=True):
        zeros = [(torch.zeros_like(k[:, :, : len(label)]), torch.zeros_like(v[:, :, : len(label)])) for k, v in layers]
        for layer, (k, v) in enumerate(zeros):
            cache.update(k, v, layer)
        append_moved(model, cache, layers, block.start - old_start)
    return cache


def key_value_deviation(reference: DynamicCache, moved: DynamicCache, blocks: list[range]) -> torch.Tensor:
    """Per layer and block token: |K_true - K_moved| + |V_true - V_moved| (L2 over heads and dims), ``[L, tokens]``."""
    index = torch.tensor([p for block in blocks for p in block])
    rows = []
    for true, reused in zip(reference.layers, moved.layers, strict=False):
        dk = (true.keys[0, :, index] - reused.keys[0, :, index]).float().pow(2).sum((0, 2)).sqrt()
        dv = (true.values[0, :, index] - reused.values[0, :, index]).float().pow(2).sum((0, 2)).sqrt()
        rows.append(dk + dv)
    return torch.stack(rows)


def select(strategy: str, fraction: float, blocks: list[range], deviation: torch.Tensor) -> list[int]:
    """Block positions to recompute: ``fraction`` of each block's tokens (``first``) or of all (by deviation)."""
    everything = [p for block in blocks for p in block]
    if strategy == "first":
        return [p for block in blocks for p in list(block)[: math.ceil(fraction * len(block))]]
    count = math.ceil(fraction * len(everything))
    # cacheblend: the deviation at layer 1, which costs two layers of a full prefill; oracle: over all layers.
    score = deviation[1] if strategy == "cacheblend" else (deviation / deviation.mean(1, keepdim=True)).sum(0)
    return [everything[i] for i in score.topk(count).indices.tolist()]


@torch.inference_mode()
def recompute_in_place(model, cache: DynamicCache, ids: list[int], positions: list[int]) -> None:
    """Run the tokens at ``positions`` again, each attending to the cache's entries before it (the stale entries of
    the recomputed tokens masked out) and to the recomputed tokens before it; their new keys and values then replace
    the old ones in place, layer by layer (CacheBlend's selective recompute)."""
    if not positions:
        return
    length, count = cache.get_seq_length(), len(positions)
    at = torch.tensor(positions)
    old = torch.arange(length).unsqueeze(0) < at.unsqueeze(1)  # [q, L]: earlier entries
    old[:, at] = False  # stale copies of the tokens being recomputed
    new = at.unsqueeze(0) <= at.unsqueeze(1)  # [q, q]: recomputed tokens up to itself
    mask = torch.cat([old, new], dim=1).view(1, 1, count, length + count)
    model(
        input_ids=torch.tensor([ids]),
        position_ids=at.unsqueeze(0),
        past_key_values=cache,
        attention_mask=mask,
        use_cache=True,
    )
    for layer in cache.layers:
        layer.keys[:, :, at] = layer.keys[:, :, length:]
        layer.values[:, :, at] = layer.values[:, :, length:]
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.15, 0.3, 0.5, 1.0])
    parser.add_argument("--strategies", nargs="+", default=["first", "cacheblend", "oracle"])
    args = parser.parse_args()
    settings = [(s, f) for s in args.strategies for f in args.fractions if 0 < f < 1 or s == "first"]
    model, tokenizer = load_model()
    texts = pydoc_documents(2 * args.documents, chars_per_document=8 * DOCUMENT_TOKENS)
    rows: dict[tuple[str, float], list[dict[str, float]]] = {setting: [] for setting in settings}
    for i in range(args.documents):
        for setting, figures in trial(model, tokenizer, texts[2 * i], texts[2 * i + 1], settings).items():
            rows[setting].append(figures)
    print(f"{model.config.name_or_path} ({model.dtype}), {args.documents} documents, {FINDINGS} findings of "
          f"{FINDING_TOKENS} tokens after a {DOCUMENT_TOKENS}-token document")  # fmt: skip
    print("selection | recomputed | judge same as full | NLL delta (mean, min-max) | greedy tokens agreeing (median)")
    for (strategy, fraction), figures in rows.items():
        judge = statistics.mean(f["judge_same"] for f in figures)
        nll = [f["nll_delta"] for f in figures]
        agree = statistics.median(f["agreement"] for f in figures)
        print(f"{strategy} | {fraction:.0%} | {judge:.0%} | {statistics.mean(nll):+.3f} ({min(nll):+.3f} to "
              f"{max(nll):+.3f}) | {agree:.0f} of {ANSWER_TOKENS}")  # fmt: skip


if __name__ == "__main__":
    main()
