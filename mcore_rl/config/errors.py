"""The one exception type for bad configuration, so callers can catch it before any process starts."""


class ConfigError(Exception):
    """A recipe or override is unusable; the message names the dotted key at fault."""
