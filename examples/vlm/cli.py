"""Train the example VLM from the command line or a YAML config, with LightningCLI.

Plain Lightning: the config names the callbacks and the strategy, e.g. every
lightning_speedkit callback and ``strategy: ddp_powersgd``::

    python -m speedkit_examples.vlm.cli fit --config examples/vlm/speedkit.yaml
    python -m speedkit_examples.vlm.cli fit --trainer.strategy ddp_powersgd ...

A strategy name such as ``ddp_powersgd`` means something to Lightning only once
lightning_speedkit is imported (Lightning resolves names from its
``StrategyRegistry`` and loads nothing to fill it), and a config that names no
lightning_speedkit class would import nothing of the kit: so this script imports
it, for the names alone. The model, data and task stay plain Lightning.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_speedkit  # noqa: F401  (registers the strategy names)

from .data import VLMDataModule
from .task import VLMTask


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    return LightningCLI(
        VLMTask, VLMDataModule, args=args, run=run, save_config_kwargs={"overwrite": True}
    )


if __name__ == "__main__":
    main()
