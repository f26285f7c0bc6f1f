"""The MLflow model registry: publish what passed its gate, promote, roll back, resolve.

Aliases only (MLflow's stages are deprecated): a new version gets `candidate`;
`promote` moves `champion` to it and keeps the one before as `previous`; `rollback`
moves `champion` back to `previous` in one call. Every move is also written as tags on
the versions involved (time and reason), so the registry holds the history.
"""

from quantpipe.registry.publish import (
    DEFAULT_REGISTRY,
    RegistryError,
    promote,
    publish,
    resolve_model_uri,
    resolve_registry_uri,
    rollback,
    source_model,
    version_with_artifact,
)

__all__ = ["DEFAULT_REGISTRY", "RegistryError", "promote", "publish", "resolve_model_uri", "resolve_registry_uri",
           "rollback", "source_model", "version_with_artifact"]
