"""Manifests from disk: a YAML file as it is, a kustomize directory as ``kubectl kustomize`` renders it.

``kubectl kustomize`` renders offline (no API server), so an overlay is checked exactly as it would be applied.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from relax.cluster.kuberay.documents import Document, ManifestError, parse_documents

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
RENDER_TIMEOUT_S = 60


def is_kustomization(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in KUSTOMIZATION_FILES)


def render_kustomization(directory: Path) -> str:
    """``kubectl kustomize DIR``'s output; ManifestError (one line) when kubectl is missing or refuses."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise ManifestError(f"{directory}: a kustomize directory needs kubectl to render it (not found on PATH); "
                            f"render it elsewhere (kubectl kustomize {directory} > rendered.yaml) and pass the file")
    try:
        result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                                timeout=RENDER_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ManifestError(f"{directory}: kubectl kustomize did not finish in {RENDER_TIMEOUT_S} s") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no message"])[-1]
        raise ManifestError(f"{directory}: kubectl kustomize failed: {last}")
    return result.stdout


def load_manifests(path: str | Path) -> list[Document]:
    """The documents of a manifest file or a kustomize directory; ManifestError names what is wrong."""
    where = Path(path)
    if is_kustomization(where):
        return parse_documents(render_kustomization(where), str(where))
    if where.is_dir():
        raise ManifestError(f"{where}: a directory without a kustomization.yaml; pass a manifest file or a "
                            "kustomize directory")
    try:
        text = where.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ManifestError(f"{where}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
    return parse_documents(text, str(where))
