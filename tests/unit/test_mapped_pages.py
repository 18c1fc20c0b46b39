"""A checkpoint's pages leave the resident set once the weights that mapped them are quantized, and nothing else does:
heap memory is never advised away, a tied weight keeps its pages, and every value reads back the same."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from polykv_agents.model.mapped_pages import file_mappings, release_mapped_pages
from polykv_agents.model.weights import quantize_weights

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps and madvise: Linux")


def _resident_bytes(path_part: str) -> int:
    """Resident bytes of this process's mappings of files whose path contains ``path_part`` (``/proc/self/smaps``)."""
    total, counting = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                counting = len(fields) >= 6 and path_part in fields[5]
            elif counting and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def _written_back(folder) -> None:
    """The checkpoint's pages on disk: a page not yet written back is not given back (it is written back first),
    as a checkpoint saved long before loading never is."""
    for path in folder.glob("*.safetensors"):
        with open(path, "rb+") as file:
            os.fsync(file.fileno())


@pytest.fixture
def mapped_checkpoint(tmp_path):
    """A tiny bf16 Llama saved to ``tmp_path`` (untied head): ``(folder, config)``."""
    config = LlamaConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=2048, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    _written_back(tmp_path)
    return tmp_path, config


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, local_files_only=True)


def test_a_mapped_weight_leaves_the_resident_set_and_reads_back_unchanged(mapped_checkpoint):
    folder, _ = mapped_checkpoint
    model = _load(folder)
    weight = model.model.layers[0].mlp.up_proj.weight  # 256 x 1024 bf16: 512 KiB, 128 pages
    expected = weight.detach().clone()  # reading it makes its pages resident
    before = _resident_bytes(str(folder))
    released = release_mapped_pages(weight)
    assert released >= weight.nbytes - 2 * 4096  # all but the two pages it may share with its neighbours
    assert _resident_bytes(str(folder)) <= before - released
    assert torch.equal(weight, expected)  # faulted in again from the file


def test_a_page_written_in_place_keeps_what_was_written(mapped_checkpoint):
    """A private mapping's page changed in place is a copy of this process's own: releasing it must not bring the
    file's bytes back (``MADV_DONTNEED`` would)."""
    folder, _ = mapped_checkpoint
    model = _load(folder)
    weight = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight.add_(1.0)  # as a merged adapter would
    expected = weight.detach().clone()
    release_mapped_pages(weight)
    assert torch.equal(weight, expected)


def test_heap_memory_is_left_alone():
    tensor = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB: its own anonymous mapping, not a file
    expected = tensor.clone()
    assert release_mapped_pages(tensor) == 0
    assert torch.equal(tensor, expected)  # MADV_DONTNEED would have zeroed it


def test_only_file_mappings_are_listed(mapped_checkpoint):
    folder, _ = mapped_checkpoint
    model = _load(folder)
    address = model.model.layers[0].mlp.up_proj.weight.data_ptr()
    assert any(low <= address < high for low, high in file_mappings())
    heap = torch.arange(1_000_000, dtype=torch.float32).data_ptr()
    assert not any(low <= heap < high for low, high in file_mappings())


def test_quantizing_a_mapped_checkpoint_drops_its_pages_and_computes_the_same(mapped_checkpoint):
    folder, config = mapped_checkpoint
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    copied = _load(folder)
    for tensor in copied.parameters():  # the same weights in heap memory: nothing to release there
        tensor.data = tensor.data.clone()
    quantize_weights(copied, "int8")
    mapped = _load(folder)
    for tensor in mapped.parameters():
        tensor.detach().float().sum()  # every page resident, as a model that has run once
    file_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert _resident_bytes(str(folder)) > 0.9 * file_bytes
    quantize_weights(mapped, "int8")
    replaced = sum(m.in_features * m.out_features * 2 for m in copied.modules() if hasattr(m, "in_features"))
    replaced += config.vocab_size * config.hidden_size * 2  # the embedding, now int8 codes of its own
    assert _resident_bytes(str(folder)) < file_bytes - 0.9 * replaced  # the linear layers' and embedding's pages
    with torch.inference_mode():
        assert torch.equal(mapped(ids).logits, copied(ids).logits)


def test_a_tied_weight_still_read_keeps_its_pages(tmp_path):
    """Gemma's embedding scales its rows, so it stays as it is (bf16) and still reads the weight the swapped output
    layer was tied to: those pages stay resident."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, vocab_size=4096, tie_word_embeddings=True,
    )  # fmt: skip
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    _written_back(tmp_path)
    model = _load(tmp_path)
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding
    expected = embedding.detach().clone()
    resident = _resident_bytes(str(tmp_path))
    quantize_weights(model, "int8")
    assert _resident_bytes(str(tmp_path)) >= min(resident, embedding.nbytes)  # before reading faults any back in
    assert model.get_input_embeddings().weight is embedding and torch.equal(embedding, expected)
