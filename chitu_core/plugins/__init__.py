"""Plugin discovery: backends, model architectures and hook plugins found through entry points.

Entry-point groups:
  chitu_core.backends  name -> Backend subclass           (loaded with stevedore, lazily)
  chitu_core.models    HF architecture name -> model class (loaded with stevedore, lazily)
  chitu_core.hooks     name -> module or object with pluggy hook implementations
                       (see ``hookspecs``)

``CHITU_PLUGINS=a,b`` limits loading to entry points whose name or distribution
name is listed. ``python -m chitu_core.plugins`` prints what was found.
"""

from chitu_core.plugins.discovery import (
    BACKENDS_GROUP,
    HOOKS_GROUP,
    MODELS_GROUP,
    backend_ops,
    get_backend,
    load_backend_class,
    load_model_class,
    plugin_manager,
)

__all__ = [
    "BACKENDS_GROUP",
    "HOOKS_GROUP",
    "MODELS_GROUP",
    "backend_ops",
    "get_backend",
    "load_backend_class",
    "load_model_class",
    "plugin_manager",
]
