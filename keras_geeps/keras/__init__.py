"""The Keras face: `GeePSStrategy`, its callbacks, and the parameter sync."""

from keras_geeps.keras.callbacks import ChiefOnly, ParameterServerCallback
from keras_geeps.keras.strategy import GeePSStrategy
from keras_geeps.keras.sync import ParameterSync

__all__ = ["ChiefOnly", "GeePSStrategy", "ParameterServerCallback",
           "ParameterSync"]
