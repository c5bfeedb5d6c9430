"""Typed readers for environment variables.

Each reader fails loudly, naming the variable, so that a typo in a deployment stops start-up
instead of silently running with a default nobody chose.
"""

import os

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return value.strip()


def env_str(name: str, default: str) -> str:
    value = _raw(name)
    return default if value is None or value == "" else value


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(
        f"{name}={value!r} is not a boolean: use one of true/false, yes/no, on/off, 1/0."
    )


def env_int(name: str, default: int | None, *, minimum: int | None = None) -> int | None:
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a whole number.") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} is too small: it must be at least {minimum}.")
    return number


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number.") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} is too small: it must be at least {minimum}.")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


_RATE_PERIODS = {"s", "sec", "second", "m", "min", "minute", "h", "hour", "d", "day"}


def env_rate(name: str, default: str | None) -> str | None:
    """A request rate such as `60/min` (DRF's form: N per s, min, hour or day); `off` for none."""
    value = _raw(name)
    if value is None or value == "":
        return default
    if value.lower() in {"off", "none"}:
        return None
    count, _, period = value.partition("/")
    if not count.isdigit() or int(count) < 1 or period.lower() not in _RATE_PERIODS:
        raise ImproperlyConfigured(
            f"{name}={value!r} is not a rate: write requests per period, e.g. 60/min, 1000/hour or 5/s (or off)."
        )
    return f"{int(count)}/{period.lower()}"

