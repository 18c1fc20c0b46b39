"""A GGUF file de-quantised once: the first load saves an ordinary checkpoint in the user's cache, later loads read it.

transformers reads a GGUF file by parsing its metadata in Python (once for the config, once for the tokenizer,
once for the weights) and de-quantising every tensor: about 18 s for the embedded 135M model on 2 cores, in
every process and every engine that loads it. The checkpoint it produced (fp32 weights as safetensors, config,
tokenizer) loads in under 2 s, and gives the same tensors, config and vocabulary (tested on the embedded
model).

- **Key**: the file's SHA-256 and the versions of transformers and gguf (their code does the conversion), so a
  changed file or an upgrade converts again; an old entry is simply never read again.
- **Where**: ``$POLYKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/polykv_agents``, else ``~/.cache/polykv_agents``;
  entries under ``gguf/``. ``POLYKV_GGUF_CACHE=0`` turns the cache off.
- **One entry per dtype**: the fp32 conversion, and beside it, once a process asks for the model in another dtype,
  that cast (``...-bfloat16``). transformers maps a checkpoint stored in the dtype it is asked for straight into
  the model's tensors (the file's pages are the weights); reading the fp32 entry into bf16 held the file's fp32
  pages and the cast copy at once: a load's peak RSS of 1,263 MiB against 750 after it, for the embedded model
  in bf16 (``python -m benchmarks.probes.rss_census``).
- **Safe to share**: an entry is written to a temporary folder beside it and renamed into place, so another
  process never reads half of one; a cache that cannot be written is skipped with a warning (the load
  itself goes on from the GGUF file).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CACHE_DIR_ENV_VAR = "POLYKV_CACHE_DIR"
SWITCH_ENV_VAR = "POLYKV_GGUF_CACHE"
_COMPLETE = "polykv-complete"  # written last: an entry without it is not used


def cache_root() -> Path | None:
    """The folder that holds the converted checkpoints, or ``None`` when the cache is switched off."""
    if os.environ.get(SWITCH_ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if root := os.environ.get(CACHE_DIR_ENV_VAR, "").strip():
        return Path(root).expanduser() / "gguf"
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base).expanduser() / "polykv_agents" / "gguf"


@functools.lru_cache(maxsize=16)
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    """Hash of the file's bytes (~0.2 s for 100 MB); memoised while its size and mtime stay the same."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def entry_for(gguf: Path, dtype: torch.dtype = torch.float32) -> Path | None:
    """Where the checkpoint converted from ``gguf`` lives in ``dtype`` (whether or not it exists yet); ``None``
    when off. The fp32 entry's name has no dtype: entries written before dtypes had entries are still read."""
    root = cache_root()
    if root is None:
        return None
    stat = gguf.stat()
    sha = _file_sha256(gguf, stat.st_size, stat.st_mtime_ns)
    suffix = "" if dtype == torch.float32 else f"-{str(dtype).removeprefix('torch.')}"
    return root / f"{gguf.stem}-{sha[:16]}-transformers{version('transformers')}-gguf{version('gguf')}{suffix}"


def cached_checkpoint(gguf: Path, dtype: torch.dtype = torch.float32) -> Path | None:
    """The checkpoint of ``gguf`` in ``dtype``, if a complete one is in the cache."""
    entry = entry_for(gguf, dtype)
    return entry if entry is not None and (entry / _COMPLETE).is_file() else None


def _save_model(model: PreTrainedModel, directory: Path) -> None:
    """Weights, config and generation config, as ``save_pretrained`` would write them. (transformers refuses
    ``save_pretrained`` on a model read from GGUF, which it marks quantized although its tensors are plain
    de-quantised ones.)"""
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF marker: the saved tensors are ordinary ones
    type(model.config).from_dict(config).save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    # save_model drops the second name of tied tensors (the LM head), which loading ties again.
    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})


def save_checkpoint(gguf: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path | None:
    """Save ``model`` (as loaded from ``gguf`` in fp32, or cast from that to another dtype) and ``tokenizer`` as
    its cache entry in the model's dtype.

    Returns the entry, or ``None`` when the cache is off or could not be written (a warning says why)."""
    entry = entry_for(gguf, model.dtype)
    if entry is None:
        return None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        try:
            _save_model(model, partial)
            tokenizer.save_pretrained(partial)
            (partial / _COMPLETE).write_text(f"converted from {gguf.name}\n", encoding="utf-8")
            os.replace(partial, entry)  # atomic; fails if another process renamed its copy first
        except Exception:
            if (entry / _COMPLETE).is_file():
                return entry  # another process won the race with the same conversion
            raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)  # gone already once renamed into place
    except Exception as error:  # the cache is an optimisation: whatever failed, the model loaded is returned
        logger.warning(
            "Could not save the de-quantised %s to %s (%s); it will be converted again next time. "
            "Set %s to a writable folder, or %s=0 to stop trying.",
            gguf.name,
            entry.parent,
            error,
            CACHE_DIR_ENV_VAR,
            SWITCH_ENV_VAR,
        )
        return None
    logger.info("saved the de-quantised %s to %s", gguf.name, entry)
    return entry


def discard(entry: Path) -> None:
    """Remove a cache entry (one that could not be read); the next load converts the GGUF file again."""
    shutil.rmtree(entry, ignore_errors=True)
