"""The errors vit_jax raises for what a user gave it; this module imports nothing of vit_jax, so
any module can raise them without importing the others."""


class ConfigError(ValueError):
  """A config value that cannot work; the message is one line naming the field and the fix."""


class WorkdirError(ValueError):
  """A --workdir that cannot be used (in use by another run, not a writable folder); the message
  is one line naming it and the fix."""
