"""Checks of exported drafters in a real serving engine against the offline evaluator."""
