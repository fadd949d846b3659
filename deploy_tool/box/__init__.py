"""What runs on the box: install, switch and recovery (operations), the state journal, the systemd driver,
the health gate, the fingerprints the units' ExecStartPre verifies, status and the runtime truth."""
