"""Exceptions raised to keras_geeps users."""


class GeePSError(RuntimeError):
    """Base class of keras_geeps runtime errors."""

    # Built from its message alone, as Exception is: raised while
    # TensorFlow traces a user's tf.function (a step that trains a
    # variable outside the strategy's scope), AutoGraph can then rebuild
    # it with the user's source lines added, keeping its class, where it
    # would otherwise make a StagingError of it.
    __init__ = Exception.__init__


class GeePSTimeoutError(GeePSError, TimeoutError):
    """A bounded wait ran out: a shard is dead or workers are behind.

    The message names the shard(s) that did not answer, or the workers whose
    clocks hold the others back.
    """


class GeePSServerError(GeePSError):
    """A shard refused a request; the message is the shard's explanation.

    Attributes:
        code: the refusal's code (`protocol.ERROR_*`), or None.
    """

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code


class GeePSWorkerFailedError(GeePSError):
    """A shard declared a worker dead (no heartbeat); the job stops."""
