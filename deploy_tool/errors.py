"""One error hierarchy, each kind with its own exit code; mapped to one red line (plus a hint) at the CLI edge.

Every failure a user can cause or meet raises a DeployError subclass. Anything else that escapes is a bug:
the CLI prints a one-line internal-error message (exit 70) and shows the traceback only with --debug.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # done: what was asked happened, or was already so
    USAGE = 2  # click's own code for bad command-line usage
    CONFIG = 3  # the YAML config is malformed, mistyped or names unknown keys
    CHECK_FAILED = 4  # `check` found pitfalls of severity error
    INPUT = 5  # a file named by the config or the command line is missing, unreadable or not what it should be
    BUNDLE = 6  # bundle signature, hash, size, mode or layout is wrong
    DRIFT = 7  # `verify`: the environment differs from the pinned fingerprints
    SYSTEMD = 8  # systemctl/journalctl failed or cannot be reached
    HEALTH = 9  # a backend did not become healthy
    ROLLED_BACK = 10  # switch failed and the previous backend was restored
    ROLLBACK_FAILED = 11  # switch failed and the previous backend could not be restored either
    LOCKED = 12  # another deploytool operation holds the lock
    STATE = 13  # state on disk is inconsistent or an interrupted operation needs `recover`
    INSTALL = 14  # install failed (nothing half-installed is left behind)
    SANDBOX = 15  # the systemd sandbox cannot be set up, reached or torn down
    MISSING_TOOL = 16  # an external program is not installed
    OS = 17  # disk full, permission denied and other operating-system errors
    RUNTIME = 18  # the running process loaded something other than what was pinned
    PERFORMANCE = 19  # the performance gate found a regression
    # `deploytool status` only, like `systemctl is-active`: what the box is doing (0 = serving as recorded)
    DEGRADED = 20  # serving, but a backend's fingerprints drifted, a fallback unit failed, or systemd is unreachable
    PENDING = 21  # serving, but an interrupted operation awaits `deploytool recover`
    NOT_SERVING = 22  # no backend serves the model: none active, its unit is down, or its health check fails
    UNSAFE_PATH = 23  # a path a root step reads is not root's alone (another owner, or writable by group/other)
    DOWNGRADE = 24  # the bundle's sequence is lower than the highest this box installed for its name
    KEY = 25  # the bundle's signing key is revoked or expired, or the keys directory's key metadata is malformed
    GPU = 30  # a cuda backend's GPUs are missing on the box, closed to its user, or not held by its server
    INTERNAL = 70  # a bug in deploytool


class DeployError(Exception):
    """Base of every expected failure: `message` says what failed, `hint` says what to do about it."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, *, hint: str | None = None, details: object = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"error": type(self).__name__, "message": self.message,
                                  "exit_code": int(self.exit_code)}
        if self.hint:
            out["hint"] = self.hint
        if self.details is not None:
            out["details"] = self.details
        return out


class ConfigError(DeployError):
    exit_code = ExitCode.CONFIG


class CheckFailed(DeployError):
    exit_code = ExitCode.CHECK_FAILED


class InputError(DeployError):
    exit_code = ExitCode.INPUT


class BundleError(DeployError):
    exit_code = ExitCode.BUNDLE


class DriftError(DeployError):
    exit_code = ExitCode.DRIFT


class SystemdError(DeployError):
    exit_code = ExitCode.SYSTEMD


class HealthError(DeployError):
    exit_code = ExitCode.HEALTH


class RolledBack(DeployError):
    exit_code = ExitCode.ROLLED_BACK


class RollbackFailed(DeployError):
    exit_code = ExitCode.ROLLBACK_FAILED


class LockedError(DeployError):
    exit_code = ExitCode.LOCKED


class StateError(DeployError):
    exit_code = ExitCode.STATE


class InstallError(DeployError):
    exit_code = ExitCode.INSTALL


class SandboxError(DeployError):
    exit_code = ExitCode.SANDBOX


class MissingTool(DeployError):
    exit_code = ExitCode.MISSING_TOOL


class OSFailure(DeployError):
    exit_code = ExitCode.OS


class RuntimeTruthError(DeployError):
    exit_code = ExitCode.RUNTIME


class PerformanceError(DeployError):
    exit_code = ExitCode.PERFORMANCE


class UnsafePathError(DeployError):
    """StrictModes (deploy_tool.strictmodes): refused before anything changed."""

    exit_code = ExitCode.UNSAFE_PATH


class DowngradeError(DeployError):
    """A bundle older than what the box installed (deploy_tool.box.sequence): refused before anything changed."""

    exit_code = ExitCode.DOWNGRADE


class KeyRefused(DeployError):
    """A revoked or expired signing key, or malformed key metadata (deploy_tool.keyring)."""

    exit_code = ExitCode.KEY


class GpuError(DeployError):
    exit_code = ExitCode.GPU
