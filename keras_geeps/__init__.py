"""keras_geeps: a GeePS-style parameter server for Keras 3 and TensorFlow.

Importing the package starts nothing and does not import TensorFlow; the
Keras face (`GeePSStrategy`) and the custom ops load on first use.
"""

__version__ = "0.1.0"

from keras_geeps.cluster import ClusterSpec
from keras_geeps.errors import (GeePSError, GeePSServerError,
                                GeePSTimeoutError, GeePSWorkerFailedError)

_LAZY = {
    "GeePSClient": "keras_geeps.client",
    "ShardServer": "keras_geeps.shard",
    "LocalCluster": "keras_geeps.launch",
    "GeePSStrategy": "keras_geeps.keras",
    "ParameterServerCallback": "keras_geeps.keras",
    "ChiefOnly": "keras_geeps.keras",
}


# Submodules the documentation names as attributes of the package
# (`keras_geeps.auth.ClientKeys(...)`), imported on first use.
_SUBMODULES = {"auth"}


def __getattr__(name):
    import importlib  # noqa: PLC0415
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_geeps.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_geeps' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["ClusterSpec", "GeePSError", "GeePSServerError",
           "GeePSTimeoutError", "GeePSWorkerFailedError", *_LAZY]
