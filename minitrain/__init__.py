"""minitrain: a small, fast, honest GPT training framework."""
