"""Benchmark tasks beyond GP regression: image completion, the TCA copy task, the wheel bandit.

Each task module holds the task's data and its train/evaluate loop; the ``attn-ext`` command line
(:mod:`attn_ext.train`, :mod:`attn_ext.evaluate`, :mod:`attn_ext.tasks.bandit_cli`) wraps them.
"""
