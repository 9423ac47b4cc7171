"""Each benchmark's own checks and arithmetic, one module per `scripts/bench_<name>.py` (its command line),
testable on a CPU; what they share (timing, the copy ceiling, tables) is minitrain/tools/bench.py."""
