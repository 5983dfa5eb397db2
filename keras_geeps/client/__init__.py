"""The worker side: connections to the shards, the parameter cache, clocks."""

from keras_geeps.client.access import AccessHandle, AccessPlan
from keras_geeps.client.client import GeePSClient
from keras_geeps.client.table import Table

__all__ = ["AccessHandle", "AccessPlan", "GeePSClient", "Table"]
