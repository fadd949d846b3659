"""Shared fixtures."""

from tests.support.sandbox import *  # noqa: F401,F403
