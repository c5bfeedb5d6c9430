from . import agent  # noqa: F401 - `adk web` convention: the package exposes its agent module
