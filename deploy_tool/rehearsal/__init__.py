"""What is only for rehearsal: the sandboxed real systemd, the benchmark client and its charts."""
