"""The category of every warning the package gives, so that a user or a test can filter or raise them."""

from __future__ import annotations

__all__ = ["VarunaWarning"]


class VarunaWarning(UserWarning):
    """A warning of lightning-varuna (``-W error::lightning_varuna.VarunaWarning`` makes them errors)."""

