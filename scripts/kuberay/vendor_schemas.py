"""Derive the vendored KubeRay schemas from KubeRay's CRD files (run again when moving to a new release).

    python scripts/kuberay/vendor_schemas.py [CRD_DIR]      (default: ../shared/kuberay beside the repository)

Reads ``ray.io_rayclusters.yaml`` and ``ray.io_rayjobs.yaml`` of one KubeRay release, checks their sha256
against the release recorded below, and writes the ``v1`` ``openAPIV3Schema`` of each, unchanged, as JSON into
``relax/cluster/kuberay/schemas/`` beside KubeRay's license. Strictness (unknown fields are errors) is added
when a manifest is checked, not here, so the vendored files stay a plain copy of upstream's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "relax" / "cluster" / "kuberay" / "schemas"
RELEASE = "v1.7.0"
COMMIT = "59d663aeec13760646da3db9c1cf8cfe883e30b7"
CRDS = {  # vendored name: (upstream file, sha256)
    "raycluster.v1.json": ("ray.io_rayclusters.yaml",
                           "c44704442eef0c6721ad40c1d66782c8bd3fdab9d3344306a5820910a679baa1"),
    "rayjob.v1.json": ("ray.io_rayjobs.yaml", "01a5cf3b17c1769fda44af7e82debcd98722f0c27b9ab84d084681c6649121f5"),
}


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else REPO.parent / "shared" / "kuberay"
    OUT.mkdir(parents=True, exist_ok=True)
    for target, (name, sha256) in CRDS.items():
        raw = (source / name).read_bytes()
        if hashlib.sha256(raw).hexdigest() != sha256:
            print(f"vendor_schemas: {source / name} is not KubeRay {RELEASE}'s (sha256 differs); update CRDS",
                  file=sys.stderr)
            return 1
        crd = yaml.safe_load(raw)
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schema = {"x-relax-source": {"release": RELEASE, "commit": COMMIT, "file": name, "sha256": sha256,
                                     "kind": crd["spec"]["names"]["kind"]},
                  **version["schema"]["openAPIV3Schema"]}
        (OUT / target).write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
        print(f"wrote {OUT / target} from {name} ({len(raw):,} bytes)")
    shutil.copyfile(source / "LICENSE.kuberay", OUT / "LICENSE.kuberay")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
