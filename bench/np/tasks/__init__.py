"""Benchmark tasks beyond GP regression: image completion, the TCA copy task, the wheel bandit.

Each task module holds the task's data and its train/evaluate loop; the ``python -m bench`` command line
(:mod:`bench.np.train`, :mod:`bench.np.evaluate`, :mod:`bench.np.tasks.bandit_cli`) wraps them.
"""
