"""The autoscaler reads the real SGLang's ``/metrics`` (its own exposition, ~500 ``sglang:*`` lines on 0.5.23) and
decides to scale out on a burst: the same scrape, parse, frame and policy the autoscaler service runs."""

from __future__ import annotations

import asyncio

import httpx

from relax.autoscaler.config import AutoscalerConfig
from relax.autoscaler.metrics import GAUGES, build_cluster_frame, parse_engine_metrics
from relax.autoscaler.policy import AutoscalerPolicy, PoolView, ScaleAction
from relax.autoscaler.scrape import scrape_all
from relax.engines.keys import EngineKeys

BURST = 24
TOKENS = 200  # the tiny preset's context is 256 tokens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_burst_on_the_real_engine_reads_as_load_and_the_policy_scales_out(sglang_engine,
                                                                                 sglang_keys: EngineKeys) -> None:
    idle = parse_engine_metrics((await scrape_all({"engine_0": sglang_engine.url}, timeout=10))["engine_0"])
    assert idle.missing(GAUGES) == (), f"SGLang's exposition lacks {idle.missing(GAUGES)}"
    assert idle.max_total_num_tokens and idle.max_total_num_tokens > 0  # the bounded KV pool Relax chose
    clock = Clock()
    config = AutoscalerConfig(enabled=True, min_engines=1, max_engines=4, evaluation_interval_secs=10).patch(
        {"scale_out_policy": {"token_usage_threshold": 0.05, "condition_duration_secs": 0.0},
         "scale_in_policy": {"token_usage_threshold": 0.01}})
    policy = AutoscalerPolicy(config, clock)
    body = {"text": "Count from one to a thousand:", "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True}}
    headers = {"Authorization": f"Bearer {sglang_keys.generation}"}
    async with httpx.AsyncClient(base_url=sglang_engine.url, timeout=300, trust_env=False, headers=headers) as http:
        burst = [asyncio.create_task(http.post("/generate", json=body)) for _ in range(BURST)]
        decisions, loaded = [], None
        try:
            for _ in range(200):  # SGLang refreshes its gauges at prefills and every 40 decode steps
                clock.now += 10
                results = await scrape_all({"engine_0": sglang_engine.url}, timeout=10)
                frame = build_cluster_frame(clock.now, results)
                decision = policy.evaluate(frame, PoolView(1, 1))
                decisions.append(decision.action)
                if (frame.token_usage or 0) > 0.05:
                    loaded = frame
                if decision.action is ScaleAction.SCALE_OUT or all(t.done() for t in burst):
                    break
                await asyncio.sleep(0.1)
        finally:
            answers = await asyncio.gather(*burst)
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200][:1]
    assert loaded is not None and loaded.engines["engine_0"].num_running_reqs, "the burst never showed as load"
    assert decisions[-1] is ScaleAction.SCALE_OUT, decisions
