"""Checks of counts and limits given by a user, shared by every layer.

Example:

>>> check_count("max_tables", 8, least=1)
>>> check_count("num_shards", 0, least=1)
Traceback (most recent call last):
...
ValueError: num_shards must be an int >= 1, not 0
"""

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
