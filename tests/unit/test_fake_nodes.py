"""relax.cluster.fake_nodes: what tells one fake node's folders from another's (the cluster test runs them)."""

from __future__ import annotations

import pytest

from relax.cluster.fake_nodes import MODULE_PATH, SeparateFakeNodeProvider, runtime_env_dir_name
from relax.cluster.local_elastic import FAKE_NODE_PROVIDER, ElasticClusterConfig


def test_each_fake_node_has_its_own_runtime_env_folder() -> None:
    first = runtime_env_dir_name("fffffffffffffffffffffffffffffffffffffffffffffffffff00001")
    second = runtime_env_dir_name("fffffffffffffffffffffffffffffffffffffffffffffffffff00002")
    assert first == "runtime_resources_00001" and second == "runtime_resources_00002"
    assert "runtime_resources" not in (first, second)  # the head's, Ray's default name


def test_the_cluster_config_loads_this_provider() -> None:
    assert FAKE_NODE_PROVIDER == MODULE_PATH
    provider = ElasticClusterConfig().autoscaling_config("127.0.0.1:6380")["provider"]
    assert (provider["type"], provider["module"]) == ("external", MODULE_PATH)


def test_a_config_without_the_gcs_address_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_FAKE_CLUSTER", "1")
    with pytest.raises(ValueError, match="gcs_address"):
        SeparateFakeNodeProvider({"type": "external", "module": MODULE_PATH}, "c")
