"""The seckill example: 50 buyers race for 10 tickets; with the lock exactly 10 are sold.

Run it with ``python -m example_worker`` (or ``seckill``); see
``example_worker/README.md`` for the modes and the compose deployment.
"""
