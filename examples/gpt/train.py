"""Train the GPT example with LightningCLI.

    python examples/gpt/train.py fit --config examples/gpt/config.yaml

Importing ``lightning_varuna`` registers the strategy name ``"varuna"`` (used by ``config_registered.yaml``);
``config.yaml`` names the class by its import path instead and would work without the import.
"""

from data import StdlibText
from lightning.pytorch.cli import LightningCLI
from model import GPT

import lightning_varuna  # noqa: F401  (registers strategy="varuna" before the CLI parses the config)


class GPTCLI(LightningCLI):
    """LightningCLI that keeps the model's ``block_size`` equal to the data's."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.block_size", "model.block_size")


def main() -> None:
    GPTCLI(GPT, StdlibText, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
