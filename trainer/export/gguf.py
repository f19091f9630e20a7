"""Write a GGUF file (llama.cpp's format) from a Hugging Face causal-LM directory.

Why our own writer: llama.cpp's ``convert_hf_to_gguf.py`` is a script in the llama.cpp tree,
not an importable module of any PyPI package (the ``gguf`` package, gguf-py, ships the file
writer, the tensor-name tables and the quantizers, but not the converter). What the converter
adds per architecture is small for the dense models we export, so it is spelled out here with
gguf-py's own tables (``MODEL_ARCH``, ``TensorNameMap``, ``SpecialVocab``):

- ``llama`` (Llama 2/3.x; ``mistral`` runs as llama in llama.cpp): Q and K rows are permuted
  from Hugging Face's rotate-half RoPE layout to llama.cpp's interleaved one; Llama 3.1's
  ``rope_type: llama3`` scaling becomes the ``rope_freqs`` tensor, as the converter computes it.
- ``qwen2``, ``qwen3``: NeoX-style RoPE in llama.cpp, tensors as they are (Qwen3's q/k norms
  map through the table).

The vocabulary must be a byte-level BPE (``tokenizer.json``; Llama 3, Qwen2/3, ftq's tiny
models): its pre-tokenizer is matched to llama.cpp's by its split regex. SentencePiece vocabularies
(Llama 2, Mistral v0.1) and other architectures are refused with the list of what is supported.

Tensors are written one at a time (header first, then each tensor loaded, converted and
written), so memory stays near one tensor, not the whole model. 1-D tensors (norms) stay F32,
as llama.cpp expects; a matrix whose rows do not split into Q8_0 blocks of 32 stays F16.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.catalog import DEFAULT_QUANTIZATION, QUANTIZATIONS

ARCHITECTURES = {
    # HF architecture -> (gguf arch, permute Q/K for llama.cpp's interleaved RoPE)
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
}

# The pre-tokenizer split regexes llama.cpp knows by name (llama-vocab.cpp), as tokenizer.json spells them.
_PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}

Progress = Callable[[int, int], None]
"""Called with (tensors written, tensors in all) after each tensor."""


class GgufError(ValueError):
    """The model cannot be written as GGUF; the message says what is supported."""


@dataclass(frozen=True)
class GgufInfo:
    path: Path
    arch: str
    outtype: str
    tensors: int
    bytes: int


def write_gguf(model_dir: str | Path, out: str | Path, outtype: str = DEFAULT_QUANTIZATION,
               progress: Progress | None = None, name: str | None = None) -> GgufInfo:
    """Convert the model in ``model_dir`` (``config.json``, safetensors, ``tokenizer.json``) to ``out``;
    ``name`` is its ``general.name`` (default the directory's name).

    Raises:
        GgufError: an unsupported architecture, vocabulary or ``outtype``.
    """
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    if outtype not in QUANTIZATIONS:
        raise GgufError(f"quantization: {outtype!r} is not one of {', '.join(QUANTIZATIONS)}")
    config = json.loads((model_dir / "config.json").read_text())
    arch_name, permute = _arch(config)
    arch = gguf.MODEL_ARCH[arch_name.upper()]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    plan = list(_tensor_plan(model_dir, config, names, permute, outtype))

    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    _add_hparams(writer, config, outtype, name or model_dir.name)
    _add_vocab(writer, model_dir, config["vocab_size"])
    for item in plan:
        writer.add_tensor_info(item.name, item.byte_shape, item.np_dtype, item.nbytes, raw_dtype=item.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, item in enumerate(plan, 1):
        data = item.load()
        assert data.nbytes == item.nbytes, f"{item.name}: {data.nbytes} bytes, header says {item.nbytes}"
        writer.write_tensor_data(data)
        if progress is not None:
            progress(i, len(plan))
    writer.close()
    return GgufInfo(out, arch_name, outtype, len(plan), out.stat().st_size)


def _arch(config: dict[str, Any]) -> tuple[str, bool]:
    for name in config.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise GgufError(
        f"format gguf: architecture {config.get('architectures')} is not supported; "
        f"supported: {', '.join(ARCHITECTURES)} (export format merged works for every model)"
    )


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings whichever way the config spells them (transformers 5 ``rope_parameters``)."""
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _add_hparams(writer: Any, config: dict[str, Any], outtype: str, name: str) -> None:
    import gguf

    rope = _rope(config)
    if rope["rope_type"] not in ("default", "llama3"):
        raise GgufError(f"format gguf: rope type {rope['rope_type']!r} is not supported (default, llama3)")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer.add_file_type(file_types[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_vocab(writer: Any, model_dir: Path, vocab_size: int) -> None:
    """Tokens, their types, merges, special ids, add-BOS and the chat template (``SpecialVocab``)."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer_json = model_dir / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise GgufError(f"format gguf: {model_dir.name} has no tokenizer.json (a byte-level BPE vocabulary is needed)")
    raw = json.loads(tokenizer_json.read_text())
    if (raw.get("model") or {}).get("type") != "BPE":
        raise GgufError("format gguf: only byte-level BPE vocabularies are supported (Llama 3, Qwen2/3), "
                        f"this one is {(raw.get('model') or {}).get('type')!r}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:  # the embedding has rows past the vocabulary (padded for speed)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(raw.get("pre_tokenizer") or {}))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    if special.chat_template is None:
        raise GgufError(f"format gguf: {model_dir.name} has no chat template to carry into the GGUF")


def _pre_tokenizer(pre: dict[str, Any]) -> str:
    """llama.cpp's name for the pre-tokenizer of ``tokenizer.json``."""
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        for step in pre.get("pretokenizers", []):
            pattern = (step.get("pattern") or {}).get("Regex")
            if step.get("type") == "Split" and pattern in _PRE_TOKENIZERS:
                return _PRE_TOKENIZERS[pattern]
    raise GgufError(f"format gguf: the tokenizer's pre-tokenizer is not one llama.cpp knows by name "
                    f"(supported: GPT-2 byte-level, {', '.join(sorted(set(_PRE_TOKENIZERS.values())))})")


@dataclass(frozen=True)
class _Planned:
    """One tensor of the GGUF: its name, type and size (for the header) and how to produce its bytes."""

    name: str
    shape: tuple[int, ...]
    qtype: Any
    load: Callable[[], np.ndarray]

    @property
    def np_dtype(self) -> Any:
        import gguf

        return {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}.get(
            self.qtype, np.uint8
        )

    @property
    def byte_shape(self) -> tuple[int, ...]:
        from gguf.quants import quant_shape_to_byte_shape

        if self.np_dtype is np.uint8:
            return tuple(quant_shape_to_byte_shape(self.shape, self.qtype))
        return self.shape

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.byte_shape)) * np.dtype(self.np_dtype).itemsize


def _tensor_plan(model_dir: Path, config: dict[str, Any], names: Any, permute: bool,
                 outtype: str) -> Iterator[_Planned]:
    import gguf

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise GgufError(f"format gguf: {model_dir} holds no safetensors weights")
    tied = bool(config.get("tie_word_embeddings"))
    rope = _rope(config)
    if rope["rope_type"] == "llama3":
        factors = _llama3_rope_factors(config, rope)
        yield _Planned(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", tuple(factors.shape),
                       gguf.GGMLQuantizationType.F32, lambda: factors)
    for file in files:
        for hf_name, shape in _safetensors_shapes(file).items():
            if tied and hf_name == "lm_head.weight":
                continue  # llama.cpp reuses token_embd as the output when output.weight is absent
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise GgufError(f"format gguf: no GGUF name for tensor {hf_name!r}")
            qtype = _qtype(outtype, shape)
            yield _Planned(name, shape, qtype, _loader(file, hf_name, qtype, _permutation(hf_name, config, permute)))


def _qtype(outtype: str, shape: tuple[int, ...]) -> Any:
    from gguf import GGMLQuantizationType as Q

    if len(shape) < 2 or outtype == "f32":
        return Q.F32
    if outtype == "q8_0" and shape[-1] % 32 != 0:
        return Q.F16
    return {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[outtype]


def _permutation(hf_name: str, config: dict[str, Any], permute: bool) -> int | None:
    """Heads to permute ``hf_name``'s rows over (llama's q and k), or None."""
    if not permute:
        return None
    if hf_name.endswith("self_attn.q_proj.weight"):
        return config["num_attention_heads"]
    if hf_name.endswith("self_attn.k_proj.weight"):
        return config.get("num_key_value_heads") or config["num_attention_heads"]
    return None


def _loader(file: Path, hf_name: str, qtype: Any, heads: int | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import torch
        from gguf.quants import quantize
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            tensor = f.get_tensor(hf_name).to(torch.float32)
        if heads is not None:
            tensor = _permute_rope_rows(tensor, heads)
        return quantize(tensor.numpy(), qtype)

    return load


def _permute_rope_rows(weight: Any, heads: int) -> Any:
    """HF's rotate-half rows (per head: first halves, then second halves) to interleaved pairs,
    as ``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` does."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _llama3_rope_factors(config: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1's RoPE scaling (``convert_hf_to_gguf.py``, LlamaModel)."""
    dim = _head_dim(config)
    freqs = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the file's header, without reading the weights."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
