"""The setup error of an audit: a usage or setup problem, reported as one message (exit 2)."""

EXIT_SETUP = 2  # 0 pass and 1 fail come from the report's verdict


class CompareSetupError(Exception):
    """A usage or setup error: the message says what is wrong and what to do (exit 2)."""
