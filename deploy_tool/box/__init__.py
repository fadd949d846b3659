"""What runs on the box: install, switch and recovery (operations), the state journal, the systemd driver,
the fingerprints the units' ExecStartPre verifies, status and the runtime truth; the probes that look at a running
backend (health, readiness, the gate, performance, drain, liveness) are its wing probe/."""
