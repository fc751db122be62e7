"""Manifests as documents: YAML text (one or many ``---`` documents) to records, with one line per problem."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from relax.config.flags import ConfigError
from relax.yaml_errors import yaml_error_text


class ManifestError(ConfigError):
    """A manifest that cannot be read at all (a path, a YAML syntax error); the message is one line."""


@dataclass(frozen=True)
class Document:
    """One Kubernetes object of a manifest, and where it came from."""

    source: str  # the file (or kustomize directory) it was read from
    index: int  # its place among the documents of that source
    body: Mapping[str, Any] = field(repr=False)

    @property
    def kind(self) -> str:
        return str(self.body.get("kind", ""))

    @property
    def name(self) -> str:
        metadata = self.body.get("metadata")
        return str(metadata.get("name", "")) if isinstance(metadata, Mapping) else ""

    @property
    def label(self) -> str:
        """``RayCluster/relax-qwen3-4b (k8s/base/raycluster.yaml)``: how findings name it."""
        return f"{self.kind or '?'}/{self.name or '?'} ({self.source})"


def parse_documents(text: str, source: str) -> list[Document]:
    """Every non-empty document of ``text``; raises ManifestError naming the line of a YAML error."""
    try:
        loaded = list(yaml.safe_load_all(text))
    except yaml.YAMLError as error:
        raise ManifestError(f"{source}: {yaml_error_text(error)}") from None
    documents = []
    for index, body in enumerate(loaded):
        if body is None:
            continue
        if not isinstance(body, Mapping) or not body.get("kind") or not body.get("apiVersion"):
            raise ManifestError(f"{source}: document {index + 1} is not a Kubernetes object (it needs apiVersion "
                                "and kind)")
        documents.append(Document(source, index, body))
    if not documents:
        raise ManifestError(f"{source}: holds no Kubernetes objects")
    return documents
