"""`python -m blockdraft ...` (what `torchrun -m blockdraft train ...` runs)."""

from blockdraft.cli import main

raise SystemExit(main())
