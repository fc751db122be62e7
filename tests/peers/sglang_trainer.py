"""A trainer that updates an SGLang engine's weights the way slime and verl do it, over HTTP + torch.distributed.

Per the contract: pick a port, ``POST /init_weights_update_group`` while joining the same group as rank 0 (the
HTTP call returns only once the group exists, so the two run at once), then per version
``/begin_weight_update``, one ``/update_weights_from_distributed`` per bucket while broadcasting that bucket's
tensors from rank 0 — one broadcast per tensor in ``names`` order, or with ``load_format: "flattened_bucket"``
one uint8 broadcast of the tensors' bytes concatenated in ``names`` order — then ``/end_weight_update``;
``/destroy_weights_update_group`` at the end.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch
import torch.distributed as dist

from tests.peers.sglang_group import sglang_process_group


class SGLangStyleTrainer:
    def __init__(self, engine_url: str, *, group_name: str = "weight_update_group", api_key: str | None = None,
                 timeout_s: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=engine_url, headers=headers, timeout=timeout_s + 30, trust_env=False)
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.group: dist.ProcessGroup | None = None
        self.calls = ThreadPoolExecutor(max_workers=1)

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(route, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{route} -> {response.status_code}: {response.text}")
        return response.json() if response.content else {}

    def init_group(self, master_address: str = "127.0.0.1") -> None:
        with socket.socket() as sock:
            sock.bind((master_address, 0))
            port = sock.getsockname()[1]
        call = self.calls.submit(self._post, "/init_weights_update_group", {
            "master_address": master_address, "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": self.group_name, "backend": "gloo"})
        self.group = sglang_process_group(master_address, port, 0, 2, self.group_name, "gloo", self.timeout_s)
        answer = call.result(timeout=self.timeout_s + 30)
        assert answer.get("success", True), answer

    def update_per_tensor(self, state: Mapping[str, torch.Tensor], version: str) -> None:
        """One bucket, one broadcast per tensor in ``names`` order."""
        names = list(state)
        body = {"names": names, "dtypes": [str(state[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(state[n].shape) for n in names], "group_name": self.group_name,
                "weight_version": version}
        self._post("/begin_weight_update", {})
        call = self.calls.submit(self._post, "/update_weights_from_distributed", body)
        for name in names:
            dist.broadcast(state[name].contiguous(), src=0, group=self.group)
        call.result(timeout=self.timeout_s + 30)
        self._post("/end_weight_update", {})

    def update_flattened(self, state: Mapping[str, torch.Tensor], version: str, bucket_bytes: int) -> int:
        """Buckets of at most ``bucket_bytes``, each one uint8 broadcast; the version rides on the last."""
        buckets: list[list[str]] = [[]]
        size = 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += nbytes
        self._post("/begin_weight_update", {})
        for i, names in enumerate(buckets):
            flat = torch.cat([state[n].contiguous().view(-1).view(torch.uint8) for n in names])
            body = {"names": names, "dtypes": [str(state[n].dtype).removeprefix("torch.") for n in names],
                    "shapes": [list(state[n].shape) for n in names], "group_name": self.group_name,
                    "load_format": "flattened_bucket",
                    "weight_version": version if i == len(buckets) - 1 else None}
            call = self.calls.submit(self._post, "/update_weights_from_distributed", body)
            dist.broadcast(flat, src=0, group=self.group)
            call.result(timeout=self.timeout_s + 30)
        self._post("/end_weight_update", {})
        return len(buckets)

    def destroy(self) -> None:
        self._post("/destroy_weights_update_group", {"group_name": self.group_name})
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def close(self) -> None:
        self.calls.shutdown(wait=False, cancel_futures=True)
        self.http.close()
