"""`python -m paged.core.cli ...` (what torchrun launches on every host) is `paged ...`."""

from paged.core.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
