"""Data for drafter training: prompt sources, target rollouts on disk, anchors and blocks."""
