"""The built-in engine's native decoder computes what transformers computes, and falls back where it cannot.

Each comparison runs the same batch through ``ModelRunner`` twice — once over the native decoder, once over
transformers' model of the same checkpoint — through every cache operation the engine uses (a left-padded
prefill, decode steps, a join of new rows, dropping finished rows), and compares the logits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax.engines.builtin.decoder import DecoderForCausalLM, load_decoder, native_config, parameter_shapes
from relax.engines.builtin.model_impl import ModelImpl, ModelImplError
from relax.engines.builtin.model_runner import ModelRunner, load_model

CPU = torch.device("cpu")


def transformers_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def run(runner: ModelRunner) -> list[torch.Tensor]:
    """Every logits tensor of a prefill (uneven lengths), decodes, a join, a row dropped, and more decodes."""
    out = [runner.prefill([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]])]
    out.append(runner.decode([20, 21, 22]))
    out.append(runner.decode([23, 24, 25]))
    out.append(runner.join([[30, 31, 32, 33, 34, 35, 36, 37], [40]]))
    out.append(runner.decode([26, 27, 28, 38, 41]))
    runner.keep_rows([0, 2, 4])
    out.append(runner.decode([29, 30, 42]))
    return out


def assert_same_logits(native: torch.nn.Module, reference: torch.nn.Module) -> None:
    ours, theirs = run(ModelRunner(native, CPU, 0)), run(ModelRunner(reference, CPU, 0))
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.shape == b.shape, step
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-5), (step, (a - b).abs().max().item())


def test_the_tiny_qwen3_preset_is_served_natively_with_transformers_logits(tiny_preset) -> None:
    native = load_model(tiny_preset.model_dir, CPU)
    assert isinstance(native, DecoderForCausalLM)
    assert native.lm_head.weight is native.model.embed_tokens.weight  # tied, as the checkpoint says
    assert_same_logits(native, transformers_model(tiny_preset.model_dir))
    # the weight names are the checkpoint's: a state dict of one loads into the other
    reference = transformers_model(tiny_preset.model_dir).state_dict()
    assert set(native.state_dict()) == set(reference)


def llama_checkpoint(root: Path, **overrides) -> Path:
    """A small random Llama (grouped-query attention, biases, untied head) saved the way checkpoints are."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**dict(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                   attention_bias=True, mlp_bias=True, tie_word_embeddings=False, rope_theta=500.0),
                            **overrides})
    model = LlamaForCausalLM(config)
    for param in model.parameters():  # larger than the init's, so that a wrong op shows in the logits
        torch.nn.init.normal_(param, std=0.3)
    model.save_pretrained(root)
    return root


def test_a_llama_with_grouped_query_attention_and_biases_matches_transformers(tmp_path: Path) -> None:
    model_dir = llama_checkpoint(tmp_path / "llama")
    native = load_model(model_dir, CPU)
    assert isinstance(native, DecoderForCausalLM) and native.lm_head.weight is not native.model.embed_tokens.weight
    assert_same_logits(native, transformers_model(model_dir))


def test_a_cache_that_outgrows_its_preallocated_columns_keeps_transformers_logits(tmp_path: Path) -> None:
    """The native cache preallocates columns and grows them by doubling: logits across a growth, a join into
    a grown cache (left padding of unequal capacities) and a row drop after it match transformers'."""
    model_dir = llama_checkpoint(tmp_path / "llama")
    native, reference = load_model(model_dir, CPU), transformers_model(model_dir)

    def long_run(runner: ModelRunner) -> list[torch.Tensor]:
        out = [runner.prefill([[5, 6, 7], [8]])]
        for step in range(70):  # past the first 64 columns
            out.append(runner.decode([10 + step % 50, 11 + step % 40]))
        out.append(runner.join([[30, 31, 32, 33]]))
        out.append(runner.decode([12, 13, 14]))
        runner.keep_rows([0, 2])
        out.extend(runner.decode([15 + step % 30, 16]) for step in range(5))
        return out

    ours, theirs = long_run(ModelRunner(native, CPU, 0)), long_run(ModelRunner(reference, CPU, 0))
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.shape == b.shape, step
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-5), (step, (a - b).abs().max().item())


@pytest.mark.parametrize("impl", [ModelImpl.NATIVE, ModelImpl.TRANSFORMERS])
def test_identical_sequences_are_encoded_once_with_the_logits_of_encoding_each(tmp_path: Path, impl) -> None:
    """A prefill or join encodes each distinct sequence once and repeats its cache rows (the native cache's or
    transformers'): the logits of every step after it are those of encoding every row, duplicates included."""
    model = load_model(llama_checkpoint(tmp_path / "llama"), CPU, impl)

    def steps(runner: ModelRunner) -> list[torch.Tensor]:
        out = [runner.prefill([[5, 6, 7], [8], [5, 6, 7], [5, 6, 7]])]
        out.append(runner.decode([20, 21, 22, 23]))
        out.append(runner.join([[30, 31], [8, 9, 10, 11, 12], [30, 31]]))
        out.append(runner.decode([24, 25, 26, 27, 28, 29, 30]))
        runner.keep_rows([1, 2, 6])
        out.append(runner.decode([31, 32, 33]))
        return out

    every_row = ModelRunner(model, CPU, 0)
    every_row._encode = every_row._encode_rows  # type: ignore[method-assign]
    for step, (a, b) in enumerate(zip(steps(ModelRunner(model, CPU, 0)), steps(every_row), strict=True)):
        assert a.shape == b.shape, step
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-5), (step, (a - b).abs().max().item())


def test_architectures_it_does_not_implement_exactly_are_served_by_transformers(tmp_path: Path) -> None:
    model_dir = llama_checkpoint(tmp_path / "scaled", rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = load_model(model_dir, CPU)
    assert not isinstance(model, DecoderForCausalLM)
    assert_same_logits(model, transformers_model(model_dir))  # the fallback is transformers itself

    base = json.loads((model_dir / "config.json").read_text())
    for change in ({"model_type": "mistral"}, {"hidden_act": "gelu"}, {"use_sliding_window": True},
                   {"layer_types": ["sliding_attention", "full_attention"]},
                   {"quantization_config": {"quant_method": "fp8"}}, {"rope_scaling": None,
                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
                   # transformers reads rope_scaling before rope_parameters
                   {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                   {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}}):
        assert native_config({**base, "rope_scaling": None, "rope_parameters": None, **change}) is None, change
    assert native_config({**base, "rope_scaling": None, "rope_parameters": None}) is not None


def test_weights_that_do_not_fit_the_architecture_are_refused_by_name(tiny_preset, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "broken"
    model_dir.mkdir()
    for name in ("config.json", "generation_config.json"):
        (model_dir / name).write_text((tiny_preset.model_dir / name).read_text())
    weights = load_file(str(tiny_preset.model_dir / "model.safetensors"))
    weights.pop("model.norm.weight")
    weights["model.extra.weight"] = torch.zeros(2)
    save_file(weights, str(model_dir / "model.safetensors"))
    config = native_config(json.loads((model_dir / "config.json").read_text()))
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\], unexpected \['model.extra.weight'\]"):
        load_decoder(model_dir, config)


def test_the_real_smollm2_checkpoint_is_served_natively_with_transformers_logits(smollm2_preset) -> None:
    """A real Llama-family checkpoint (SmolLM2-135M: 9 query heads over 3 key-value heads, tied head)."""
    native = load_model(smollm2_preset.model_dir, CPU)
    assert isinstance(native, DecoderForCausalLM)
    assert native.config.num_key_value_heads < native.config.num_attention_heads
    assert_same_logits(native, transformers_model(smollm2_preset.model_dir))


def test_model_impl_picks_the_implementation_and_native_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    plain = llama_checkpoint(tmp_path / "plain")
    assert isinstance(load_model(plain, CPU, ModelImpl.NATIVE), DecoderForCausalLM)
    assert not isinstance(load_model(plain, CPU, ModelImpl.TRANSFORMERS), DecoderForCausalLM)

    scaled = llama_checkpoint(tmp_path / "scaled", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ModelImplError, match="RoPE is scaled"):
        load_model(scaled, CPU, ModelImpl.NATIVE)
    # the command says so and exits 2 before it binds a port or reads a tokenizer (this checkpoint has none)
    done = subprocess.run([sys.executable, "-m", "relax.cli", "engine", "serve", "--model-path", str(scaled),
                           "--model-impl", "native", "--port", "1"], capture_output=True, text=True, timeout=120)
    err = done.stderr
    assert done.returncode == 2, err
    assert "--model-impl native cannot serve" in err and "use --model-impl auto or transformers" in err
    assert "Traceback" not in err


def test_config_defaults_are_transformers_defaults(tiny_preset) -> None:
    raw = json.loads((tiny_preset.model_dir / "config.json").read_text())
    trimmed = {k: v for k, v in raw.items() if k not in ("head_dim", "max_position_embeddings")}
    config = native_config(trimmed)
    assert (config.head_dim, config.max_position_embeddings) == (128, 32768)  # Qwen3Config's defaults
    assert not native_config({**raw, "mlp_bias": True}).mlp_bias  # Qwen3's MLP has no biases whatever it says


def test_a_distinct_lm_head_is_kept_untied_as_transformers_keeps_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = llama_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["lm_head.weight"] = torch.randn_like(weights["model.embed_tokens.weight"])
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    native = load_model(model_dir, CPU)
    assert isinstance(native, DecoderForCausalLM)
    assert native.lm_head.weight is not native.model.embed_tokens.weight
    assert_same_logits(native, transformers_model(model_dir))


def test_weights_auto_cannot_load_natively_go_to_transformers_and_native_refuses_them(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = llama_checkpoint(tmp_path / "extra")
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # an old checkpoint's leftover
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    assert not isinstance(load_model(model_dir, CPU), DecoderForCausalLM)
    with pytest.raises(ModelImplError, match="unexpected"):
        load_model(model_dir, CPU, ModelImpl.NATIVE)


def test_weights_of_the_wrong_shape_are_refused_by_name(tmp_path: Path) -> None:
    model_dir = llama_checkpoint(tmp_path / "shape")
    raw = json.loads((model_dir / "config.json").read_text())
    config = native_config({**raw, "intermediate_size": 80})
    with pytest.raises(ValueError, match=r"layers.0.mlp.gate_proj.weight \(96, 48\) != \(80, 48\)"):
        load_decoder(model_dir, config)


def test_parameter_shapes_are_the_built_models_without_building_it(tiny_preset) -> None:
    """What pre-flight compares a checkpoint's safetensors headers with (milliseconds, no weights built)."""
    raw = json.loads((tiny_preset.model_dir / "config.json").read_text())
    model = DecoderForCausalLM(native_config(raw))
    assert parameter_shapes(raw) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert parameter_shapes({**raw, "model_type": "gemma"}) is None  # not served natively: transformers decides


@pytest.mark.parametrize("impl", [ModelImpl.AUTO, ModelImpl.TRANSFORMERS])
def test_a_dummy_load_reads_no_weight_file_and_builds_the_same_parameters(tiny_preset, tmp_path: Path,
                                                                          impl: ModelImpl) -> None:
    """--load-format dummy (a joining engine): config.json alone, random weights; the weight file is never opened
    (here it is garbage, which a real load refuses)."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_preset.model_dir, model_dir)
    (model_dir / "model.safetensors").write_bytes(b"garbage" * 100)
    with pytest.raises(Exception):  # noqa: B017 - whichever error the reader gives: the file is read
        load_model(model_dir, CPU, impl)
    dummy = load_model(model_dir, CPU, impl, dummy=True)
    real = load_model(tiny_preset.model_dir, CPU, impl)
    shapes = {name: tuple(p.shape) for name, p in real.named_parameters()}
    assert {name: tuple(p.shape) for name, p in dummy.named_parameters()} == shapes
    assert type(dummy) is type(real)
    assert not all(torch.equal(a, b) for a, b in zip(dummy.parameters(), real.parameters(), strict=True))
    assert all(torch.isfinite(p).all() for p in dummy.parameters())
