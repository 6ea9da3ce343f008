"""dflash-audit: a conformant DFlash drafter and a conformance audit against the reference."""

__version__ = "0.1.0"
