"""One micro-batch through target, drafter and objective, per objective family."""
