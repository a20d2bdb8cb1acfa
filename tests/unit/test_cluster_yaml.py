"""ray_cluster.yaml: parses, and each worker type declares the GPUs its instance type has."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
GPUS = {"m5.2xlarge": 0, "p4d.24xlarge": 8, "g5.12xlarge": 4}  # AWS instance specs


def test_cluster_yaml_is_consistent() -> None:
    cfg = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    assert cfg["provider"]["type"] == "aws"
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    assert types[cfg["head_node_type"]]["resources"]["GPU"] == 0
    seen = set()
    for spec in types.values():
        inst = spec["node_config"]["InstanceType"]
        seen.add(inst)
        assert spec["resources"]["GPU"] == GPUS[inst], inst
        assert spec["min_workers"] <= spec["max_workers"]
    assert {"p4d.24xlarge", "g5.12xlarge"} <= seen
    assert any("plora" in cmd for cmd in cfg["setup_commands"])
    # Ray's token authentication: one token on every node, every `ray start` enforcing it
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in cfg[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token ray start" in c for c in starts), key
