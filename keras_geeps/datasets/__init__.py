"""Real data for the keras_geeps jobs, read from local files only.

Each dataset is a tensorflow-datasets builder over files a Debian package
installs, so a job never touches the network. Importing this package imports
neither TensorFlow nor tensorflow-datasets; `load` and `info` import them on
first use.

Example:

```python
from keras_geeps import datasets

train = datasets.fashion_mnist.load("train").batch(128)
```
"""

import importlib

_SUBMODULES = ("fashion_mnist",)


def __getattr__(name):
    if name not in _SUBMODULES:
        raise AttributeError(
            f"module 'keras_geeps.datasets' has no attribute {name!r}")
    return importlib.import_module(f"keras_geeps.datasets.{name}")


__all__ = list(_SUBMODULES)
