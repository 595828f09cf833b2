"""The seckill example (filled in by the example issue)."""
