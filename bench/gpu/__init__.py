"""For machines with an NVIDIA GPU: ``make gpu-check`` (``check.sh``: environment, build, GPU tests,
compute-sanitizer, benchmarks, report) and its parts; see docs/gpu_check.md."""
