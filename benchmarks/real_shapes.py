"""Models of the sizes users run, for time and memory only: the published configuration of a 1B+ model, random
weights from a fixed seed, saved once to the user's cache, and GGUF copies made by llama.cpp's own tools.

    python -m benchmarks.real_shapes --model Llama-3.2-1B --model Qwen2.5-1.5B \\
        [--llama-cpp path/to/llama.cpp --gguf F16 --gguf Q8_0 --gguf Q4_0]

prints each model's folder (and GGUF files), building what is missing. Nothing is downloaded: the configuration
values are written below, copied from each model's ``config.json``; the tokenizer is the embedded SmolLM2's (49,152
tokens), and the embedding and output layer keep the published vocabulary, so the weights have their real shapes
and bytes. The tokenizer's ids are the first 49,152 rows; ids past them decode to nothing (and to ``[PAD<id>]``
tokens in the GGUF files, as llama.cpp's converter pads a vocabulary). The special tokens (beginning, end of
sequence) are the tokenizer's, not the published ones, which lie past its vocabulary.

**Random weights are meaningless for quality.** Every figure from these models is about time and memory, measured
with ``ignore_eos`` and a pinned plan so that every method decodes the same tokens. Say so wherever they appear.

``--llama-cpp`` is the llama.cpp source tree of the llama-cpp-python sdist (``vendor/llama.cpp``): its
``convert_hf_to_gguf.py`` (with its own ``gguf-py``) writes the F16 file and ``llama-quantize`` (built in its
``build-vm/bin`` or ``build/bin``) the others.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

PUBLISHED: dict[str, dict] = {
    # meta-llama/Llama-3.2-1B, config.json (1.24B parameters; the output layer is the tied embedding)
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "vocab_size": 128256,
    },
    # Qwen/Qwen2.5-1.5B, config.json (1.54B parameters; q, k and v projections with a bias)
    "Qwen2.5-1.5B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 1536,
        "initializer_range": 0.02,
        "intermediate_size": 8960,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "num_attention_heads": 12,
        "num_hidden_layers": 28,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}

SEED = 0
"""The weights' seed: one seed, one model, on every machine (torch's CPU generator)."""

GGUF_TYPES = ("F16", "Q8_0", "Q4_0")
_COMPLETE = "polykv-complete"  # written last: a folder without it is built again


def model_dir(name: str, seed: int = SEED) -> Path:
    """Where ``name``'s random-weight model lives: ``<cache>/real-shapes/<name>-seed<seed>``, under the package's cache
    folder (``$POLYKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/polykv_agents``, else ``~/.cache/polykv_agents``)."""
    if root := os.environ.get("POLYKV_CACHE_DIR", "").strip():
        cache = Path(root).expanduser()
    else:
        cache = (
            Path(os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache").expanduser() / "polykv_agents"
        )
    return cache / "real-shapes" / f"{name}-seed{seed}"


def published_config(name: str):
    """transformers' configuration of ``name``, from the values above."""
    from transformers import AutoConfig

    if name not in PUBLISHED:
        msg = f"unknown model {name!r}; one of {', '.join(PUBLISHED)}"
        raise ValueError(msg)
    values = dict(PUBLISHED[name])
    return AutoConfig.for_model(values.pop("model_type"), **values)


def random_model(
    name: str, seed: int = SEED, dtype: torch.dtype = torch.bfloat16, special_tokens: dict[str, int] | None = None
):
    """``name``'s published configuration with weights drawn from ``seed`` (transformers' own initialisation);
    ``special_tokens`` (``bos_token_id``, ``eos_token_id``...) replace the published ids."""
    from transformers import AutoModelForCausalLM

    config = published_config(name)
    for key, value in (special_tokens or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build(name: str, seed: int = SEED) -> Path:
    """``name``'s folder (config, safetensors, the embedded model's tokenizer), written once; returns it."""
    from transformers import AutoTokenizer

    from polykv_agents.model.loading import embedded_model_file

    directory = model_dir(name, seed)
    if (directory / _COMPLETE).exists():
        return directory
    gguf = embedded_model_file()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The tokenizer's own ids: the published ones (128001 for Llama 3) lie past its 49,152 tokens, where a grammar
    # over its vocabulary cannot name them.
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    random_model(name, seed, special_tokens=special).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / _COMPLETE).write_text(f"{name}, seed {seed}: random weights, published shapes\n")
    return directory


def _quantizer(llama_cpp: Path) -> Path:
    for folder in ("build-vm", "build"):
        if (binary := llama_cpp / folder / "bin" / "llama-quantize").is_file():
            return binary
    msg = f"no llama-quantize under {llama_cpp}/build*/bin: build it with `cmake --build build --target llama-quantize`"
    raise FileNotFoundError(msg)


def gguf_file(name: str, kind: str, llama_cpp: Path, seed: int = SEED) -> Path:
    """``name``'s GGUF file of type ``kind`` (F16, Q8_0 or Q4_0), made once with llama.cpp's tools; returns it."""
    if kind not in GGUF_TYPES:
        msg = f"GGUF type must be one of {', '.join(GGUF_TYPES)}, got {kind!r}"
        raise ValueError(msg)
    converter = llama_cpp / "convert_hf_to_gguf.py"
    if not converter.is_file():
        msg = f"no convert_hf_to_gguf.py in {llama_cpp}: pass llama.cpp's source tree (the sdist's vendor/llama.cpp)"
        raise FileNotFoundError(msg)
    quantizer = _quantizer(llama_cpp) if kind != "F16" else None  # before any work: a missing tool fails first
    directory = build(name, seed)
    out = directory / f"{name}-{kind}.gguf"
    if out.exists():
        return out
    f16 = directory / f"{name}-F16.gguf"
    if not f16.exists():
        # The converter of the same llama.cpp as the peers, with its own gguf-py (the gguf package of this
        # environment is transformers' reader and may be older).
        env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
        command = [sys.executable, str(converter), str(directory), "--outtype", "f16", "--outfile", str(f16)]
        subprocess.run(command, check=True, env=env)
    if quantizer is not None:
        subprocess.run([str(quantizer), str(f16), str(out), kind], check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", choices=list(PUBLISHED), required=True)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's source tree (the sdist's vendor/llama.cpp)")
    parser.add_argument("--gguf", action="append", choices=GGUF_TYPES, default=[])
    args = parser.parse_args()
    if args.gguf and args.llama_cpp is None:
        parser.error("--gguf needs --llama-cpp")
    for name in args.model:
        print(name, build(name, args.seed), flush=True)
        for kind in args.gguf:
            print(name, kind, gguf_file(name, kind, args.llama_cpp, args.seed), flush=True)


if __name__ == "__main__":
    main()
