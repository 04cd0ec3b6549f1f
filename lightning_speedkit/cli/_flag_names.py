"""The kit's refusals in the command line's words: Python argument names become flags.

Where a subcommand passes a flag to the kit under another name (``--nprocs`` as
``world_size``), the kit's :class:`~lightning_speedkit.errors.SpeedkitConfigError` names
the Python argument; each subcommand's module lists its ``FLAGS`` (Python name -> flag),
and ``main`` prints the error through :func:`speak_of_flags`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_QUOTED_NAME = re.compile(r"`([A-Za-z_]\w*)(=[^`]*)?`")


def speak_of_flags(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with the Python argument names in ``flags`` written as their flags.

    A name in backticks becomes its flag (```kv_heads=3``` -> ```--kv-heads 3```); a bare
    name with an underscore (``n_params``) too, where it stands as a word of its own.

    Example::

        >>> speak_of_flags("`world_size` must be at least 2, got 1.", {"world_size": "--nprocs"})
        '`--nprocs` must be at least 2, got 1.'
        >>> speak_of_flags("`kv_heads=3` must divide `heads=8`.",
        ...                {"kv_heads": "--kv-heads", "heads": "--heads"})
        '`--kv-heads 3` must divide `--heads 8`.'
    """

    def quoted(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if name not in flags:
            return match.group(0)
        return f"`{flags[name]}{' ' + value[1:] if value else ''}`"

    message = _QUOTED_NAME.sub(quoted, message)
    for name, flag in flags.items():
        if "_" in name:
            message = re.sub(rf"(?<![\w./`-]){re.escape(name)}(?![\w/`-])", flag, message)
    return message
