"""Checking the numbers a user gives: seconds, counts.

Every number the magics and the public API take (timeouts, intervals,
restart budgets, counts) goes through :func:`check_number`, so NaN, the
infinities, negatives (and zero where it means nothing) are refused at once
with one plain sentence, instead of being accepted and failing later (a
``nan`` interval crashing every worker, a ``nan`` timeout that never ends).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["DURATION_UNITS", "MAX_SECONDS", "check_number", "describe_number", "parse_duration"]

#: the longest time in seconds a timeout or interval may be (about 31 years; the
#: operating system's waits overflow some way above it)
MAX_SECONDS = 1e9
#: the units a duration may carry (``30s``, ``10m``, ``1h``, ``2d``) and their seconds
DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def describe_number(minimum: float = 0, *, above: bool = False, integer: bool = False,
                    seconds: bool = False, zero: str = "") -> str:
    """What :func:`check_number` asks for, in words: ``"a positive number of
    seconds"``, ``"0 or more seconds"``, ``"a whole number 0 or more"``.

    ``zero`` is what 0 means, when it is allowed and means something special
    (``"off"``): ``"0 (off) or more seconds"``.
    """
    unit = " seconds" if seconds else ""
    if integer:
        bound = f"{minimum + 1 if above else minimum} or more"
        return f"a whole number {bound}" if not seconds else f"{bound}{unit}"
    if above and minimum == 0:
        return f"a positive number of{unit}" if seconds else "a positive number"
    low = f"{minimum:g}" + (f" ({zero})" if zero and minimum == 0 and not above else "")
    return f"more than {low}{unit}" if above else f"{low} or more{unit}"


def check_number(value: Any, name: str = "", *, minimum: float = 0, above: bool = False,
                 integer: bool = False, seconds: bool = False, zero: str = "",
                 maximum: float | None = None) -> Any:
    """``value`` if it is a finite number in range, else ``ValueError``.

    Parameters
    ----------
    value : Any
        The number given (``bool`` is refused: ``True`` is no count).
    name : str
        How the message names it (``"timeout"``, ``"--heartbeat"``); ``""``:
        the message starts with ``"must be"``.
    minimum : float
        The smallest allowed value (default 0: negatives are refused).
    above : bool
        ``minimum`` itself is refused too (``timeout`` must be > 0).
    integer : bool
        Only whole numbers (``int``, not ``2.0``).
    seconds : bool
        A time in seconds: at most :data:`MAX_SECONDS` (unless ``maximum``).
    zero : str
        What 0 means where it is allowed and special (for the message).
    maximum : float, optional
        The largest allowed value.

    Returns
    -------
    int or float
        ``value`` (a float for seconds, an int for whole numbers).

    Raises
    ------
    ValueError
        For NaN, an infinity, a value below ``minimum`` (or equal to it with
        ``above``), above ``maximum``, or a value that is not a (whole) number;
        the message names ``name``, what it must be, and what was given.
    """
    want = describe_number(minimum, above=above, integer=integer, seconds=seconds, zero=zero)
    head = f"{name} must be" if name else "must be"
    if maximum is None and seconds:
        maximum = MAX_SECONDS
    wrong_type = isinstance(value, bool) or not isinstance(
        value, numbers.Integral if integer else numbers.Real)
    if wrong_type:
        raise ValueError(f"{head} {want}, not {value!r} ({type(value).__name__})")
    v = int(value) if integer else float(value)
    if math.isnan(v) or math.isinf(v) or v < minimum or (above and v == minimum):
        raise ValueError(f"{head} {want}, not {value!r}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{head} {want} and at most {maximum:g}, not {value!r}")
    return v


def parse_duration(text: Any, name: str = "", *, above: bool = True) -> float:
    """Seconds of a duration as a user writes it: ``"30s"``, ``"10m"``, ``"1h"``,
    ``"2d"``, ``"1.5h"`` or a bare number of seconds (``"90"``, or an int/float).

    The number goes through :func:`check_number` (seconds; positive with ``above``,
    the default), so NaN, infinities, negatives and zero are refused alike.

    Returns
    -------
    float
        The duration in seconds.

    Raises
    ------
    ValueError
        For text that is not a number with one of the units s, m, h, d, or a
        value :func:`check_number` refuses; the message names ``name``, what
        a duration is, and what was given.
    """
    head = f"{name} must be" if name else "must be"
    want = ("a positive duration" if above else "a duration 0 or more") + \
        ": 30s, 10m, 1h, 2d (or seconds)"
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), "s"
    elif isinstance(text, str):
        t = text.strip().lower()
        unit = t[-1:] if t[-1:] in DURATION_UNITS else "s"
        number = t[:-1] if t[-1:] in DURATION_UNITS else t
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"{head} {want}, not {text!r}") from None
    else:
        raise ValueError(f"{head} {want}, not {text!r} ({type(text).__name__})")
    try:
        check_number(value, above=above, seconds=True)
    except ValueError:
        raise ValueError(f"{head} {want}, not {text!r}") from None
    seconds = value * DURATION_UNITS[unit]
    try:
        return float(check_number(seconds, above=above, seconds=True))
    except ValueError:
        raise ValueError(f"{head} {want} and at most {MAX_SECONDS:g} seconds, "
                         f"not {text!r}") from None
