"""GeePS' memory management: access recording, memory planning, swapping.

- `record_model` records one training step of a Keras model (every table
  read and update, every activation kept for the backward pass, in order,
  with sizes) as an `AccessSequence`, GeePS' virtual iteration.
- `plan` decides from it, under a device-memory budget, which tables stay
  resident on the device and which are staged through a double-buffered
  access pool, and which activations wait in host memory (`MemoryPlan`).
- `LayerwiseTrainer` runs training steps that way, layer by layer, with a
  background prefetcher and writer (`swapping`).

Importing this package imports neither TensorFlow nor Keras; the trainer
does, on first use.
"""

from keras_geeps.memory.planner import MemoryBudgetError, MemoryPlan, plan
from keras_geeps.memory.recorder import (Access, AccessSequence, UnitRecord,
                                         record_model)

__all__ = ["Access", "AccessSequence", "LayerwiseTrainer", "MemoryBudgetError",
           "MemoryPlan", "UnitRecord", "plan", "record_model"]


def __getattr__(name):
    if name == "LayerwiseTrainer":
        from keras_geeps.memory.trainer import (  # noqa: PLC0415
            LayerwiseTrainer)
        return LayerwiseTrainer
    raise AttributeError(f"module 'keras_geeps.memory' has no attribute "
                         f"{name!r}")
