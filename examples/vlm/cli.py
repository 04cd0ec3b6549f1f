"""Train the example VLM from the command line or a YAML config, with LightningCLI.

Plain Lightning: the config names the callbacks and the strategy, e.g. every
lightning_speedkit callback and ``strategy: ddp_powersgd``::

    python -m speedkit_examples.vlm.cli fit --config examples/vlm/speedkit.yaml
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from .data import VLMDataModule
from .task import VLMTask


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    return LightningCLI(
        VLMTask, VLMDataModule, args=args, run=run, save_config_kwargs={"overwrite": True}
    )


if __name__ == "__main__":
    main()
