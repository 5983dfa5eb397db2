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


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_geeps' has no attribute {name!r}")
    import importlib  # noqa: PLC0415
    return getattr(importlib.import_module(module), name)


__all__ = ["ClusterSpec", "GeePSError", "GeePSServerError",
           "GeePSTimeoutError", "GeePSWorkerFailedError", *_LAZY]
