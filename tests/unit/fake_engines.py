"""Fake engines for building the rollout without Ray: a launcher whose engines start at once, their HTTP
clients and a weight transport that records what it sent (``rollout.assembly``)."""

from __future__ import annotations

import asyncio
from typing import Any

from relax.engines.client import EngineError, EngineUnavailable
from relax.rollout.pool.launcher import EngineSlot

EOS = 0


class Tokenizer:
    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


class Launcher:
    """Engines "start" at once (``failing`` starts raise); ``dead`` ones report their process gone."""

    def __init__(self) -> None:
        self.started: list[tuple[str, Any]] = []  # (engine id, slot)
        self.stopped: list[str] = []
        self.dead: set[str] = set()
        self.exits: dict[str, str] = {}  # how a dead engine's server exited, as the engine actor's info says it
        self.failing = False

    async def start(self, engine_id: str, slot: EngineSlot, initial_weights: Any = None) -> dict[str, Any]:
        if self.failing:
            raise RuntimeError("no GPU left on the node")
        self.started.append((engine_id, slot))
        return {"url": f"http://{engine_id}", "node_id": "node-1"}

    async def is_alive(self, engine_id: str, timeout_s: float) -> bool:
        return engine_id not in self.dead

    async def info(self, engine_id: str) -> dict[str, Any]:
        exit_text = self.exits.get(engine_id)
        return {"url": f"http://{engine_id}", **({"exit": exit_text} if exit_text else {})}

    async def stop(self, engine_id: str, grace_s: float) -> None:
        self.stopped.append(engine_id)

    def release(self, slot: EngineSlot) -> None:
        return None

    def engine_ids(self) -> list[str]:
        return [engine_id for engine_id, _ in self.started if engine_id not in self.stopped]


class Client:
    """An engine's HTTP face: answers 3 tokens; with ``hold`` set, requests wait for it to be released and then
    find the connection reset if the engine is dead by then."""

    def __init__(self, engine_id: str, launcher: Launcher) -> None:
        self.engine_id, self.launcher = engine_id, launcher
        self.hold: asyncio.Event | None = None
        self.holding = asyncio.Event()
        self.aborted_all = 0
        self.on_abort: Any = None  # what an abort does to the requests (the dispatcher releases them)
        self.refuse: set[tuple[int, ...]] = set()  # prompts (input ids) it answers 400 to

    async def generate(self, **kwargs: Any) -> dict[str, Any]:
        if self.hold is not None:
            self.holding.set()
            await self.hold.wait()
        if self.engine_id in self.launcher.dead:
            raise EngineUnavailable("connection reset", url=f"http://{self.engine_id}", endpoint="/generate")
        if tuple(kwargs.get("input_ids", ())) in self.refuse:
            raise EngineError("the input is longer than the model's context", url=f"http://{self.engine_id}",
                              endpoint="/generate", status_code=400)
        ids = [5, 6, 7]
        return {"text": "abc", "output_ids": ids,
                "meta_info": {"finish_reason": {"type": "length"}, "completion_tokens": 3, "weight_version": "0",
                              "output_token_logprobs": [[-0.1, t, None] for t in ids]}}

    async def health_generate(self, *, timeout: float | None = None) -> None:
        return None

    async def is_healthy(self, *, generate: bool = False, timeout: float | None = None) -> bool:
        return self.engine_id not in self.launcher.dead

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        self.aborted_all += int(abort_all)
        if self.on_abort is not None:
            self.on_abort()

    async def aclose(self) -> None:
        return None


class Transport:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []

    async def send(self, engine_id: str, client: Any, latest: Any, check: Any = None, *,
                   verify_only: bool = False) -> dict[str, Any]:
        self.sent.append((engine_id, latest.version))
        return {"paused_s": 0.0}

    async def forget(self, engine_id: str, client: Any | None) -> None:
        return None
