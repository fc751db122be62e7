"""An engine's server SIGKILLed mid-generation, no notice: what the run must still hold (shared by
tests/e2e/test_elastic_training.py, whose run it happens in, and tests/sglang/test_crash.py).

What a crash without notice (OOM killer, a GPU fault) does to a run: the engine's streams break; each of its
requests continues on the surviving engine from the last chunk the manager held (``relax.rollout.dispatch.dispatcher``);
the dead initial engine is replaced in its own bundle. The rollout temperature is high so that the tiny model's
responses run to the length limit (it would otherwise answer in 4 tokens): long generations, as in the recipe.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from relax.testing.engine_processes import engine_server_pid

MAX_NEW_TOKENS = 96
BATCH, N = 4, 4
#: long generations: every response runs to the length limit
CRASH_GRPO = {"rollout_batch_size": BATCH, "n_samples_per_prompt": N, "max_new_tokens": MAX_NEW_TOKENS,
              "temperature": 25.0, "lr": 1e-4, "eps_clip": 0.2, "eps_clip_high": 0.28}


def batch(engine: httpx.Client) -> tuple[int, int]:
    """(requests running, tokens they hold: prompts + outputs), from the engine's open ``/metrics``."""
    text = engine.get("/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return int(values["sglang:num_running_reqs"]), int(values["sglang:num_used_tokens"])


def server_pid(driver_pid: int, url: str) -> int:
    """The built-in engine server serving ``url``: a descendant of the driver whose argv names its port."""
    pid = engine_server_pid(driver_pid, url)
    assert pid is not None, f"no engine server for {url} under the driver"
    return pid


def assert_crash_lost_nothing(text: str, run_dir: Path, *, steps: int) -> int:
    """After an engine died mid-generation: its requests continued from their prefixes (no token regenerated),
    every step has its BATCH groups of N samples exactly once, and stitched samples' version spans cover every
    token in order. Returns how many requests continued on another engine.

    The continuations are read from the run's own summary (the manager's migration counters, per step in
    metrics.jsonl): durable files, unlike an actor's log lines that Ray may not have forwarded when the run ends
    seconds after the crash."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["migrated_requests"] >= 1 and summary["migration_tokens_kept"] >= 1, (summary, text[-3000:])
    assert summary["migration_tokens_regenerated"] == 0, summary  # every streamed token kept
    samples_path = run_dir / "samples.jsonl"
    samples = [json.loads(line) for line in samples_path.read_text().splitlines()]
    by_step: dict[int, list[dict]] = {}
    for s in samples:
        by_step.setdefault(s["step"], []).append(s)
    assert sorted(by_step) == list(range(steps))
    for step, rows in by_step.items():  # every sample exactly once: BATCH groups of N, no duplicate
        assert len(rows) == BATCH * N, step
        groups: dict[int, set[int]] = {}
        for s in rows:
            groups.setdefault(s["prompt_index"], set()).add(s["sample_index"])
        assert sorted(map(sorted, groups.values())) == [list(range(N))] * BATCH, (step, groups)
        for s in rows:  # stitched samples are whole: their version spans cover every token, in order
            ids = s["response_token_ids"]
            assert 0 < len(ids) <= MAX_NEW_TOKENS
            spans = s["weight_version_spans"]
            assert spans[0][1] == 0 and spans[-1][2] == len(ids)
            assert all(a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False))
    return int(summary["migrated_requests"])
