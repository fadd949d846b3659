"""The probes: what looks at a running backend from outside, over its port and its process: health (readiness and
one real chat completion), ready (the units' ExecStartPost readiness wait), the gate (readiness, smoke, runtime
truth, the performance step), perf (the streaming client and its figures), drain (requests in flight before a
planned stop) and liveness (the probe between switches). They speak HTTP through one client, `http`."""
