"""Checks of counts, limits and seconds given by a user, shared by every
layer: each refusal names the value as the user called it.

Example:

>>> check_count("max_tables", 8, least=1)
>>> check_count("num_shards", 0, least=1)
Traceback (most recent call last):
...
ValueError: num_shards must be an int >= 1, not 0
>>> check_index("worker_id", 2, 2)
Traceback (most recent call last):
...
ValueError: worker_id 2 is not in [0, 2)
>>> check_seconds("timeout", "2")
Traceback (most recent call last):
...
ValueError: timeout must be a number of seconds > 0, not '2'
"""

import math
import numbers


def check_count(name, value, least):
    """Raises ValueError, naming `name`, unless `value` is an integer (of
    any integral type, never a bool) of at least `least`.

    Args:
        name: what the value is called where the user gave it.
        value: the value to check.
        least: the smallest value allowed.

    Raises:
        ValueError: "<name> must be an int >= <least>, not <value>".
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or value < least:
        raise ValueError(f"{name} must be an int >= {least}, not {value!r}")


def check_index(name, value, count):
    """Raises ValueError, naming `name`, unless `value` is an integer in
    [0, count) (`check_count`'s refusal for one that is no int >= 0).

    Args:
        name: what the value is called where the user gave it.
        value: the value to check.
        count: how many there are (shards, workers).

    Raises:
        ValueError: "<name> <value> is not in [0, <count>)".
    """
    check_count(name, value, 0)
    if value >= count:
        raise ValueError(f"{name} {value} is not in [0, {count})")


def check_seconds(name, value, zero_means=None):
    """Raises ValueError, naming `name`, unless `value` is a finite real
    number of seconds above 0 (or 0 too, with `zero_means`).

    Args:
        name: what the value is called where the user gave it.
        value: the value to check.
        zero_means: what 0 means, where 0 is allowed ("never", say);
            None (the default) where it is not.

    Raises:
        ValueError: "<name> must be a number of seconds > 0, not <value>"
            (">= 0 (0: <zero_means>)" with `zero_means`).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not math.isfinite(value) or value < 0 or \
            (value == 0 and not zero_means):
        bound = f">= 0 (0: {zero_means})" if zero_means else "> 0"
        raise ValueError(f"{name} must be a number of seconds {bound}, not "
                         f"{value!r}")


def check_device(device):
    """Raises ValueError unless `device` names one of this process's
    TensorFlow devices ("/gpu:0", "GPU:1", "/device:CPU:0"): TensorFlow
    would place the work elsewhere without a word.

    Args:
        device: the device name the user gave.
    """
    import tensorflow as tf  # noqa: PLC0415 - the shards never load it
    try:
        spec = tf.DeviceSpec.from_string(device)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"device {device!r} is not a device name "
                         f"('/gpu:0', '/cpu:0'): {exc}") from None
    have = [tf.DeviceSpec.from_string(d.name)
            for d in tf.config.list_logical_devices()]
    if not spec.device_type or not any(
            d.device_type == spec.device_type.upper()
            and d.device_index == (spec.device_index or 0) for d in have):
        raise ValueError(f"device {device!r} is none of this process's "
                         f"devices: {[d.to_string() for d in have]}")
