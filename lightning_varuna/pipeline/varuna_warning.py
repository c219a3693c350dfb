"""The category of every warning the package gives, so that a user or a test can filter or raise them."""

from __future__ import annotations

__all__ = ["VarunaDeprecationWarning", "VarunaWarning"]


class VarunaWarning(UserWarning):
    """A warning of lightning-varuna (``-W error::lightning_varuna.VarunaWarning`` makes them errors)."""


class VarunaDeprecationWarning(VarunaWarning, FutureWarning):
    """A form of lightning-varuna's API that still works but will be removed; the message names the new form."""
