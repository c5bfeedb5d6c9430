"""The test suite's settings: the real ones, with a key only tests use.

Settings refuse to start without SECRET_KEY unless DEBUG is on, and the suite runs with DEBUG
off like production. The key is put in the environment (not just here) so that the child
processes the tests start (servers, workers, commands) share it.
"""

import os

os.environ.setdefault("SECRET_KEY", "tests-only-not-a-secret-" + "0" * 40)
# Production refuses to start without a model; the suite drives agents with the offline one, and
# its demo scripts, on purpose.
os.environ.setdefault("AGENT_MODEL", "scripted")
os.environ.setdefault("SCRIPTED_DEFAULT_SCRIPTS", "true")

from config.settings import *  # noqa: F403 - the real settings, with the key set above
