"""deploytool: run self-hosted LLM inference servers as systemd services, reproducibly and safely."""

__version__ = "0.2.0"
