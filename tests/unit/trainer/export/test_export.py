"""Exports: merged safetensors and GGUF reproduce the adapter's greedy tokens (GGUF in llama.cpp)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.trainer.export_helpers import adapter_greedy, adapter_logits, fake_finished_run, greedy, prompt_ids
from tests.unit.trainer.trainer_helpers import events_of, run_cli
from trainer.model import tiny

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # peft 0.21 reads transformers' deprecated is_gradient_checkpointing (building the test adapter)
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]


def _events():
    seen: list[tuple[str, dict]] = []
    return seen, lambda type_, **payload: seen.append((type_, payload))


class TestMerged:
    def test_merged_model_generates_the_adapters_greedy_tokens(self, tmp_path: Path, tiny_model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trainer.export.formats import run_export

        config = fake_finished_run(tmp_path, tiny_model_dir)
        ids = prompt_ids(tiny_model_dir)
        seen, report = _events()
        result = run_export(config, "merged", tmp_path / "merged", report, device="cpu")

        merged = AutoModelForCausalLM.from_pretrained(result.path).eval()
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        want = adapter_greedy(config, ids)
        assert greedy(merged, ids) == want
        assert greedy(base, ids) != want, "the adapter must change the output, or the test proves nothing"
        assert merged.dtype == base.dtype
        assert AutoTokenizer.from_pretrained(result.path).chat_template == tiny.CHAT_TEMPLATE
        assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        assert [(t, p["stage"]) for t, p in seen if p.get("fraction") == 1.0] == [
            ("progress", "load"), ("progress", "merge"), ("progress", "save")]

    def test_a_full_fine_tune_is_saved_in_the_base_dtype(self, tmp_path: Path, tiny_model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from tests.unit.trainer.trainer_helpers import make_job
        from trainer.training import layout
        from trainer.export.formats import run_export

        config = make_job(tmp_path, tiny_model_dir, method="full")
        tuned = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)  # not the base's float32
        with torch.no_grad():
            tuned.lm_head.weight.add_(1.0)
        tuned.save_pretrained(layout.export_dir(config.output_dir, "full"))
        result = run_export(config, "merged", tmp_path / "merged", lambda *a, **k: None, device="cpu")
        merged = AutoModelForCausalLM.from_pretrained(result.path)
        assert merged.dtype == torch.float32
        assert torch.equal(merged.lm_head.weight, tuned.lm_head.weight.float())

    @pytest.mark.slow
    def test_missing_weights_is_not_found(self, tmp_path: Path, tiny_model_dir: Path) -> None:
        from tests.unit.trainer.trainer_helpers import make_job

        job = tmp_path / "job.json"
        make_job(tmp_path, tiny_model_dir).save(job)
        done = events_of(run_cli("export", str(job), "--format", "merged", "--out", str(tmp_path / "x")).stdout)[-1]
        assert (done["status"], done["error_code"]) == ("failed", "not_found")
        assert "final weights are not on disk" in done["message"]


class TestGguf:
    @pytest.mark.parametrize("arch", ["llama", "qwen3"])
    def test_gguf_in_llama_cpp_generates_the_merged_models_greedy_tokens(
        self, tmp_path: Path, tiny_models: dict[str, Path], arch: str
    ) -> None:
        from trainer.export.formats import run_export

        model_dir = tiny_models[arch]
        config = fake_finished_run(tmp_path, model_dir)
        ids = prompt_ids(model_dir)
        result = run_export(config, "gguf", tmp_path / "gguf", lambda *a, **k: None, quantization="f32", device="cpu")
        (path,) = result.path.glob("*.gguf")
        assert _llama_cpp_greedy(path, ids) == adapter_greedy(config, ids)
        import numpy as np

        # Logits too: Q/K rows left unpermuted still give these greedy tokens on a random tiny
        # model, but move its logits by 8e-3 (measured; 2e-7 when right).
        assert np.abs(_llama_cpp_logits(path, ids) - adapter_logits(config, ids)).max() < 1e-4

    def test_llama3_rope_scaling_becomes_rope_freqs_that_llama_cpp_applies(self, tmp_path: Path) -> None:
        """Llama 3.1's scaled RoPE (the 8B bench shape's), with an original context of 16 so the
        scaling reaches the prompt's positions. Greedy tokens of a random tiny model do not see
        RoPE, logits do: llama.cpp's differ from transformers' by 2e-7 with rope_freqs and by
        5.5e-3 without them (measured)."""
        import numpy as np
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        from trainer.export.gguf import write_gguf

        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=512, max_position_embeddings=4096, rope_parameters=rope,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model_dir = tmp_path / "llama3-rope"
        AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
        tiny.build_tokenizer().save_pretrained(model_dir)
        ids = prompt_ids(model_dir)
        info = write_gguf(model_dir, tmp_path / "m.gguf", "f32")
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(model_dir).eval()(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(_llama_cpp_logits(info.path, ids) - want).max() < 1e-4

    def test_gguf_carries_the_chat_template_and_special_tokens(self, tmp_path: Path, tiny_model_dir: Path) -> None:
        from gguf import GGUFReader

        from trainer.export.gguf import write_gguf

        info = write_gguf(tiny_model_dir, tmp_path / "m.gguf", "q8_0")
        reader = GGUFReader(info.path)
        fields = {name: reader.fields[name] for name in reader.fields}
        assert _string(fields["tokenizer.chat_template"]) == tiny.CHAT_TEMPLATE
        assert _string(fields["general.architecture"]) == "llama"
        assert _string(fields["tokenizer.ggml.pre"]) == "gpt-2"
        assert int(fields["tokenizer.ggml.eos_token_id"].parts[-1][0]) == 2
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["blk.0.attn_q.weight"] == "Q8_0" and types["output_norm.weight"] == "F32"
        assert len(reader.tensors) == info.tensors == 2 + 1 + 2 * 9

    def test_q8_0_gguf_loads_and_generates_in_llama_cpp(self, tmp_path: Path, tiny_model_dir: Path) -> None:
        from trainer.export.gguf import write_gguf

        info = write_gguf(tiny_model_dir, tmp_path / "m.gguf", "q8_0")
        assert len(_llama_cpp_greedy(info.path, prompt_ids(tiny_model_dir))) == 12

    def test_llama_q_and_k_rows_are_permuted_to_interleaved_rope(self) -> None:
        import torch

        from trainer.export.gguf import _permute_rope_rows

        # One head of dim 4: HF rows [x0, x1, y0, y1] (rotate-half pairs (x0,y0), (x1,y1)) -> [x0, y0, x1, y1].
        weight = torch.arange(4.0).reshape(4, 1)
        assert _permute_rope_rows(weight, heads=1).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]

    def test_unsupported_architecture_names_what_is_supported(self, tmp_path: Path, tiny_models: dict[str, Path]) -> None:
        from trainer.export.gguf import GgufError, write_gguf

        with pytest.raises(GgufError, match="not supported; supported: LlamaForCausalLM"):
            write_gguf(tiny_models["gpt_oss"], tmp_path / "m.gguf")

    def test_unknown_quantization_is_refused(self, tmp_path: Path, tiny_model_dir: Path) -> None:
        from trainer.export.gguf import GgufError, write_gguf

        with pytest.raises(GgufError, match="quantization: 'q4_k' is not one of f32, f16, bf16, q8_0"):
            write_gguf(tiny_model_dir, tmp_path / "m.gguf", "q4_k")


def _string(field) -> str:
    return bytes(field.parts[-1]).decode("utf-8")


def _llama_cpp_greedy(path: Path, ids: list[int], n: int = 12) -> list[int]:
    """Greedy tokens from llama.cpp (llama-cpp-python), fed the same prompt ids."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False, seed=0)
    try:
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if len(out) == n:
                break
        return out
    finally:
        llm.close()


def _llama_cpp_logits(path: Path, ids: list[int]):
    import numpy as np
    from llama_cpp import Llama

    # f32 KV cache (GGML type 0): llama.cpp's default f16 cache alone moves logits by ~3e-3.
    llm = Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False, logits_all=True, type_k=0, type_v=0)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)])
    finally:
        llm.close()
