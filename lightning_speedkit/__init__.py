"""lightning_speedkit: make Lightning training faster without touching model code.

The public API grows with each component (see ``docs/architecture.md``); today the
package ships the ``speedkit`` command and its ``demo``.
"""

from lightning_speedkit.__about__ import __version__

__all__ = ["__version__"]
