"""Training with real SGLang engines, configured by Relax alone: ``--rollout-backend sglang --sglang-python PATH``
and no ``--sglang-*`` flag.

Every refit is verified: while the run trains, a watcher reads each engine's served weights through SGLang's
own ``/weights_checker`` (per-tensor SHA-256) whenever its ``/model_info`` says which version it serves, and
after the run each observation is compared with the trainer's checkpoint of that version (``--save-interval
1``), laid out and cast as SGLang serves it (``relax.weights.digest``): every tensor, every version,
every engine.
"""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from safetensors.torch import load_file

from relax.demo.local import train_argv
from relax.engines.keys import EngineKeys
from relax.presets.smollm2 import SMOLLM2_GRPO
from relax.training.checkpoint import checkpoint_name
from relax.weights.digest import checksum_mismatches, sglang_checksums

pytestmark = pytest.mark.timeout(900)

KEYS_FILE = re.compile(r"^(?P<engine>engine_\d+)-(?P<port>\d+)\.log\.keys\.yaml$")


class RefitWatcher:
    """Polls every engine of a run for (served version, per-tensor checksums); also checks that no process on
    the machine shows an engine key in its command line while the engines run."""

    def __init__(self, engines_dir: Path) -> None:
        self.engines_dir = engines_dir
        self.seen: dict[str, dict[int, dict[str, str]]] = {}  # engine -> version -> checksums
        self.keys_in_argv: list[str] = []
        self._engines: dict[str, tuple[str, EngineKeys]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="refit-watcher", daemon=True)

    def __enter__(self) -> RefitWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _discover(self) -> None:
        for path in self.engines_dir.glob("*.keys.yaml") if self.engines_dir.is_dir() else ():
            match = KEYS_FILE.match(path.name)
            if match and match["engine"] not in self._engines:
                try:
                    keys = yaml.safe_load(path.read_text())  # the run's user may read it; nobody else can
                except OSError:
                    continue
                self._engines[match["engine"]] = (f"http://127.0.0.1:{match['port']}",
                                                  EngineKeys(keys["api-key"], keys["admin-api-key"]))
                self._check_argv(self._engines[match["engine"]][1])

    def _check_argv(self, keys: EngineKeys) -> None:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                text = cmdline.read_bytes().decode(errors="replace")
            except OSError:
                continue
            if keys.generation in text or keys.admin in text:
                self.keys_in_argv.append(text.replace("\0", " ")[:200])

    def _run(self) -> None:
        with httpx.Client(timeout=10, trust_env=False) as http:
            while not self._stop.is_set():
                self._discover()
                for engine, (url, keys) in list(self._engines.items()):
                    try:
                        self._observe(http, engine, url, keys)
                    except (httpx.HTTPError, KeyError, ValueError):
                        continue  # starting, syncing or gone: the next round looks again
                self._stop.wait(0.02)

    def _observe(self, http: httpx.Client, engine: str, url: str, keys: EngineKeys) -> None:
        def version() -> int:
            answer = http.get(url + "/model_info", headers={"Authorization": f"Bearer {keys.generation}"})
            return int(answer.json()["weight_version"])

        before = version()
        if before in self.seen.get(engine, {}):
            return
        answer = http.post(url + "/weights_checker", json={"action": "checksum"},
                           headers={"Authorization": f"Bearer {keys.admin}"})
        answer.raise_for_status()
        if version() == before:  # no refit in between: these checksums are version `before`'s
            self.seen.setdefault(engine, {})[before] = answer.json()["ranks"][0]["checksums"]


def expected_checksums(model_dir: Path, save_dir: Path, version: int) -> dict[str, str]:
    """What an engine serving ``version`` must hold: the checkpoint of that step (the base model for 0), in bf16."""
    source = model_dir if version == 0 else save_dir / checkpoint_name(version)
    return sglang_checksums(load_file(str(source / "model.safetensors")), torch.bfloat16)


def run_and_watch(preset, out: Path, sglang_python: str, *extra: str, steps: int, engines: int,
                  timeout_s: float = 600, **train: Any) -> tuple[subprocess.CompletedProcess, RefitWatcher]:
    argv = train_argv(preset, out, num_rollout=steps, max_staleness=0, trainer_gpus=1, rollout_gpus=engines, **train,
                      extra=("--rollout-backend", "sglang", "--sglang-python", sglang_python,
                             "--save", str(out / "ckpt"), "--save-interval", "1", *extra))
    out.mkdir(parents=True, exist_ok=True)
    with RefitWatcher(out / "engines") as watcher:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    (out / "driver.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result, watcher


def assert_every_refit_verified(preset, out: Path, watcher: RefitWatcher, *, steps: int, engines: int) -> None:
    assert not watcher.keys_in_argv, f"an engine key in a command line: {watcher.keys_in_argv}"
    assert sorted(watcher.seen) == [f"engine_{i}" for i in range(engines)], watcher.seen.keys()
    for engine, versions in sorted(watcher.seen.items()):
        # on-policy (--max-staleness 0): every version is served for a whole rollout, so none slips past
        assert sorted(versions) == list(range(steps + 1)), f"{engine} was seen serving {sorted(versions)}"
        for version, served in sorted(versions.items()):
            wrong = checksum_mismatches(expected_checksums(preset.model_dir, out / "ckpt", version), served)
            assert not wrong, f"{engine} v{version}: served tensors differ from the trainer's: {wrong}"


def test_two_real_engines_train_with_no_sglang_flag_and_every_refit_is_verified(tiny_preset, sglang_python: str,
                                                                             tmp_path: Path) -> None:
    """Tiny preset, 2 real SGLang engines on CPU, weights by broadcast in ``in_place`` mode (whose cache flush
    SGLang refuses while requests run; Relax no longer asks for one)."""
    steps = 5
    result, watcher = run_and_watch(tiny_preset, tmp_path / "run", sglang_python,
                                    "--weight-sync-pause-mode", "in_place", steps=steps, engines=2)
    log = result.stdout + result.stderr
    assert "SGLang CPU platform: bf16" in log  # Relax chose the CPU platform itself
    assert f"training step {steps}/{steps}" in log
    assert "killing" not in log and "SIGKILL" not in log  # every engine stop was SGLang's own shutdown
    assert_every_refit_verified(tiny_preset, tmp_path / "run", watcher, steps=steps, engines=2)


def test_smollm2_trains_on_a_real_sglang_engine(smollm2_preset, sglang_python: str, tmp_path: Path) -> None:
    """A real pretrained model (SmolLM2-135M, 272 tensors) through the same path: 2 steps, every refit verified."""
    steps = 2
    grpo = {**SMOLLM2_GRPO, "rollout_batch_size": 2, "n_samples_per_prompt": 2, "max_new_tokens": 24}
    _, watcher = run_and_watch(smollm2_preset, tmp_path / "run", sglang_python, steps=steps, engines=1, grpo=grpo,
                               rm_type="last-number")
    assert_every_refit_verified(smollm2_preset, tmp_path / "run", watcher, steps=steps, engines=1)
